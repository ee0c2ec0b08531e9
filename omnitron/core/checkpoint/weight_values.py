"""Values an imported checkpoint must not carry into training: a NaN / inf weight (a corrupt or diverged
checkpoint; every loss of the run would be NaN) or an integer / bool tensor where a weight belongs (a quantized
checkpoint, or a buffer under a weight's name; the import would cast it to float and train on codes).

One pass over each tensor as loaded, in slices, so the check allocates at most a slice's flags (no copy of a
tensor, let alone of the model)."""
from __future__ import annotations

from typing import Iterable

import torch

_SLICE = 1 << 22
"""Elements tested per step: the flags of one slice (4 MiB of bool; 16 MiB of float32 for a float8 slice)."""


def weight_problem(t: torch.Tensor) -> str | None:
    """Why tensor ``t`` cannot be imported as a weight, or None."""
    if not t.is_floating_point():
        return f"is {str(t.dtype).replace('torch.', '')}, not a floating-point weight"
    flat = t.reshape(-1)  # a view of the loaded (contiguous) tensor
    up = flat.element_size() == 1  # float8: no isfinite kernel; its values are exact in float32
    for i in range(0, flat.numel(), _SLICE):
        part = flat[i:i + _SLICE]
        ok = torch.isfinite(part.float() if up else part)
        if not bool(ok.all()):
            bad = int((~ok).nonzero()[0, 0]) + i
            return f"holds {'NaN' if torch.isnan(flat[bad:bad + 1].float()).item() else 'inf'} (element {bad})"
    return None


def first_bad_weight(tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, str] | None:
    """(name, why) of the first ``(name, tensor)`` pair whose tensor :func:`weight_problem` refuses, or None."""
    for name, t in tensors:
        why = weight_problem(t)
        if why is not None:
            return name, why
    return None


def fix_for(why: str) -> str:
    """The remedy clause of a refusal for reason ``why``."""
    if "floating-point" in why:
        return "import an unquantized (bf16 / fp16 / fp32) checkpoint"
    return "the file is corrupt or the run it came from diverged; re-download it or use an earlier checkpoint"
