"""Gradient reduction after the micro-batches, for chunks without a data-parallel wrapper.

Order: sequence-parallel partial sums over tp, the tied embedding over ``groups.embedding``
(first and last pipeline stage hold copies), then the average over data x context parallel
ranks. With the data-parallel wrapper present, its ``finalize_model_grads`` does this instead.
"""
from __future__ import annotations

import torch

from omnitron.backends.collectives import ReduceOp
from omnitron.core.models.gpt.state import allreduce_sequence_parallel_grads


def _grad(p: torch.nn.Parameter) -> torch.Tensor | None:
    g = getattr(p, "main_grad", None)
    return g if g is not None else p.grad


def _coalesced_all_reduce(grads: list[torch.Tensor], group, collectives, average: bool) -> None:
    if not grads or group.handle is None:
        return
    flat = torch.cat([g.reshape(-1).to(torch.promote_types(g.dtype, torch.float32)) for g in grads])  # f64 stays f64
    collectives.all_reduce(flat, op=ReduceOp.SUM, group=group.handle)
    if average:
        flat /= group.size
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def finalize_grads(chunks, modules, groups, collectives) -> None:
    """Make every rank's gradients those of the full global batch (see the module docstring)."""
    try:
        from omnitron.core.parallel.data import finalize_model_grads
    except ImportError:
        finalize_model_grads = None
    if finalize_model_grads is not None and chunks[0] is not modules[0]:
        finalize_model_grads(chunks, groups)
        return
    for m in modules:
        allreduce_sequence_parallel_grads(m, groups)
    if groups.pp.size > 1:
        shared = [g for m in modules for p in m.shared_embedding_parameters() if (g := _grad(p)) is not None]
        _coalesced_all_reduce(shared, groups.embedding, collectives, average=False)
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    for p in params:
        if _grad(p) is None:
            p.grad = torch.zeros_like(p)
    _coalesced_all_reduce([_grad(p) for p in params], groups.dp_cp, collectives, average=True)
