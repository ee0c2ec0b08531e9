"""FP8 cast + transpose + amax reference (the quantisation step of an FP8 linear layer)."""
from __future__ import annotations

import math

import torch

from omnitron.kernels.registry import register

FORMATS = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}


@register("fp8_cast_transpose_amax", "reference")
def fp8_cast_transpose_amax(x: torch.Tensor, scale: torch.Tensor, fmt: str = "e4m3"):
    """``(q, q_t, amax)``: ``q = saturate(x * scale)`` cast to FP8 ``fmt`` (round to nearest even),
    ``q_t = q.t()`` contiguous (the operand layout the weight/input-gradient GEMMs need), and
    ``amax = max |x|`` as a float32 scalar (NaN when ``x`` holds a NaN). ``x`` is 2-D ``[m, n]``;
    ``scale`` a float32 scalar tensor (per-tensor quantisation scale, not its reciprocal)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown FP8 format {fmt!r}: use one of {sorted(FORMATS)}")
    if x.dim() != 2:
        raise ValueError(f"fp8_cast_transpose_amax takes a 2-D [m, n] tensor, got shape {tuple(x.shape)}: "
                         "flatten leading dims first (x.reshape(-1, x.shape[-1]))")
    dtype, limit = FORMATS[fmt]
    x = x.detach()
    q = x.to(torch.float32, copy=True).mul_(scale.float()).clamp_(-limit, limit).to(dtype)
    # max |x| in one reduction (no |x| temporary); exact, and NaN propagates
    amax = torch.linalg.vector_norm(x, math.inf, dtype=torch.float32) if x.numel() else \
        torch.zeros((), dtype=torch.float32, device=x.device)
    return q, q.t().contiguous(), amax
