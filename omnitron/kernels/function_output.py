"""A dtype cast for what a ``torch.autograd.Function``'s forward returns, safe under ``torch.compile`` on torch 2.11.

torch 2.11's dynamo gives a zero gradient to an ``autograd.Function`` output made by an op that returns its own
input (``t.to(t.dtype)``, ``.float()`` of float32, ``.contiguous()`` of a contiguous tensor): AOTAutograd's
backward reads zeros in place of the tangent, so every input gradient is 0, silently (eager, and torch 2.13, are
right; seen with ``aot_eager`` and ``inductor``). A float32 run returned such a no-op cast from the FP8 GEMMs'
emulation and from the blocked and ring attention (``out.to(q.dtype)``). Returning the tensor itself is traced
correctly, so the cast is skipped when it would do nothing.
"""
from __future__ import annotations

import torch


def cast_output(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as ``dtype``: ``t`` itself when it already is (never a no-op ``.to``, see the module doc)."""
    return t if t.dtype == dtype else t.to(dtype)
