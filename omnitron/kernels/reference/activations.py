"""Gated and biased activations, and bias-dropout-add."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from omnitron.kernels.registry import register


@register("swiglu", "reference")
def swiglu(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(a) * b`` where ``[a, b] = (x + bias).chunk(2, -1)``; ``x [..., 2f] -> [..., f]``."""
    if bias is not None:
        x = x + bias
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


@register("geglu", "reference")
def geglu(x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "tanh") -> torch.Tensor:
    """``gelu(a) * b`` where ``[a, b] = (x + bias).chunk(2, -1)``."""
    if bias is not None:
        x = x + bias
    a, b = x.chunk(2, dim=-1)
    return F.gelu(a, approximate=approximate) * b


@register("bias_gelu", "reference")
def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "tanh") -> torch.Tensor:
    """``gelu(x + bias)`` (tanh approximation by default, as Megatron's fused bias-GeLU)."""
    if bias is not None:
        x = x + bias
    return F.gelu(x, approximate=approximate)


@register("bias_dropout_add", "reference")
def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float,
                     training: bool = True) -> torch.Tensor:
    """``residual + dropout(x + bias, p)``."""
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=p, training=training)
