"""Writes ``fixtures.json`` beside this file WITH MEGATRON-LM'S OWN LLaVAModel: what omnitron's must reproduce.

Needs a Megatron-LM checkout (snapshot d98e8a64dd was used) and torch; CPU, offline, one process (gloo).
Run from the omnitron root:

    MEGATRON_LM=/path/to/Megatron-LM python tests/models/megatron_llava/make_fixtures.py

omnitron is not imported. Megatron's model is built as ``pretrain_vlm`` builds it with ``transformer_impl local``
(CLIP ViT with its local layer spec, the MLP projector, a GPT decoder), float64, no dropout; its parameters are
overwritten with draws from a seeded generator in the order of omnitron's parameter names (:func:`omnitron_name`),
so the test draws the same weights, and the whole model is compared: the CLIP ViT (bias-free ``conv1``, class token,
positions, ``ln_pre``, layers, no final norm), projector, image-token substitution, decoder, loss and its mask,
freezing. Stored per case: the ViT's output (``vit``: Megatron's ``CLIPViTModel`` forward, ``[b, 1 + n, hv]``), the
loss mask Megatron's preprocessing made, the per-token loss, and per parameter its gradient's norm and its dot
product with a seeded random direction.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import typing

if not hasattr(typing, "override"):
    typing.override = lambda f: f
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
SIZES = dict(H=32, HV=24, L=2, LV=2, NH=4, FF=48, FFV=40, PF=36, V=61, IMG=16, IMGW=24, P=8, B=2, T=9)
# name -> (bias-GeLU fusion, position embedding, frozen tower, tied output layer, seed)
CASES = {"fused_rope": (True, "rope", None, False, 11), "exact_learned_frozen_vit": (False, "learned_absolute",
         "vit", False, 12), "fused_learned_frozen_lm_tied": (True, "learned_absolute", "lm", True, 13)}


class CoreAttention(torch.nn.Module):
    """softmax(q k^T / sqrt(d)) v, causal or not, in plain torch (Megatron's local core attention needs a GPU)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **kw):
        super().__init__()
        self.causal = attn_mask_type.name == "causal"

    def forward(self, q, k, v, mask, packed_seq_params=None, attn_mask_type=None, **kw):
        s = torch.einsum("sbhd,tbhd->bhst", q, k) / q.shape[-1] ** 0.5
        if self.causal:
            s = s.masked_fill(torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("bhst,tbhd->sbhd", s.softmax(-1), v)
        return o.reshape(o.shape[0], o.shape[1], -1)


def omnitron_name(mn: str) -> str:
    """Megatron's parameter name -> omnitron's."""
    if mn.startswith("vision_model."):
        return mn.replace("conv1.weight", "patch_embedding.weight")
    if mn.startswith("vision_projection.encoder."):
        return mn.replace("vision_projection.encoder.", "vision_projection.")
    return mn.removeprefix("language_model.")


def build(fused: bool, pos: str, frozen, tied: bool):
    import megatron.core.models.vision.clip_vit_model as cv
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.multimodal.llava_model import LLaVAModel
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.transformer.spec_utils import get_submodules
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    d = list(cv.CLIPViTModel.__init__.__defaults__)  # without TE its default norm is torch's (no config kwarg)
    d[0] = d[1] = WrappedTorchNorm
    cv.CLIPViTModel.__init__.__defaults__ = tuple(d)
    z = SIZES
    kw = dict(hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float64,
              masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
              apply_rope_fusion=False, layernorm_epsilon=1e-5, add_bias_linear=True, activation_func=F.gelu,
              normalization="LayerNorm", bias_activation_fusion=fused, num_attention_heads=z["NH"])
    lc = TransformerConfig(num_layers=z["L"], hidden_size=z["H"], ffn_hidden_size=z["FF"], **kw)
    vc = TransformerConfig(num_layers=z["LV"], hidden_size=z["HV"], ffn_hidden_size=z["FFV"], **kw)
    vc.vision_model_type = "clip"
    pc = TransformerConfig(num_layers=1, hidden_size=z["H"], ffn_hidden_size=z["PF"], **kw)
    ls, vs = get_gpt_layer_local_spec(), get_vit_layer_with_local_spec()
    for spec in (ls, vs):
        spec.submodules.self_attention.submodules.core_attention = CoreAttention
    n = (z["IMG"] // z["P"]) * (z["IMGW"] // z["P"])
    m = LLaVAModel(language_transformer_config=lc, language_transformer_layer_spec=ls, language_vocab_size=z["V"],
                   language_max_sequence_length=z["T"] - 1 + n, vision_transformer_config=vc,
                   vision_transformer_layer_spec=vs, drop_vision_class_token=True, vision_projection_config=pc,
                   vision_projection_layer_spec=get_submodules(ls.submodules.mlp), vision_projection_type="mlp",
                   language_position_embedding_type=pos, img_h=z["IMG"], img_w=z["IMGW"], patch_dim=z["P"],
                   share_embeddings_and_output_weights=tied)
    m.freeze(freeze_language_model=frozen == "lm", freeze_vision_model=frozen == "vit", freeze_vision_projection=False)
    return m.double()


def run_case(fused, pos, frozen, tied, seed) -> dict:
    z = SIZES
    model = build(fused, pos, frozen, tied)
    params = {omnitron_name(k): p for k, p in model.named_parameters()}
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            p.copy_((torch.randn(p.numel(), generator=g, dtype=torch.float64) * 0.3 + (p.dim() == 1)).view(p.shape))
    images = torch.randn(z["B"], 3, z["IMG"], z["IMGW"], generator=g, dtype=torch.float64)
    vit = model.vision_model(images).detach()  # CLIPViTModel.forward: [b, 1 + n, hv], the class token first
    text = torch.randint(1, z["V"], (z["B"], z["T"] + 1), generator=g)
    text[:, 0] = -200  # pretrain_vlm's layout: one image token, then the text; labels are the next tokens
    mask = (torch.rand(z["B"], z["T"], generator=g) > 0.2).double()
    mask[:, 0] = 0.0
    labels = text[:, 1:].clone()
    labels[:, 0] = text[:, 1]
    tokens = text[:, :-1]
    loss, final_mask = model(images, tokens, torch.arange(z["T"])[None].expand(z["B"], -1), None, labels=labels,
                             loss_mask=mask)
    final_mask = final_mask.double()
    ((loss.double() * final_mask).sum() / final_mask.sum()).backward()
    out = {"case": [fused, pos, frozen, tied, seed], "images": images.flatten().tolist(), "tokens": tokens.tolist(),
           "labels": labels.tolist(), "vit": vit.flatten().tolist(), "final_loss_mask": final_mask.tolist(),
           "token_loss": (loss.double() * final_mask).tolist(), "grads": {}}
    gd = torch.Generator().manual_seed(seed + 100)
    for name in sorted(params):
        direction = torch.randn(params[name].numel(), generator=gd, dtype=torch.float64)
        grad = params[name].grad
        out["grads"][name] = None if grad is None else [float(grad.norm()), float(grad.flatten() @ direction)]
    return out


def main() -> None:
    sys.path.insert(0, os.environ["MEGATRON_LM"])
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self  # CLIPViTModel puts its position ids on the GPU
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    fixtures = {"sizes": SIZES, "cases": {name: run_case(*case) for name, case in CASES.items()}}
    with open(os.path.join(HERE, "fixtures.json"), "w") as f:
        json.dump(fixtures, f)


if __name__ == "__main__":
    main()
