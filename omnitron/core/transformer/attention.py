"""Causal self-attention with grouped-query heads split over tensor-parallel ranks.

Full (layout-independent) fused QKV weight rows are grouped per key/value head, Megatron style:
``[g0: q heads of group 0 (hq/g of them), k0, v0 | g1: ... ]`` each ``d`` rows, so a contiguous
split over tp gives every rank ``g/tp`` whole groups. ``linear_proj`` input columns follow global
query-head order.
"""
from __future__ import annotations

import torch
from torch import nn

from omnitron.core.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from omnitron.core.parallel.tensor.random import checkpoint
from omnitron.core.transformer.norm import Norm


class SelfAttention(nn.Module):
    """``[s, b, h] -> ([s, b, h], bias)``: QKV projection, optional QK-norm and RoPE, core
    attention from the kernel registry, output projection (bias returned for fused add)."""

    def __init__(self, c, *, group, sequence_parallel: bool, tracker, backend, out_std: float) -> None:
        super().__init__()
        from omnitron.core.models.gpt.config import head_dim, query_groups

        self.c, self.group, self.tracker, self.backend = c, group, tracker, backend
        self.d, heads, groups = head_dim(c), c.num_attention_heads, query_groups(c)
        self.q_per_group = heads // groups
        self.groups_local = groups // group.size
        kw = dict(group=group, bias=c.add_bias_linear, sequence_parallel=sequence_parallel, dtype=c.params_dtype)
        self.linear_qkv = ColumnParallelLinear(c.hidden_size, (heads + 2 * groups) * self.d, init_std=c.init_method_std, **kw)
        self.linear_proj = RowParallelLinear(heads * self.d, c.hidden_size, init_std=out_std, skip_bias_add=True, **kw)
        self.q_layernorm = self.k_layernorm = None
        if c.qk_layernorm:
            nkw = dict(kind=c.normalization, eps=c.layernorm_epsilon, backend=backend, partial_grad=group.size > 1,
                       dtype=c.params_dtype)
            self.q_layernorm, self.k_layernorm = Norm(self.d, **nkw), Norm(self.d, **nkw)

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``[b, h, s, d]`` in and out; dropout draws from the tp-rank-specific stream (local heads)."""
        p = self.c.attention_dropout if self.training else 0.0
        if p == 0.0:
            return self.backend.kernels.attention(q, k, v, causal=True, dropout_p=0.0)
        with self.tracker.fork():
            return self.backend.kernels.attention(q, k, v, causal=True, dropout_p=p)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor | None):
        qkv = self.linear_qkv(x)  # [s, b, g/tp * (hq/g + 2) * d]
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.groups_local, self.q_per_group + 2, self.d)
        q = qkv[:, :, :, : self.q_per_group].reshape(s, b, -1, self.d)  # [s, b, hq/tp, d]
        k, v = qkv[:, :, :, self.q_per_group], qkv[:, :, :, self.q_per_group + 1]  # [s, b, g/tp, d]
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if freqs is not None:
            rope = self.backend.kernels.rope
            q, k = rope(q, freqs, self.c.rotary_interleaved), rope(k, freqs, self.c.rotary_interleaved)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        if self.c.recompute_granularity == "selective":
            out = checkpoint(self.core_attention, self.tracker, q, k, v)
        else:
            out = self.core_attention(q, k, v)
        out = out.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, hq/tp * d]
        return self.linear_proj(out)
