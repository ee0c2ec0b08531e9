"""Triton implementations of the fused ops, registered as ``"triton"`` for the GPU backends.

Targets CUDA (and MUSA where a Triton for MUSA exists). On a CPU machine they run only through
Triton's interpreter (``TRITON_INTERPRET=1`` set before this package is imported), which is how
the conformance suite tests them without a GPU. Importing this package never fails: without
triton, or on a machine with neither an accelerator nor the interpreter (where importing triton
would only cost every process about a second), nothing is registered and the registry uses the
other implementations.
"""
from __future__ import annotations

import os

import torch


def _wanted() -> bool:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return True
    accelerator = getattr(torch, "accelerator", None)
    return bool(accelerator is not None and accelerator.is_available())


triton = None
if _wanted():
    try:
        import triton  # noqa: F811
        import triton.language  # noqa: F401
    except ImportError:  # optional dependency: no Triton kernels in this process
        triton = None

if triton is not None:
    from omnitron.kernels.triton_kernels import activations, flash_block, fp8, losses, norms, optim, rope  # noqa: F401
