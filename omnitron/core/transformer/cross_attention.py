"""Cross-attention (encoder-decoder attention) with heads split over tensor-parallel ranks.

Queries come from the decoder stream, keys and values from the encoder output ("memory"):
``linear_q`` (column-parallel, ``[hq * d, h]``) on the decoder, ``linear_kv`` (column-parallel,
``[2 * g * d, h]``) on the memory, core attention over every memory position that is not padding
(no causal mask), ``linear_proj`` (row-parallel) back to the hidden size. Full ``linear_kv`` rows
are grouped per key/value head, ``[g0: k, v | g1: k, v | ...]`` each ``d`` rows, so a contiguous
split over tp gives every rank ``g/tp`` whole groups, whose query heads it also holds
(``g`` must be a multiple of tp; the T5 config checks it).

Sequence parallelism: decoder and memory arrive as sequence shards ``[s/tp, b, h]``; the two
column-parallel projections all-gather them (backward: reduce-scatter) and the output projection
reduce-scatters back to the decoder's shard, as in :class:`SelfAttention`.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from omnitron.core.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from omnitron.core.parallel.tensor.random import checkpoint


class CrossAttention(nn.Module):
    """``(x [s_q, b, h], memory [s_k, b, h], memory_padding_mask [b, s_k]) -> ([s_q, b, h], bias)``."""

    def __init__(self, c, *, group, sequence_parallel: bool, tracker, backend, out_std: float,
                 skip_out_bias: bool = True) -> None:
        super().__init__()
        from omnitron.core.transformer.shapes import head_dim, query_groups

        heads, groups = c.num_attention_heads, query_groups(c)
        if groups % group.size:
            raise ValueError(f"cross-attention splits its {groups} key/value heads over tensor-parallel size "
                             f"{group.size}: use a multiple of tp query groups (--num-query-groups)")
        self.c, self.tracker, self.d = c, tracker, head_dim(c)
        kw = dict(group=group, bias=c.add_bias_linear, sequence_parallel=sequence_parallel, dtype=c.params_dtype)
        self.linear_q = ColumnParallelLinear(c.hidden_size, heads * self.d, init_std=c.init_method_std, **kw)
        self.linear_kv = ColumnParallelLinear(c.hidden_size, 2 * groups * self.d, init_std=c.init_method_std, **kw)
        self.linear_proj = RowParallelLinear(heads * self.d, c.hidden_size, init_std=out_std,
                                             skip_bias_add=skip_out_bias, **kw)

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       memory_padding_mask: torch.Tensor) -> torch.Tensor:
        """``q [b, hq/tp, s_q, d]``, ``k, v [b, g/tp, s_k, d]`` -> ``[b, hq/tp, s_q, d]``; padding keys
        are never attended; dropout draws from the tp-rank-specific stream (the heads are local)."""
        p = self.c.attention_dropout if self.training else 0.0
        keep = ~memory_padding_mask.to(torch.bool)[:, None, None, :]  # [b, 1, 1, s_k]: True = attend
        with self.tracker.fork() if p > 0.0 else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=p,
                                                  enable_gqa=k.shape[1] != q.shape[1])

    def forward(self, x: torch.Tensor, memory: torch.Tensor, memory_padding_mask: torch.Tensor):
        q = self.linear_q(x)  # [s_q, b, hq/tp * d]
        kv = self.linear_kv(memory)  # [s_k, b, g/tp * 2 * d]
        (s, b), sk = q.shape[:2], kv.shape[0]
        q = q.view(s, b, -1, self.d).permute(1, 2, 0, 3)  # [b, hq/tp, s_q, d]
        kv = kv.view(sk, b, -1, 2, self.d)
        k, v = (kv[:, :, :, i].permute(1, 2, 0, 3) for i in (0, 1))  # [b, g/tp, s_k, d]
        if self.c.recompute_granularity == "selective" and self.training and torch.is_grad_enabled():
            out = checkpoint(self.core_attention, self.tracker, q, k, v, memory_padding_mask)
        else:
            out = self.core_attention(q, k, v, memory_padding_mask)
        y = self.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))  # [s_q(/tp), b, h]
        return y if isinstance(y, tuple) else (y, None)
