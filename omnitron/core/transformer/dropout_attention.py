"""Attention with the tracker's dropout written as plain tensor operations, so a compiled layer traces it whole.

Used by self-attention and MLA inside compiled layers (context parallelism draws hash masks instead,
:mod:`omnitron.kernels.hash_dropout`); below both so neither imports the other for it.
"""
from __future__ import annotations

import torch


def in_graph_dropout_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None,
                               p: float, tracker, scale: float | None = None) -> torch.Tensor:
    """Attention with dropout inside a compiled layer, as SDPA's math path computes it: ``softmax(q k^T scale)``
    (``keep``: True = attend; None = causal) times the tracker's dropout multiplier, drawn over all heads and
    sliced to this rank's (heads are split over tp), then ``@ v``. ``[b, h, s, d]``, grouped-query heads
    repeated. Traceable: no generator swap (:mod:`omnitron.core.parallel.tensor.random`)."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if keep is None:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    probs = torch.softmax(scores.masked_fill(~keep, float("-inf")).float(), dim=-1).to(q.dtype)
    return torch.matmul(probs * tracker.keep_multiplier(probs.shape, p, probs, split_dim=1), v)
