"""Residual add fused with the following norm (pre-norm blocks): ``h = x + residual`` is both the
next residual stream and the norm's input. References for ``add_rms_norm`` / ``add_layer_norm``."""
from __future__ import annotations

import torch

from omnitron.kernels.reference.norms import layer_norm, rms_norm
from omnitron.kernels.registry import register


@register("add_rms_norm", "reference")
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(h, weight, eps), h)`` with ``h = x + residual`` in ``x.dtype``."""
    h = x + residual
    return rms_norm(h, weight, eps), h


@register("add_layer_norm", "reference")
def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer_norm(h, weight, bias, eps), h)`` with ``h = x + residual`` in ``x.dtype``."""
    h = x + residual
    return layer_norm(h, weight, bias, eps), h
