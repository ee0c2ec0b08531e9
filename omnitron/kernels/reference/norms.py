"""RMSNorm and LayerNorm references: statistics in float32 (float64 for float64), output in the input dtype."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from omnitron.kernels.reference.precision import compute_dtype
from omnitron.kernels.registry import register


@register("rms_norm", "reference")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` over the last dim; returns ``x.dtype``."""
    xf = x.to(compute_dtype(x))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(xf.dtype)).to(x.dtype)


@register("layer_norm", "reference")
def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim with affine ``weight``/``bias``; returns ``x.dtype``."""
    cdt = compute_dtype(x)
    y = F.layer_norm(x.to(cdt), (x.shape[-1],), weight.to(cdt), None if bias is None else bias.to(cdt), eps)
    return y.to(x.dtype)
