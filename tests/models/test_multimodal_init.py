"""LLaVA's vision tower and projector initialised as Megatron's ``pretrain_vlm`` draws them (``CLIPViTModel``,
``MultimodalProjector``, the configs deep-copied from the language model's: read in Megatron-LM d98e8a6 and
checked there, a copied ``TransformerConfig`` keeps the language model's ``output_layer_init_method``).

Per tensor, on a fresh draw (random seed): the method (uniform: no value beyond the bound and one near it; normal:
values beyond the uniform's reach) and the sample std against the method's. Sampling bound: for n i.i.d. values the
sample std's relative error has standard deviation ``1 / sqrt(2 n)`` under a normal law (``Var(x^2) = 2 s^4``) and
``sqrt(0.2 / n)`` under a uniform one (``Var(x^2) = 4 b^4 / 45`` against ``E x^2 = b^2 / 3``, halved for the square
root); the test allows 6 of them (a false failure about once in 10^9 per tensor)."""
from __future__ import annotations

import math
import os

import torch

from omnitron.core.models.multimodal import LLaVAModel
from omnitron.core.models.multimodal.config import llava_tiny
from omnitron.core.parallel.groups import ParallelGroups

L, STD, HV, P = 6, 0.02, 256, 8  # language layers, --init-method-std, ViT width, patch side


def _problem(t: torch.Tensor, kind: str, std: float) -> str | None:
    """Why tensor ``t`` is not a draw of ``kind`` (uniform or normal) with standard deviation ``std``, or None."""
    x, n = t.detach().double().flatten(), t.numel()
    got, top = x.pow(2).mean().sqrt().item(), x.abs().max().item()  # about zero mean: the spread the init draws
    if kind == "uniform":
        bound = std * math.sqrt(3)
        if not bound * (1 - 20 / n) <= top <= bound:
            return f"largest |value| {top:.4g}, not just under the uniform's bound {bound:.4g}"
        tol = 6 * math.sqrt(0.2 / n)
    else:
        if top <= std * math.sqrt(3):
            return f"no value beyond a uniform's reach ({top:.4g}): not normal"
        tol = 6 / math.sqrt(2 * n)
    return f"std {got:.4g}, Megatron's {std:.4g} (tolerance {tol:.2%})" if abs(got / std - 1) >= tol else None


def test_vision_tower_and_projector_init_as_megatron():
    c = llava_tiny(num_layers=L, init_method_std=STD, vision_hidden_size=HV, vision_num_attention_heads=4,
                   img_h=8 * P, img_w=8 * P, patch_dim=P, seq_length=80, max_position_embeddings=80)
    seed = int.from_bytes(os.urandom(4), "little")
    params = dict(LLaVAModel(c, ParallelGroups.single(), seed=seed).named_parameters())
    out_std = STD / math.sqrt(2 * L)  # the language model's L, not the ViT's 2 layers
    want = {
        "vision_model.patch_embedding.weight": ("uniform", 1 / math.sqrt(3 * 3 * P * P)),  # Conv2d's default
        "vision_model.class_token": ("normal", 1.0),  # torch.randn
        "vision_model.position_embeddings.weight": ("normal", 1.0),  # nn.Embedding's default
        "vision_projection.linear_fc1.weight": ("normal", STD),
        "vision_projection.linear_fc2.weight": ("normal", out_std),
        "vision_model.decoder.layers.0.self_attention.linear_qkv.weight": ("normal", STD),
        "vision_model.decoder.layers.1.self_attention.linear_proj.weight": ("normal", out_std),
        "vision_model.decoder.layers.0.mlp.linear_fc1.weight": ("normal", STD),
        "vision_model.decoder.layers.1.mlp.linear_fc2.weight": ("normal", out_std),
    }
    problems = {name: _problem(params[name], kind, std) for name, (kind, std) in want.items()}
    assert not {n: p for n, p in problems.items() if p}, problems
    for name in ("vision_model.ln_pre.bias", "vision_projection.linear_fc1.bias", "vision_projection.linear_fc2.bias"):
        assert not params[name].any(), name
    assert (params["vision_model.ln_pre.weight"] == 1).all()
    assert "vision_model.patch_embedding.bias" not in params  # Megatron's conv1: bias=False
