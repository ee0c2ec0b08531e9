"""The ``example`` kernel implementations: one fused op, registered the way a vendor registers its own.

``rms_norm`` here normalises in float32 whatever the input dtype and casts once at the end (a vendor would
call its library). ``supports`` declines what it does not handle (the engine then runs the reference and
logs the reason once); ``available`` says whether it can run in this process at all.
"""
from __future__ import annotations

import torch

from omnitron.kernels.registry import register


def _supports(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> str | None:
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"fp32/bf16/fp16 only, got {x.dtype}"
    return None


@register("rms_norm", "example", available=lambda: (True, ""), supports=_supports)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)
