"""Softmax cross-entropy and scaled masked softmax references."""
from __future__ import annotations

import torch

from omnitron.kernels.reference.precision import compute_dtype
from omnitron.kernels.registry import register


@register("softmax_cross_entropy", "reference")
def softmax_cross_entropy(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss ``[...]`` (float32; float64 for float64 logits) of ``logits [..., V]`` against ``target
    [...]``."""
    logp = torch.log_softmax(logits.to(compute_dtype(logits)), dim=-1)
    nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    if label_smoothing > 0.0:
        smooth = -logp.mean(dim=-1)
        nll = (1.0 - label_smoothing) * nll + label_smoothing * smooth
    return nll


@register("scaled_softmax", "reference")
def scaled_softmax(x: torch.Tensor, scale: float = 1.0, mask: torch.Tensor | None = None,
                   causal: bool = False) -> torch.Tensor:
    """``softmax(x * scale)`` over the last dim, where ``mask`` (True = masked out) and/or a causal
    upper triangle are set to -inf first. Computed in float32 (float64 for float64), returned in ``x.dtype``."""
    y = x.to(compute_dtype(x)) * scale
    if causal:
        sq, sk = y.shape[-2], y.shape[-1]
        tri = torch.ones(sq, sk, dtype=torch.bool, device=y.device).triu(sk - sq + 1)
        y = y.masked_fill(tri, float("-inf"))
    if mask is not None:
        y = y.masked_fill(mask, float("-inf"))
    return torch.softmax(y, dim=-1).to(x.dtype)
