"""Cross-entropy pieces for a vocabulary shard (tensor-parallel logits) or a whole vocabulary.

A rank holding ``logits [..., Vs]`` for global ids ``[start, start + Vs)`` of which the first
``valid`` columns are real (the rest padding) computes ``cross_entropy_shard_stats``; combining
ranks takes one max and one sum all-reduce on ``[...]``-sized vectors::

    stats = kernels.cross_entropy_shard_stats(logits, target, start, valid, vocab)  # [4, ...] fp32
    m = all_reduce_max(stats[0].clone())
    stats[1] *= torch.exp(stats[0] - m)           # rescale each shard's exp-sum to the global max
    all_reduce_sum(stats[1:])                      # exp-sum, target logit, logit sum
    stats[0] = m
    loss, lse = loss_from_stats(stats, vocab, label_smoothing)
    # backward: kernels.cross_entropy_shard_grad(dloss, logits, target, lse, start, valid, vocab, ls)

The fast implementations read the logits once in their own dtype (no float32 copy).
"""
from __future__ import annotations

import torch

from omnitron.kernels.reference.precision import compute_dtype
from omnitron.kernels.registry import register


@register("cross_entropy_shard_stats", "reference")
def cross_entropy_shard_stats(logits: torch.Tensor, target: torch.Tensor, start: int, valid: int,
                              vocab: int) -> torch.Tensor:
    """float32 (float64 for float64 logits) ``[4, ...]``: per row over the ``valid`` real columns, (max, sum exp(x -
    max), the target's logit or 0 when the target lives in another shard, sum of x)."""
    if target.numel():  # checked on the device: int(target.min()) here was two host syncs per micro-batch
        torch._assert_async(((target >= 0) & (target < vocab)).all(), f"cross-entropy targets must lie in [0, {vocab})")
    x = logits[..., :valid].to(compute_dtype(logits))
    m = x.amax(-1) if valid else torch.full(x.shape[:-1], float("-inf"), device=x.device, dtype=x.dtype)
    m_ref = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    s = torch.exp(x - m_ref.unsqueeze(-1)).sum(-1)
    local = target - start
    inside = (local >= 0) & (local < valid)
    xt = x.gather(-1, local.clamp(0, max(valid - 1, 0)).unsqueeze(-1)).squeeze(-1) if valid else torch.zeros_like(m)
    return torch.stack([m_ref, s, torch.where(inside, xt, 0.0), x.sum(-1)])


@register("cross_entropy_shard_grad", "reference")
def cross_entropy_shard_grad(dloss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                             start: int, valid: int, vocab: int, label_smoothing: float = 0.0,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """d loss / d logits for this shard, in ``logits.dtype``: ``dloss * (softmax - (1 - ls) onehot
    - ls / vocab)`` on real columns, 0 on padding columns. ``lse`` is the global log-sum-exp.

    ``out`` (optional, the logits' shape and dtype) receives the result and is returned; it may be ``logits``
    itself, so a loss whose logits are dead after its backward writes its gradient over them (Megatron's
    cross-entropy does the same) and allocates no second logits-sized tensor. Fast implementations must allow
    that alias: each element read before it is written."""
    x = logits.to(compute_dtype(logits))
    p = torch.exp(x - lse.to(x.dtype).unsqueeze(-1)) - label_smoothing / vocab
    p[..., valid:] = 0.0
    local = target - start
    inside = (local >= 0) & (local < valid)
    p.scatter_add_(-1, local.clamp(0, max(logits.shape[-1] - 1, 0)).unsqueeze(-1),
                   -(1.0 - label_smoothing) * inside.unsqueeze(-1).to(x.dtype))
    grad = (p * dloss.to(x.dtype).unsqueeze(-1)).to(logits.dtype)
    return grad if out is None else out.copy_(grad)


def loss_from_stats(stats: torch.Tensor, vocab: int, label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row float32 loss, log-sum-exp) from combined stats ``[4, ...]`` (see the module doc)."""
    m, s, xt, sx = stats.unbind(0)
    lse = m + torch.log(s)
    loss = lse - xt
    if label_smoothing > 0.0:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - sx / vocab)
    return loss, lse


def whole_vocab_cross_entropy(stats_fn, grad_fn):
    """A differentiable ``softmax_cross_entropy(logits, target, label_smoothing)`` built from a pair
    of shard kernels run over the whole vocabulary (one shard: start 0, every column valid).

    ``stats_fn(x2, t, start, valid, vocab)`` and ``grad_fn(dloss, x2, t, lse, start, valid, vocab, ls)``
    take the flat ``[N, V]`` logits and ``[N]`` int64 targets. Only the logits (own dtype), the targets
    and the fp32 log-sum-exp are kept for backward, never an fp32 copy of the logits."""

    class _WholeVocabCE(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, target, label_smoothing):
            x2 = logits.reshape(-1, logits.shape[-1]).contiguous()
            t = target.reshape(-1).long().contiguous()
            v = x2.shape[-1]
            loss, lse = loss_from_stats(stats_fn(x2, t, 0, v, v), v, float(label_smoothing))
            ctx.save_for_backward(x2, t, lse)
            ctx.label_smoothing = float(label_smoothing)
            return loss.view(target.shape)

        @staticmethod
        def backward(ctx, dloss):
            x2, t, lse = ctx.saved_tensors
            v = x2.shape[-1]
            dx = grad_fn(dloss.reshape(-1).to(lse.dtype).contiguous(), x2, t, lse, 0, v, v, ctx.label_smoothing)
            return dx.view(*dloss.shape, v), None, None

    return _WholeVocabCE.apply
