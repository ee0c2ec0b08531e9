"""The compute dtype of the references: float32 for 16- and 32-bit inputs (statistics of bf16/fp16
tensors in float32, as the fast kernels accumulate), float64 for float64 inputs, so a float64 run
with the references (layout-parity tests, the conformance suite's float64 "want") is float64 end
to end and no float32 rounding, which would differ between layouts, creeps in."""
from __future__ import annotations

import torch


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 for a float64 ``x``, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
