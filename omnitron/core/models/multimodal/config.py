"""LLaVA-style multimodal configuration: the GPT fields describe the language model, plus the vision tower.

:class:`MultimodalConfig` subclasses :class:`GPTConfig`: its GPT fields (``--num-layers``,
``--hidden-size``, ``--seq-length``, ...) ARE the language model's, so every GPT derived-value function
applies to the language model as is. The vision tower's own fields carry a ``vision_`` prefix (or
Megatron's image names ``--img-h``, ``--img-w``, ``--patch-dim``, ``--num-channels``); the ViT's
Transformer settings come out of :func:`vision_config` as a plain :class:`GPTConfig` (derived, never
written back), so the shared Transformer layer builds both towers. The config is flat because the CLI
flags are generated from the fields; the two towers are composed by these two views of it.

Sequence layout (see :mod:`omnitron.core.models.multimodal.llava`): every sample's ``tokens`` hold
:func:`num_image_tokens` placeholders ``IMAGE_TOKEN`` (Megatron's ``IMAGE_TOKEN_INDEX``, -200); the
projected patch embeddings replace them, in order.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from omnitron.core.config.parallel import ConfigError, ParallelConfig
from omnitron.core.models.gpt.config import GPTConfig, ffn_size, validate_model
from omnitron.core.models.gpt.config import num_parameters as gpt_num_parameters

IMAGE_TOKEN = -200
"""The placeholder id of one image embedding in ``tokens`` (Megatron's IMAGE_TOKEN_INDEX); never looked
up in the word embedding. As a label it means "an image position": no loss there."""


@dataclass(kw_only=True)
class MultimodalConfig(GPTConfig):
    """A ViT vision encoder, an MLP projector and a GPT decoder (Megatron's ``pretrain_vlm``, LLaVA)."""

    img_h: int = 32
    """--img-h: image height in pixels (a multiple of --patch-dim)."""
    img_w: int = 32
    """--img-w: image width in pixels (a multiple of --patch-dim)."""
    patch_dim: int = 8
    """--patch-dim: side of the square ViT patches; (img-h / patch-dim) x (img-w / patch-dim) image tokens."""
    num_channels: int = 3
    """--num-channels: image channels (3: RGB)."""
    vision_num_layers: int = 2
    """--vision-num-layers: Transformer layers of the ViT encoder (bidirectional attention)."""
    vision_hidden_size: int = 64
    """--vision-hidden-size: width of the ViT residual stream."""
    vision_num_attention_heads: int = 4
    """--vision-num-attention-heads: ViT attention heads (divisible by --tensor-model-parallel-size)."""
    vision_ffn_hidden_size: int | None = None
    """--vision-ffn-hidden-size: ViT MLP width; default 4 x --vision-hidden-size."""
    vision_class_token: bool = True
    """--vision-class-token: a learned class token leads the ViT sequence (--no-vision-class-token: none); its
    output is dropped before the projector (as Megatron's LLaVA drops it), so it only shapes the patch features."""
    projector_ffn_hidden_size: int | None = None
    """--projector-ffn-hidden-size: hidden width of the 2-layer GeLU projector; default --hidden-size."""
    freeze_vision_model: bool = False
    """--freeze-vision-model (Megatron's --freeze-ViT): the ViT's parameters get no gradient and no update."""
    freeze_language_model: bool = False
    """--freeze-language-model (Megatron's --freeze-LM): the language model's parameters (embeddings, layers,
    output) get no gradient and no update; gradients still flow through it to the projector."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for flag, v in (("--img-h", self.img_h), ("--img-w", self.img_w), ("--patch-dim", self.patch_dim),
                        ("--num-channels", self.num_channels), ("--vision-num-layers", self.vision_num_layers),
                        ("--vision-hidden-size", self.vision_hidden_size),
                        ("--vision-num-attention-heads", self.vision_num_attention_heads)):
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{flag} must be a positive integer, got {v!r}")
        for flag, v in (("--vision-ffn-hidden-size", self.vision_ffn_hidden_size),
                        ("--projector-ffn-hidden-size", self.projector_ffn_hidden_size)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"{flag} must be a positive integer, got {v!r}")
        for flag, side in (("--img-h", self.img_h), ("--img-w", self.img_w)):
            if side % self.patch_dim:
                raise ConfigError(f"{flag} {side} is not a multiple of --patch-dim {self.patch_dim}; the image is cut "
                                  "into whole patches: change one of them")


# ---- derived values ------------------------------------------------------------------------
def num_image_tokens(c: MultimodalConfig) -> int:
    """Image embeddings per sample = patches (the class token is dropped before the projector)."""
    return (c.img_h // c.patch_dim) * (c.img_w // c.patch_dim)


def vision_seq_length(c: MultimodalConfig) -> int:
    """The ViT's sequence: patches plus the class token."""
    return num_image_tokens(c) + int(c.vision_class_token)


def patch_size(c: MultimodalConfig) -> int:
    """Values per flattened patch (the patch embedding's input width)."""
    return c.num_channels * c.patch_dim * c.patch_dim


def projector_ffn_size(c: MultimodalConfig) -> int:
    return c.projector_ffn_hidden_size or c.hidden_size


def vision_config(c: MultimodalConfig) -> GPTConfig:
    """The ViT's Transformer settings as a GPTConfig (CLIP-style: LayerNorm, GeLU MLP, biases, learned
    positions); dropout, init, norm epsilon and the GeLU's form (``--no-bias-gelu-fusion``: exact, else tanh)
    follow the language model's flags, as Megatron's ViT config is a copy of the language model's."""
    n = vision_seq_length(c)
    return GPTConfig(num_layers=c.vision_num_layers, hidden_size=c.vision_hidden_size,
                     num_attention_heads=c.vision_num_attention_heads, ffn_hidden_size=c.vision_ffn_hidden_size,
                     seq_length=n, max_position_embeddings=n, vocab_size=1, make_vocab_size_divisible_by=1,
                     layernorm_epsilon=c.layernorm_epsilon, hidden_dropout=c.hidden_dropout,
                     attention_dropout=c.attention_dropout, init_method_std=c.init_method_std,
                     apply_scaled_init=c.apply_scaled_init, params_dtype=c.params_dtype,
                     bias_gelu_fusion=c.bias_gelu_fusion,
                     recompute_granularity="selective" if c.recompute_granularity == "selective" else None)


def validate_multimodal(c: MultimodalConfig, parallel: ParallelConfig) -> None:
    """The language model's GPT checks, the ViT's against tensor parallelism (it runs without sequence
    parallelism: its sequence need not divide tp), and what is not wired here; errors name flag and fix."""
    if parallel.pipeline_model_parallel_size > 1:
        raise ConfigError(f"--pipeline-model-parallel-size {parallel.pipeline_model_parallel_size}: the multimodal "
                          "model runs as one stage here (the vision tower feeds the first layer); use "
                          "--pipeline-model-parallel-size 1 and tensor/data parallelism")
    if parallel.context_parallel_size > 1:
        raise ConfigError(f"--context-parallel-size {parallel.context_parallel_size}: image tokens are not split "
                          "over context-parallel ranks here; use --context-parallel-size 1")
    validate_model(c, parallel)
    tp = parallel.tensor_model_parallel_size
    vc = vision_config(c)
    if vc.hidden_size % vc.num_attention_heads:
        raise ConfigError(f"--vision-hidden-size {vc.hidden_size} is not divisible by --vision-num-attention-heads "
                          f"{vc.num_attention_heads}; change one of them")
    if vc.num_attention_heads % tp:
        raise ConfigError(f"--vision-num-attention-heads {vc.num_attention_heads} is not divisible by "
                          f"--tensor-model-parallel-size {tp}; use a tensor-parallel size that divides it")
    for flag, width in (("--vision-ffn-hidden-size", ffn_size(vc)), ("--projector-ffn-hidden-size",
                                                                     projector_ffn_size(c))):
        if width % tp:
            raise ConfigError(f"{flag} {width} is not divisible by --tensor-model-parallel-size {tp}")
    validate_model(vc, replace(parallel, sequence_parallel=False))
    if num_image_tokens(c) >= c.seq_length:
        raise ConfigError(f"--seq-length {c.seq_length} leaves no room for text after the {num_image_tokens(c)} "
                          f"image tokens ((--img-h / --patch-dim) x (--img-w / --patch-dim)); raise --seq-length or "
                          "--patch-dim")


def num_parameters(c: MultimodalConfig, *, tp: int = 1) -> int:
    """Parameters of the whole model: the language model (GPT's count), the ViT (patch embedding without bias,
    class token, positions, ``ln_pre``, layers) and the projector."""
    vc = vision_config(c)
    hv, f = c.vision_hidden_size, projector_ffn_size(c)
    # GPT's count holds a 1-row "vocabulary" (no words here) and a final norm, the size of the ViT's ln_pre
    vit = gpt_num_parameters(vc, tp=tp) - vc.hidden_size
    vit += patch_size(c) * hv + int(c.vision_class_token) * hv
    return gpt_num_parameters(c, tp=tp) + vit + hv * f + f + f * c.hidden_size + c.hidden_size


def llava_tiny(**overrides) -> MultimodalConfig:
    """Debug LLaVA: 32x32 RGB images in 8x8 patches (16 image tokens), a 2-layer ViT (hidden 64), a 2-layer
    GPT-2 style decoder (hidden 64) over the GPT-2 vocabulary, sequence 32."""
    return replace(MultimodalConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                                    seq_length=32, max_position_embeddings=32, vocab_size=50257), **overrides)


__all__ = ["IMAGE_TOKEN", "MultimodalConfig", "llava_tiny", "num_image_tokens", "num_parameters", "patch_size",
           "projector_ffn_size", "validate_multimodal", "vision_config", "vision_seq_length"]
