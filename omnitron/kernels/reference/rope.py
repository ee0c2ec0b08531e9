"""Rotary position embedding reference (rotate-half or interleaved pairs, partial rotary)."""
from __future__ import annotations

import torch

from omnitron.kernels.registry import register


@register("rope", "reference")
def rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first ``2 * freqs.shape[-1]`` channels of ``t`` by angles ``freqs``.

    ``t`` is ``[s, b, h, d]`` or ``[b, s, h, d]``; ``freqs`` holds one angle per rotated pair,
    shaped to broadcast against ``t[..., :r // 2]`` (``[s, 1, 1, r/2]`` or ``[1, s, 1, r/2]``).
    Non-interleaved pairs channel ``i`` with ``i + r/2``; interleaved pairs ``2i`` with ``2i+1``.
    Channels past ``r`` pass through (partial rotary). Computed in float32, returned in ``t.dtype``.
    """
    half = freqs.shape[-1]
    rot, rest = t[..., : 2 * half].float(), t[..., 2 * half:]
    cos, sin = freqs.float().cos(), freqs.float().sin()
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((out.to(t.dtype), rest), dim=-1) if rest.shape[-1] else out.to(t.dtype)
