"""Cross-entropy over vocabulary-parallel logits: no rank ever holds the full-vocabulary row.

Each rank holds ``logits [..., V_pad/tp]`` for vocabulary rows ``[start, start + V_pad/tp)``.
The backend's shard kernels read the logits once in their own dtype (no float32 copy):
``cross_entropy_shard_stats`` gives per-row (max, exp-sum, target logit, logit sum) over this
rank's real columns; two small all-reduces over tp (max, then one stacked sum of the rescaled
exp-sums and the other two) combine them into the exact softmax cross-entropy.
``cross_entropy_shard_grad`` recomputes the softmax from the saved logits and the global
log-sum-exp in the backward, so only the logits (in their own dtype), the target and a float32
``[...]`` vector are kept between the passes. Columns at or past ``vocab_size`` are padding:
excluded from the softmax and given zero gradient, so padding never changes the loss.
"""
from __future__ import annotations

import contextlib

import torch

from omnitron.backends.collectives import ReduceOp
from omnitron.core.parallel.tensor.mappings import local_rank
from omnitron.kernels.reference.cross_entropy_shard import loss_from_stats


def _all_reduce_(t: torch.Tensor, group, op=ReduceOp.SUM) -> torch.Tensor:
    if group.size > 1:
        group.collectives.all_reduce(t, op=op, group=group.handle)
    return t


def _combine_(stats: torch.Tensor, group, smoothing: bool) -> torch.Tensor:
    """Turn this rank's shard stats ``[4, ...]`` into the group's, in place: row 0 becomes the
    global max, rows 1-3 global sums (exp-sum rescaled to the global max). Row 3 (logit sum) is
    reduced only when label smoothing reads it."""
    if group.size == 1:
        return stats
    # a shard with nothing to add (all padding, or a row of -inf logits) reports max 0 by the
    # kernels' convention: make it -inf so it cannot raise the global max (and underflow the rest)
    stats[0].masked_fill_(stats[1] == 0, float("-inf"))
    m = _all_reduce_(stats[0].clone(), group, ReduceOp.MAX)
    stats[1].mul_(torch.exp(stats[0] - m))  # exp(-inf) = 0 for an all-padding shard (its sum is 0)
    _all_reduce_(stats[1:4] if smoothing else stats[1:3], group)  # one sum for the stacked rows
    stats[0].copy_(m)
    return stats


_RERUN = [0]
"""How many enclosing :func:`backward_reruns` blocks are open (a list: the backward may run on autograd's device
threads, so a thread-local would not reach it)."""


@contextlib.contextmanager
def backward_reruns():
    """Within this block a loss's backward writes a new gradient tensor even with ``inplace_backward``: the caller
    will run a second backward over the same graph (the pipeline's split backward when its weight pass falls back
    to a full backward, :mod:`omnitron.core.parallel.pipeline.wgrad`), which must find the logits intact."""
    _RERUN[0] += 1
    try:
        yield
    finally:
        _RERUN[0] -= 1


class _VocabParallelCE(torch.autograd.Function):
    """forward: per-token loss (fp32); backward: ``softmax - (1-ls) onehot - ls/V`` on local
    columns, in the logits' dtype (recomputed from the logits and the global log-sum-exp)."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, label_smoothing, kernels, inplace_backward=False):
        v_local = logits.shape[-1]
        start = local_rank(group) * v_local
        valid = max(0, min(v_local, vocab_size - start))  # real (unpadded) columns on this rank
        stats = kernels.cross_entropy_shard_stats(logits, target, start, valid, vocab_size)  # [4, ...] fp32
        _combine_(stats, group, label_smoothing > 0.0)
        loss, lse = loss_from_stats(stats, vocab_size, label_smoothing)
        ctx.save_for_backward(logits, target, lse)
        ctx.meta = (start, valid, vocab_size, label_smoothing)
        ctx.kernels = kernels
        ctx.inplace = inplace_backward and logits.is_contiguous()
        return loss

    @staticmethod
    def backward(ctx, g):
        logits, target, lse = ctx.saved_tensors
        start, valid, vocab_size, ls = ctx.meta
        inplace = ctx.inplace and not _RERUN[0]
        out = {"out": logits} if inplace else {}  # `out` only when used: a plug-in's kernel may predate it
        grad = ctx.kernels.cross_entropy_shard_grad(g, logits, target, lse, start, valid, vocab_size, ls, **out)
        if inplace:
            # the kernels write through a data pointer, which autograd does not see: mark the logits changed, so a
            # second backward over this graph (retain_graph) fails at unpacking them instead of reading a gradient
            torch.autograd.graph.increment_version(logits)
        return grad, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group, *, vocab_size: int | None = None,
                                 label_smoothing: float = 0.0, kernels=None,
                                 inplace_backward: bool = False) -> torch.Tensor:
    """Per-token float32 loss of tp-local ``logits [..., V_pad/tp]`` against global ``target [...]``.

    ``vocab_size`` is the real vocabulary (columns past it are padding); default: all columns.
    ``kernels``: the backend's kernel table (the model's ``backend.kernels``); default: the host CPU
    backend's.
    ``inplace_backward``: the backward writes the logits' gradient over the (contiguous) logits, as Megatron's
    cross-entropy does: no second logits-sized tensor at the loss's backward (on a host device, no fresh
    allocation to fault in: 16 MiB a micro-batch for the main job's shape). Only for logits nothing else reads
    after the backward (a model's own output layer); a second backward over the graph then fails loudly.
    Targets must be global ids in ``[0, vocab_size)``.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label smoothing must be in [0, 1), got {label_smoothing}")
    if vocab_size is None:
        vocab_size = logits.shape[-1] * group.size
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"target shape {tuple(target.shape)} must equal logits' leading shape "
                         f"{tuple(logits.shape[:-1])} (logits [..., V/tp], target [...])")
    if not 0 < vocab_size <= logits.shape[-1] * group.size:
        raise ValueError(f"vocab_size {vocab_size} must lie in (0, {logits.shape[-1] * group.size}] "
                         f"(tp {group.size} x {logits.shape[-1]} local columns)")
    if kernels is None:
        from omnitron.core.parallel.groups import host_backend

        kernels = host_backend().kernels
    return _VocabParallelCE.apply(logits, target, group, vocab_size, label_smoothing, kernels, inplace_backward)
