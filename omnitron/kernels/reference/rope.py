"""Rotary position embedding reference (rotate-half or interleaved pairs, partial rotary)."""
from __future__ import annotations

import torch

from omnitron.kernels.reference.precision import compute_dtype
from omnitron.kernels.registry import register


@register("rope", "reference")
def rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first ``2 * freqs.shape[-1]`` channels of ``t`` by angles ``freqs``.

    ``t`` is ``[s, b, h, d]`` or ``[b, s, h, d]``; ``freqs`` holds one angle per rotated pair,
    shaped to broadcast against ``t[..., :r // 2]`` (``[s, 1, 1, r/2]`` or ``[1, s, 1, r/2]``).
    Non-interleaved pairs channel ``i`` with ``i + r/2``; interleaved pairs ``2i`` with ``2i+1``.
    Channels past ``r`` pass through (partial rotary). Computed in float32 (float64 for float64), returned in
    ``t.dtype``.
    """
    half = freqs.shape[-1]
    cdt = compute_dtype(t)
    rot, rest = t[..., : 2 * half].to(cdt), t[..., 2 * half:]
    cos, sin = freqs.to(cdt).cos(), freqs.to(cdt).sin()
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((out.to(t.dtype), rest), dim=-1) if rest.shape[-1] else out.to(t.dtype)


def rope_call_problem(t: torch.Tensor, freqs: torch.Tensor, who: str) -> str | None:
    """Why a fused rope (named ``who``) cannot take this call, or None: the shape preconditions
    every fused implementation shares (4-D ``t``, angles without gradient, ``freqs`` broadcasting
    to ``t[..., :r/2]`` without enlarging it)."""
    if t.dim() != 4:
        return f"t has {t.dim()} dims; the {who} rope takes [s, b, h, d] or [b, s, h, d]"
    if freqs.requires_grad:
        return f"freqs requires grad; the {who} rope differentiates with respect to t only"
    half = freqs.shape[-1]
    if 2 * half > t.shape[-1]:
        return f"rotary dim {2 * half} exceeds head dim {t.shape[-1]}"
    target = (*t.shape[:3], half)
    try:
        if freqs.dim() > 4 or torch.broadcast_shapes(freqs.shape, target) != target:
            return f"freqs {tuple(freqs.shape)} would broadcast t[..., :r/2] {target} to a larger shape"
    except RuntimeError:
        return f"freqs {tuple(freqs.shape)} does not broadcast to t[..., :r/2] {target}"
    return None
