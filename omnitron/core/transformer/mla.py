"""Multi-head latent attention (MLA, DeepSeek-V2/V3), as Megatron-Core's ``MLASelfAttention``.

Per token ``x [h]`` (``n`` heads; ``dn, dr, dv`` = ``--qk-head-dim``, ``--qk-pos-emb-head-dim``,
``--v-head-dim``)::

    q      = W_uq q_norm(W_dq x)             [n, dn + dr]   (--q-lora-rank None: q = W_q x)
    c, kr  = split(W_dkv x)                   [--kv-lora-rank], [dr]
    k_nope, v = split(W_ukv kv_norm(c))       [n, dn], [n, dv]
    q = [q_nope | rope(q_pe) * f],  k = [k_nope | rope(kr) * f]   (kr: ONE rotated part shared by the heads)
    out = softmax(q k^T * scale, causal) v;  y = W_o out

The latent norms ``q_layernorm`` / ``kv_layernorm`` (``--normalization``) exist with ``--qk-layernorm``
only, as in Megatron's layer specs (identity otherwise; DeepSeek-V3 sets it). ``f`` and ``scale`` are YaRN's
(:mod:`omnitron.core.transformer.yarn`). RoPE rotates the ``dr`` channels as interleaved pairs (Megatron's
``mla_rotary_interleaved``; Megatron then stores the rotated pairs de-interleaved, a permutation of channels shared by q
and k that leaves every q.k unchanged).

Tensor parallelism (Megatron's layout): the down-projections ``W_dq``, ``W_dkv`` and the two latent norms
are replicated on every tp rank; ``W_uq`` / ``W_q`` and ``W_ukv`` are column-parallel (whole heads per
rank, rows per head ``[nope | pe]`` and ``[k_nope | v]``); ``W_o`` is row-parallel. Under sequence
parallelism the down-projections see this rank's sequence shard (their gradients are partial sums over
tp, marked ``sequence_parallel``), the up-projections all-gather the latents, and the shared rotated key
part is all-gathered.

Context parallelism: the rows are this cp rank's load-balanced chunks and ``freqs`` their global positions
(the model's), so the decoupled RoPE rotates by the global position; core attention runs over the cp group
(:mod:`omnitron.core.transformer.cp_attention`, any ``--cp-comm-type``) with the YaRN scale, the ring's
keys and values travelling as one tensor although ``dv != dn + dr``.

Generation: the KV cache keeps each slot's latent and rotated key part (``latent_cache``); single-token steps
attend to them with the up-projection absorbed into the query and the output (``absorb``, where it applies and
where the expanded path runs instead: :mod:`omnitron.core.transformer.mla_absorbed`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnitron.core.parallel.groups import Group
from omnitron.core.parallel.tensor import mappings as M
from omnitron.core.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from omnitron.core.parallel.tensor.random import checkpoint
from omnitron.core.parallel.tensor.sharding import set_attributes
from omnitron.core.transformer import yarn
from omnitron.core.transformer.dropout_attention import in_graph_dropout_attention
from omnitron.core.transformer.cp_attention import cp_attention
from omnitron.core.transformer.mla_absorbed import absorbed_attention
from omnitron.core.transformer.norm import Norm, norm_kwargs


def replicated_linear(in_features: int, out_features: int, *, group, c, partial_grad: bool) -> ColumnParallelLinear:
    """A bias-free linear held whole on every rank of ``group`` (a one-rank column-parallel layer, so the
    FP8 seam stays); ``partial_grad``: its input is a sequence shard, so its gradient is summed over tp."""
    one = Group(f"{group.name}-replica", (group.ranks[M.local_rank(group)],), None)
    lin = ColumnParallelLinear(in_features, out_features, group=one, bias=False, init_std=c.init_method_std,
                               dtype=c.params_dtype)
    set_attributes(lin.weight, parallel=False, init=lin.weight.init)
    lin.weight.sequence_parallel = partial_grad
    return lin


class MLASelfAttention(nn.Module):
    """``[s, b, h] -> ([s, b, h], bias)`` (``[s/tp, b, h]`` under sequence parallelism); see the module
    docstring. ``forward(x, freqs)``: ``freqs [s, b|1, 1, dr/2]`` the rotation angles of the full sequence."""

    def __init__(self, c, *, group, sequence_parallel: bool, tracker, backend, out_std: float,
                 skip_out_bias: bool = True) -> None:
        super().__init__()
        self.c, self.group, self.tracker, self.backend, self.sp = c, group, tracker, backend, sequence_parallel
        n, h = c.num_attention_heads, c.hidden_size
        self.dn, self.dr, self.dv = c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim
        kw = dict(group=group, bias=False, sequence_parallel=sequence_parallel, init_std=c.init_method_std,
                  dtype=c.params_dtype)
        nkw = norm_kwargs(c, backend, partial_grad=sequence_parallel)
        if c.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(h, n * (self.dn + self.dr), **kw)
        else:
            self.linear_q_down_proj = replicated_linear(h, c.q_lora_rank, group=group, c=c,
                                                        partial_grad=sequence_parallel)
            self.q_layernorm = Norm(c.q_lora_rank, **nkw) if c.qk_layernorm else nn.Identity()
            self.linear_q_up_proj = ColumnParallelLinear(c.q_lora_rank, n * (self.dn + self.dr), **kw)
        self.linear_kv_down_proj = replicated_linear(h, c.kv_lora_rank + self.dr, group=group, c=c,
                                                     partial_grad=sequence_parallel)
        self.kv_layernorm = Norm(c.kv_lora_rank, **nkw) if c.qk_layernorm else nn.Identity()
        self.linear_kv_up_proj = ColumnParallelLinear(c.kv_lora_rank, n * (self.dn + self.dv), **kw)
        self.linear_proj = RowParallelLinear(n * self.dv, h, group=group, bias=c.add_bias_linear,
                                             sequence_parallel=sequence_parallel, init_std=out_std,
                                             skip_bias_add=skip_out_bias, dtype=c.params_dtype)
        self.softmax_scale, self.rope_factor = yarn.softmax_scale(c), yarn.concentration(c)
        # generation: ``(latent [s, b, r], k_pe [s, b, 1, dr]) -> the same over every cached slot`` (the KV cache
        # keeps the normalised latent and the rotated shared key part, not the per-head keys and values)
        self.latent_cache = None
        self.absorb: bool | None = None
        """Absorbed attention over the cached latents: None on single-token cached steps, True on every cached step
        (refused where it cannot apply), False never (:mod:`omnitron.core.transformer.mla_absorbed`)."""
        # set by apply_context_parallel (as on SelfAttention): attention over the cp-split sequence
        self.cp_group, self.cp_comm_type, self.cp_subgroups = None, "p2p", None

    def _rope(self, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        t = self.backend.kernels.rope(t, freqs, True)  # interleaved pairs (see the module docstring)
        return t if self.rope_factor == 1.0 else t * self.rope_factor

    def _query(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """``q [s, b, n/tp, dn + dr]``, its rope part rotated."""
        if self.c.q_lora_rank is None:
            q = self.linear_q_proj(x)
        else:
            q = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(x)))
        q_nope, q_pe = q.view(q.shape[0], q.shape[1], -1, self.dn + self.dr).split([self.dn, self.dr], dim=-1)
        return torch.cat([q_nope, self._rope(q_pe, freqs)], dim=-1)

    def _latents(self, x: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``latent [s(k), b, r]`` (this rank's sequence shard under sp) and ``k_pe [s(k), b, 1, dr]``: in
        generation every cached slot's."""
        latent, k_pe = self.linear_kv_down_proj(x).split([self.c.kv_lora_rank, self.dr], dim=-1)
        latent = self.kv_layernorm(latent)
        # the shared rotated key part feeds every local head: its gradient is a partial sum over tp
        k_pe = M.gather_from_sp(k_pe, self.group) if self.sp else M.copy_to_tp(k_pe, self.group)
        k_pe = self._rope(k_pe.unsqueeze(2), freqs)  # [s, b, 1, dr]
        if self.latent_cache is not None:  # generation: every cached slot's latent, then this step's
            latent, k_pe = self.latent_cache(latent, k_pe)
        return latent, k_pe

    def _project(self, x: torch.Tensor, freqs: torch.Tensor):
        """``q, k [s, b, n/tp, dn + dr]``, ``v [s, b, n/tp, dv]``."""
        q, (latent, k_pe) = self._query(x, freqs), self._latents(x, freqs)
        kv = self.linear_kv_up_proj(latent)  # [s(k), b, ...]: under sp the up-projection gathers the latents
        kv = kv.view(kv.shape[0], q.shape[1], -1, self.dn + self.dv)
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        return q, k, v

    def _absorbs(self, s_new: int) -> bool:
        """Whether this step attends to the cached latents directly (``absorb``; mla_absorbed.py says where)."""
        if self.latent_cache is None or self.absorb is False:
            return False
        blocked = self.sp or self.cp_group is not None or (self.training and self.c.attention_dropout > 0)
        if self.absorb and blocked:
            raise ValueError("MLASelfAttention.absorb=True: the absorbed attention does not run under sequence or "
                             "context parallelism or with attention dropout in training; set absorb to None or False")
        return not blocked and (bool(self.absorb) or s_new == 1)

    def core_attention(self, q, k, v, key_padding_mask: torch.Tensor | None = None,
                       document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``[b, n/tp, s, d]`` in and out (SelfAttention's signature, so the generation KV cache can stand in
        for it; no padding mask: MLA is causal); dropout from the tp-rank-specific stream (local heads)."""
        p, keep = (self.c.attention_dropout if self.training else 0.0), None
        if self.cp_group is not None:
            if document_ids is not None:
                raise ValueError("--reset-attention-mask (attention within each packed document) does not run "
                                 "under context parallelism; use --context-parallel-size 1 or drop it")
            return cp_attention(self, q, k, v, p, scale=self.softmax_scale)
        if document_ids is not None:
            s = q.shape[2]
            causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
            keep = ((document_ids[:, :, None] == document_ids[:, None, :]) & causal)[:, None]
            attend = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=p,  # noqa: E731
                                                            scale=self.softmax_scale)
        else:
            attend = lambda: self.backend.kernels.attention(q, k, v, causal=True, dropout_p=p,  # noqa: E731
                                                            scale=self.softmax_scale)
        if p == 0.0:
            return attend()
        if self.tracker.in_graph():
            return in_graph_dropout_attention(q, k, v, keep, p, self.tracker, self.softmax_scale)
        with self.tracker.fork():
            return attend()

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None):
        if key_padding_mask is not None:
            raise ValueError("multi-latent attention is causal only (GPT); a padding mask (BERT) is not supported")
        if freqs is None:
            raise ValueError("multi-latent attention needs the rotation angles of its decoupled RoPE (freqs)")
        if self._absorbs(x.shape[0]):
            q, (latent, k_pe) = self._query(x, freqs), self._latents(x, freqs)
            keep = self.latent_cache.keep(q.shape[1], q.shape[0], latent.shape[0], q.device)
            y = self.linear_proj(absorbed_attention(self, q, latent, k_pe, keep))
            return y if isinstance(y, tuple) else (y, None)
        q, k, v = (t.permute(1, 2, 0, 3) for t in self._project(x, freqs))  # [b, n/tp, s(k), d]
        s, b = q.shape[2], q.shape[0]
        masks = () if document_ids is None else (None, document_ids)
        if self.c.recompute_granularity == "selective" and self.training and torch.is_grad_enabled():
            out = checkpoint(self.core_attention, self.tracker, q, k, v, *masks)
        else:
            out = self.core_attention(q, k, v, *masks)
        y = self.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))  # [s, b, n/tp * dv]
        return y if isinstance(y, tuple) else (y, None)
