"""RMSNorm and LayerNorm references: statistics in float32, output in the input dtype."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from omnitron.kernels.registry import register


@register("rms_norm", "reference")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` over the last dim; returns ``x.dtype``."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


@register("layer_norm", "reference")
def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim with affine ``weight``/``bias``; returns ``x.dtype``."""
    y = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), None if bias is None else bias.float(), eps)
    return y.to(x.dtype)
