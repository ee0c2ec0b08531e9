"""Kernel inputs, written once per op, for the three places that run the kernels on made-up data:
the conformance suite (tests/kernels/test_conformance.py: every implementation against the float64
reference), the backend dispatch suite (tests/backends/test_backend_kernels.py: what a backend
resolves against the reference) and the benchmark (``omnitron bench kernels``, benchmark.py).

``cases(op, device, dtype, size)`` builds fresh random inputs on every call. ``size="test"`` is the
conformance set: odd sizes, non-contiguous views, every argument variant the op takes (keyword and
positional, optional arguments present and absent); ``tiny`` / ``small`` / ``large`` are one
benchmark workload each (smoke test, CPU, GPU). A new op registered with a non-reference
implementation needs an entry in ``OPS`` (the backend suite fails until it has one).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from omnitron.kernels import case_makers as mk
from omnitron.kernels.case_makers import Case

__all__ = ["Case", "OpCases", "OPS", "SIZES", "cases"]

SIZES = ("test", "tiny", "small", "large")


@dataclass(frozen=True)
class OpCases:
    """How one op's inputs are made and what each consumer needs besides them."""

    make: Callable[[torch.device, torch.dtype, str], list[Case]]
    """``make(device, dtype, size) -> [Case]``; every size in ``SIZES`` unless ``bench`` is False."""
    bench: bool = True
    """The benchmark times this op (``make`` takes the benchmark sizes)."""
    native: Callable | None = None
    """Stock PyTorch's fused version of the op, called like it (the benchmark's ``torch`` row)."""
    float_only: bool = False
    """The op takes float32 state whatever the dtype asked for (AdamW): the benchmark runs it once,
    in float32."""
    float64: bool = True
    """test_conformance.py's generic check runs these cases against the reference in float64 (False:
    ops it checks with a dedicated test, e.g. AdamW's steps or FP8's exact codes, or not yet)."""


def cases(op: str, device, dtype: torch.dtype, size: str = "test") -> list[Case] | None:
    """Fresh inputs for ``op`` at ``size`` (None: the op has no entry, or no benchmark workload)."""
    if size not in SIZES:
        raise ValueError(f"size {size!r}: one of {SIZES}")
    spec = OPS.get(op)
    if spec is None or (size != "test" and not spec.bench):
        return None
    return spec.make(device, dtype, size)


OPS: dict[str, OpCases] = {  # the benchmark runs its ops in this order
    "rms_norm": OpCases(mk.rms_norm, native=mk.native_rms_norm),
    "layer_norm": OpCases(mk.layer_norm, native=mk.native_layer_norm),
    "add_rms_norm": OpCases(mk.add_rms_norm, native=mk.native_add_rms_norm),
    "add_layer_norm": OpCases(mk.add_layer_norm, bench=False),
    "swiglu": OpCases(mk.swiglu),
    "geglu": OpCases(mk.geglu),
    "bias_gelu": OpCases(mk.bias_gelu),
    "bias_dropout_add": OpCases(mk.bias_dropout_add, bench=False, float64=False),
    "rope": OpCases(mk.rope),
    "softmax_cross_entropy": OpCases(mk.softmax_cross_entropy, native=mk.native_cross_entropy),
    "cross_entropy_shard_stats": OpCases(mk.cross_entropy_shard_stats),
    "cross_entropy_shard_grad": OpCases(mk.cross_entropy_shard_grad),
    "scaled_softmax": OpCases(mk.scaled_softmax),
    "attention": OpCases(mk.attention, bench=False, float64=False),
    "attention_block_forward": OpCases(mk.attention_block_forward, bench=False, float64=False),
    "attention_block_backward": OpCases(mk.attention_block_backward, bench=False, float64=False),
    "adamw_step": OpCases(mk.adamw_step, native=mk.native_adamw, float_only=True, float64=False),
    "grad_norm_sq": OpCases(mk.grad_norm_sq, native=mk.native_grad_norm_sq, float64=False),
    "fp8_cast_transpose_amax": OpCases(mk.fp8_cast_transpose_amax, float64=False),
    "fp8_cast_transpose_from_amax": OpCases(mk.fp8_cast_transpose_from_amax, bench=False, float64=False),
    "fp8_amax_history_push": OpCases(mk.fp8_amax_history_push, bench=False, float64=False),
}
