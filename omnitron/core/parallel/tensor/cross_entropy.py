"""Cross-entropy over vocabulary-parallel logits: no rank ever holds the full-vocabulary row.

Each rank holds ``logits [..., V_pad/tp]`` for vocabulary rows ``[start, start + V_pad/tp)``.
Two small all-reduces over tp (max, then one stacked sum of exp-sum / target logit / logit sum)
give the exact softmax cross-entropy. Columns at or past ``vocab_size`` are padding: they are
excluded from the softmax, so padding never changes the loss.
"""
from __future__ import annotations

import torch

from omnitron.backends import get_backend
from omnitron.backends.collectives import ReduceOp
from omnitron.core.parallel.tensor.mappings import local_rank


def _all_reduce_(t: torch.Tensor, group, op=ReduceOp.SUM) -> torch.Tensor:
    if group.size > 1:
        get_backend().collectives.all_reduce(t, op=op, group=group.handle)
    return t


class _VocabParallelCE(torch.autograd.Function):
    """forward: per-token loss (fp32); backward: ``softmax - (1-ls) onehot - ls/V`` on local columns."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, label_smoothing):
        v_local = logits.shape[-1]
        start = local_rank(group) * v_local
        valid = max(0, min(v_local, vocab_size - start))  # real (unpadded) columns on this rank
        x = logits.float()
        if valid > 0:
            local_max = x[..., :valid].amax(dim=-1)
        else:
            local_max = torch.full(x.shape[:-1], float("-inf"), device=x.device)
        m = _all_reduce_(local_max.contiguous(), group, ReduceOp.MAX)
        in_range = (target >= start) & (target < start + valid)
        local_t = (target - start).masked_fill(~in_range, 0)
        picked = (x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) - m).masked_fill(~in_range, 0.0)
        exp = (x - m.unsqueeze(-1)).exp_()  # NOTE: few full passes over [tokens, V/tp]: this tensor is large
        if valid < v_local:
            exp[..., valid:] = 0.0
        parts = [exp.sum(-1), picked]
        if label_smoothing > 0.0:
            parts.append(x[..., :valid].sum(-1) - valid * m)  # sum of shifted real logits
        stats = torch.stack(parts)  # one all-reduce for all of them
        _all_reduce_(stats, group)
        log_z = stats[0].log()
        loss = log_z - stats[1]
        if label_smoothing > 0.0:
            smooth = log_z - stats[2] / vocab_size  # mean over the real vocabulary of -log p
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
        softmax = exp.div_(stats[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, in_range)
        ctx.meta = (valid, vocab_size, label_smoothing, logits.dtype)
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, local_t, in_range = ctx.saved_tensors
        valid, vocab_size, ls, dtype = ctx.meta
        g = g.unsqueeze(-1)
        grad = softmax * g  # a new tensor: the saved softmax stays intact for a retained graph
        hit = -(1.0 - ls) * g * in_range.unsqueeze(-1).to(grad.dtype)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), hit)
        if ls > 0.0:
            grad[..., :valid] -= (ls / vocab_size) * g
        return grad.to(dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group, *, vocab_size: int | None = None,
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token float32 loss of tp-local ``logits [..., V_pad/tp]`` against global ``target [...]``.

    ``vocab_size`` is the real vocabulary (columns past it are padding); default: all columns.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label smoothing must be in [0, 1), got {label_smoothing}")
    if vocab_size is None:
        vocab_size = logits.shape[-1] * group.size
    return _VocabParallelCE.apply(logits, target, group, vocab_size, label_smoothing)
