"""The vision tower: a ViT encoder and the MLP projector into the language model's width.

ViT, Megatron's ``CLIPViTModel`` (subtype ``clip``): ``images [b, C, H, W]`` -> non-overlapping ``p x p`` patches
flattened in ``(C, p, p)`` order (what a stride-``p`` convolution reads) -> a linear patch embedding without bias
(Megatron's ``conv1``, ``bias=False``) -> optional class token first -> learned positions -> ``ln_pre`` -> the shared
pre-LN Transformer layers attending bidirectionally (BERT's layer with no padding) -> the patch outputs ``[n, b, hv]``
(the class token's output dropped). No norm after the layers: Megatron's CLIP ViT builds its block without
``post_process``, so its last layer's output goes to the projector as is.

Tensor parallelism goes through the shared layers (column-parallel QKV/fc1, row-parallel proj/fc2); the
ViT runs WITHOUT sequence parallelism (``patches + 1`` need not divide tp): its activations are replicated
over tp, so the replicated patch/position/class-token parameters get full, identical gradients.

Projector (Megatron's ``mlp`` projector): column-parallel ``fc1`` -> GeLU -> row-parallel ``fc2``, its output
all-reduced: ``[n, b, h]`` replicated over tp, ready to replace placeholder embeddings. Megatron builds it from
the language model's MLP and config, so its GeLU is the tanh form under bias-GeLU fusion (the default) and
exact with ``--no-bias-gelu-fusion``; the ViT's layers follow the same flag (:func:`MM.vision_config`).

Init, per tensor as Megatron's ``pretrain_vlm`` draws it (``CLIPViTModel``, ``MultimodalProjector``): the patch
embedding as torch's default for its ``Conv2d`` (uniform on ``+-1 / sqrt(C p p)``); ``ln_pre`` ones and zeros;
the class token and the position embeddings ``N(0, 1)`` (``torch.randn``, ``nn.Embedding``'s
default); every output projection, the ViT layers' and the projector's ``fc2``, ``N(0, std / sqrt(2 L))`` with
``L`` the LANGUAGE model's ``--num-layers`` (the ViT's and the projector's configs are deep copies of the language
model's, made after its ``output_layer_init_method`` was fixed); other weights ``N(0, std)``, biases zero.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from omnitron.core.models.bert.model import BertLayer
from omnitron.core.models.multimodal import config as MM
from omnitron.core.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from omnitron.core.parallel.tensor.sharding import set_attributes
from omnitron.core.transformer.norm import Norm


def output_std(c: MM.MultimodalConfig) -> float:
    """The init std of every output projection of the vision tower and projector: the language model's."""
    return c.init_method_std / math.sqrt(2.0 * c.num_layers) if c.apply_scaled_init else c.init_method_std


def patchify(images: torch.Tensor, p: int) -> torch.Tensor:
    """``[b, C, H, W] -> [b, (H/p) * (W/p), C * p * p]``, patches in row-major order over the image."""
    b, ch, h, w = images.shape
    x = images.reshape(b, ch, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)  # [b, H/p, W/p, C, p, p]
    return x.reshape(b, (h // p) * (w // p), ch * p * p)


class VisionTransformer(nn.Module):
    """``images [b, C, H, W]`` -> patch features ``[n, b, hv]`` (see the module docstring)."""

    def __init__(self, c: MM.MultimodalConfig, *, group, tracker, backend) -> None:
        super().__init__()
        vc = MM.vision_config(c)
        self.c, self.patch_dim, self.class_token_len = c, c.patch_dim, int(c.vision_class_token)
        self.patch_embedding = nn.Linear(MM.patch_size(c), vc.hidden_size, bias=False, dtype=vc.params_dtype)
        set_attributes(self.patch_embedding.weight, parallel=False,
                       init=("uniform", MM.patch_size(c) ** -0.5))  # Conv2d's default (module docstring)
        self.class_token = None
        if c.vision_class_token:
            self.class_token = set_attributes(nn.Parameter(torch.empty(1, 1, vc.hidden_size, dtype=vc.params_dtype)),
                                              parallel=False, init=("normal", 1.0))
        self.position_embeddings = nn.Embedding(MM.vision_seq_length(c), vc.hidden_size, dtype=vc.params_dtype)
        set_attributes(self.position_embeddings.weight, parallel=False, init=("normal", 1.0))
        self.ln_pre = Norm(vc.hidden_size, kind=vc.normalization, eps=vc.layernorm_epsilon, backend=backend,
                           dtype=vc.params_dtype)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleDict({
            str(i): BertLayer(vc, group=group, sequence_parallel=False, tracker=tracker, backend=backend)
            for i in range(vc.num_layers)})
        for layer in self.decoder.layers.values():  # the language model's output std (module docstring)
            for lin in (layer.self_attention.linear_proj, layer.mlp.linear_fc2):
                lin.weight.init = ("normal", output_std(c))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        c = self.c
        if images.dim() != 4 or tuple(images.shape[1:]) != (c.num_channels, c.img_h, c.img_w):
            raise ValueError(f"images must be [batch, {c.num_channels}, {c.img_h}, {c.img_w}] (--num-channels, "
                             f"--img-h, --img-w), got {tuple(images.shape)}")
        x = self.patch_embedding(patchify(images.to(self.patch_embedding.weight.dtype), self.patch_dim))  # [b, n, hv]
        if self.class_token is not None:
            x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.ln_pre(x + self.position_embeddings.weight[None]).transpose(0, 1).contiguous()  # [n(+1), b, hv]
        no_padding = torch.zeros(x.shape[1], x.shape[0], dtype=torch.bool, device=x.device)  # bidirectional
        for layer in self.decoder.layers.values():
            x = layer(x, no_padding)
        return x[self.class_token_len:]  # [n, b, hv]


class VisionProjection(nn.Module):
    """``[n, b, hv] -> [n, b, h]``: ``fc2(gelu(fc1(x)))``, fc1 column- and fc2 row-parallel (output replicated);
    the GeLU tanh-approximated unless ``--no-bias-gelu-fusion`` (see the module docstring)."""

    def __init__(self, c: MM.MultimodalConfig, *, group) -> None:
        super().__init__()
        self.gelu_form = "tanh" if c.bias_gelu_fusion else "none"
        f, kw = MM.projector_ffn_size(c), dict(group=group, bias=True, sequence_parallel=False, dtype=c.params_dtype)
        self.linear_fc1 = ColumnParallelLinear(c.vision_hidden_size, f, init_std=c.init_method_std, **kw)
        self.linear_fc2 = RowParallelLinear(f, c.hidden_size, init_std=output_std(c), **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.gelu_form))
