"""Causal self-attention with grouped-query heads split over tensor-parallel ranks.

Full (layout-independent) fused QKV weight rows are grouped per key/value head, Megatron style
(:mod:`omnitron.core.transformer.qkv`, the one definition of the layout), so a contiguous split over
tp gives every rank ``g/tp`` whole groups. ``linear_proj`` input columns follow global
query-head order.

Query groups fewer than tp (``tp % g == 0``): each rank's query heads lie in ONE group, so the
key/value projection is replicated on every tp rank (``linear_kv``, all ``g`` groups, small) and
each rank uses its group's rows; ``linear_q`` stays column-parallel. The kv weight's gradient is a
partial sum over tp (``sequence_parallel=True``: all-reduced with the norm weights), and
:meth:`SelfAttention.fuse_full_state` / :meth:`split_full_state` map the pair to and from the
canonical ``linear_qkv`` tensors, so checkpoints and parity checks see one layout.

Context parallelism (:func:`omnitron.core.parallel.context.apply_context_parallel` sets
``cp_group``): the rows are this cp rank's slice of the sequence and core attention is the ring
over the cp group (``--cp-comm-type p2p``), all-to-all / all-gather (``a2a``, ``allgather``) or the
hierarchical all-to-all then ring (``a2a+p2p``, over ``cp_subgroups``), sliding windows and sinks included
(:mod:`omnitron.core.transformer.cp_attention`).

Bidirectional attention (BERT): ``forward(x, freqs, key_padding_mask)`` with a ``[b, s]`` bool mask
(True at padding keys) attends over every non-padding key, no causal mask; without the mask
the causal path is unchanged.

Packed documents (``--reset-attention-mask``): ``forward(x, freqs, document_ids=ids)`` with ``ids
[b, s]`` (int, one id per document, e.g. the count of eods before each position) attends causally
within each document only: the mask is block-diagonal causal, ``keep[i, j] = j <= i and ids[i] ==
ids[j]``. The context-parallel ring refuses it (its blocks know positions, not documents).
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
from omnitron.core.transformer import qkv as QKV
from omnitron.core.transformer.cp_attention import cp_attention
from omnitron.core.transformer.dropout_attention import in_graph_dropout_attention
from omnitron.core.transformer.norm import Norm, norm_kwargs


class SelfAttention(nn.Module):
    """``[s, b, h] -> ([s, b, h], bias)``: QKV projection, optional QK-norm and RoPE, core
    attention from the kernel registry, output projection (bias returned for fused add)."""

    def __init__(self, c, *, group, sequence_parallel: bool, tracker, backend, out_std: float,
                 skip_out_bias: bool = True) -> None:
        super().__init__()
        from omnitron.core.transformer.shapes import head_dim, query_groups

        self.c, self.group, self.tracker, self.backend = c, group, tracker, backend
        self.d, heads, groups = head_dim(c), c.num_attention_heads, query_groups(c)
        self.q_per_group = heads // groups
        self.replicate_kv = groups < group.size
        self.sp = sequence_parallel
        kw = dict(group=group, bias=c.add_bias_linear, sequence_parallel=sequence_parallel, dtype=c.params_dtype)
        # Megatron: linear_qkv has a bias with --add-bias-linear or --add-qkv-bias (Qwen2); linear_proj only with the
        # first (BERT/T5 configs have no add_qkv_bias)
        qkv_kw = {**kw, "bias": c.add_bias_linear or getattr(c, "add_qkv_bias", False)}
        if self.replicate_kv:
            self._build_replicated_kv(c, heads, groups, qkv_kw)
        else:
            self.groups_local = groups // group.size
            self.linear_qkv = ColumnParallelLinear(c.hidden_size, (heads + 2 * groups) * self.d,
                                                   init_std=c.init_method_std, **qkv_kw)
            # rows per key/value group of q, k and v (Megatron's layout): --muon-split-qkv orthogonalises them apart
            self.linear_qkv.weight.qkv_split_rows = [self.q_per_group * self.d, self.d, self.d]
        self.linear_proj = RowParallelLinear(heads * self.d, c.hidden_size, init_std=out_std,
                                             skip_bias_add=skip_out_bias, **kw)
        self.cp_group = None  # set by apply_context_parallel: attention over the cp-split sequence
        self.cp_comm_type = "p2p"  # --cp-comm-type: the ring, or all-to-all / all-gather (context/ulysses.py)
        self.cp_subgroups = None  # a2a+p2p: (a2a group, p2p group) of this rank (context/hierarchical.py)
        from omnitron.core.transformer.yarn import concentration

        yarn = getattr(c, "position_embedding_type", None) == "yarn"  # MLA: its own class (transformer/mla.py)
        self.rope_factor = concentration(c) if yarn else 1.0
        self.window = None  # (left, right): this layer's sliding window (set by TransformerLayer), None: full
        self.softmax_type = getattr(c, "softmax_type", "vanilla")  # attention sinks (transformer/window.py)
        if self.softmax_type == "learnable":  # one sink logit per head, split over tp with the heads
            # drawn as Megatron's DotProductAttention draws it (config.init_method: normal, --init-method-std),
            # from the layout-independent full tensor (the same values at every tp)
            w = torch.empty(heads // group.size, dtype=c.params_dtype)
            self.softmax_offset = set_attributes(nn.Parameter(w), parallel=True, dim=0,
                                                 init=("normal", c.init_method_std))
        self.q_layernorm = self.k_layernorm = None
        if c.qk_layernorm:
            nkw = norm_kwargs(c, backend, partial_grad=group.size > 1)
            self.q_layernorm, self.k_layernorm = Norm(self.d, **nkw), Norm(self.d, **nkw)

    def _build_replicated_kv(self, c, heads: int, groups: int, kw: dict) -> None:
        """``linear_q`` column-parallel; ``linear_kv`` (all groups) replicated over tp."""
        tp = self.group.size
        self.groups_local, self.my_group = 1, M.local_rank(self.group) // (tp // groups)
        self.q_per_group = heads // tp  # query heads on this rank, all in group ``my_group``
        self.linear_q = ColumnParallelLinear(c.hidden_size, heads * self.d, init_std=c.init_method_std, **kw)
        one = Group(f"{self.group.name}-replica", (self.group.ranks[M.local_rank(self.group)],), None)
        self.linear_kv = ColumnParallelLinear(c.hidden_size, 2 * groups * self.d, init_std=c.init_method_std,
                                              **{**kw, "group": one, "sequence_parallel": False})
        # rows per group [k, v]: --muon-split-qkv orthogonalises K and V apart, as the fused weight's blocks (Q is
        # linear_q, whole); without the split the fused weight has no counterpart here (refused in arguments.py)
        self.linear_kv.weight.qkv_split_rows = [self.d, self.d]
        qkv_rows, d, qpg = (heads + 2 * groups) * self.d, self.d, heads // groups
        for p in (self.linear_q.weight, self.linear_q.bias, self.linear_kv.weight, self.linear_kv.bias):
            if p is None:
                continue
            is_q, init = p is self.linear_q.weight or p is self.linear_q.bias, p.init
            if not is_q:
                set_attributes(p, parallel=False, init=init)
                p.sequence_parallel = True  # partial sum over tp: all-reduced before the step
            # plain data (picklable): canonical tensor suffix, its shape, which rows, the head layout
            p.init_from = ("linear_qkv." + ("weight" if p.dim() == 2 else "bias"), (qkv_rows,) + tuple(p.shape[1:]),
                           "q" if is_q else "kv", groups, qpg, d)

    def fuse_full_state(self, prefix: str, state: dict) -> None:
        """Replace full ``linear_q``/``linear_kv`` tensors in ``state`` by the canonical ``linear_qkv``."""
        if not self.replicate_kv:
            return
        g, d = self.linear_kv.weight.shape[0] // (2 * self.d), self.d
        for kind in ("weight", "bias"):
            q, kv = state.pop(f"{prefix}linear_q.{kind}", None), state.pop(f"{prefix}linear_kv.{kind}", None)
            if q is not None:
                state[f"{prefix}linear_qkv.{kind}"] = QKV.group_cat([q, kv], g)

    def split_full_state(self, prefix: str, state: dict) -> dict:
        """Inverse of :meth:`fuse_full_state` (a new dict; ``state`` is not modified)."""
        if not self.replicate_kv:
            return state
        out = dict(state)
        g, d = self.linear_kv.weight.shape[0] // (2 * self.d), self.d
        qpg = self.q_per_group * self.group.size // g
        for kind in ("weight", "bias"):
            full = out.pop(f"{prefix}linear_qkv.{kind}", None)
            if full is not None:
                out[f"{prefix}linear_q.{kind}"] = QKV.q_rows(full, g, qpg, d)
                out[f"{prefix}linear_kv.{kind}"] = QKV.kv_rows(full, g, qpg, d)
        return out

    def _project(self, x: torch.Tensor):
        """``q [s, b, hq/tp, d]``, ``k, v [s, b, g/tp or 1, d]``."""
        if self.replicate_kv:
            q = self.linear_q(x)
            s, b = q.shape[:2]
            xk = M.gather_from_sp(x, self.group) if self.sp else M.copy_to_tp(x, self.group)
            kv = self.linear_kv(xk).view(s, b, -1, 2, self.d)[:, :, self.my_group]  # [s, b, 2, d]
            return q.view(s, b, -1, self.d), kv[:, :, 0:1], kv[:, :, 1:2]
        qkv = self.linear_qkv(x)  # [s, b, g/tp * (hq/g + 2) * d]
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.groups_local, self.q_per_group + 2, self.d)
        q = qkv[:, :, :, : self.q_per_group].reshape(s, b, -1, self.d)  # [s, b, hq/tp, d]
        return q, qkv[:, :, :, self.q_per_group], qkv[:, :, :, self.q_per_group + 1]

    def sinks(self) -> torch.Tensor | None:
        """This rank's heads' sink logits ``[hq/tp]`` (``--softmax-type``), None for the plain softmax."""
        if self.softmax_type == "learnable":
            return self.softmax_offset
        if self.softmax_type == "off-by-one":
            return torch.zeros(self.c.num_attention_heads // self.group.size, dtype=torch.float32)
        return None

    def _window_sink_attention(self, q, k, v, document_ids, p: float) -> torch.Tensor:
        """Causal attention within this layer's window, with attention sinks (transformer/window.py). Without
        document ids: the block kernels of a one-rank ring (cp_attention.py: only the tiles the window reaches,
        the sink once per row, the hash dropout of the cp path), no ``[s, s]`` scores. With them (packed
        documents: the blocks know positions, not documents) the masked softmax over the whole ``[s, s]``."""
        from omnitron.core.transformer.window import keep_mask, sink_attention

        if document_ids is None:
            return cp_attention(self, q, k, v, p, window=self.window, sinks=self.sinks())
        if self.cp_group is not None:  # (document_ids: the ring's blocks know positions, not documents)
            self._document_attention(q, k, v, document_ids, p)  # raises its refusal
        pos = torch.arange(q.shape[2], device=q.device)
        keep = (keep_mask(pos, pos, self.window) & (document_ids[:, :, None] == document_ids[:, None, :]))[:, None]
        sinks = self.sinks()
        sinks = None if sinks is None else sinks.to(q.device)
        if p == 0.0:
            return sink_attention(q, k, v, keep, sinks)
        with self.tracker.fork():
            return sink_attention(q, k, v, keep, sinks, dropout_p=p)

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       key_padding_mask: torch.Tensor | None = None,
                       document_ids: torch.Tensor | None = None,
                       causal_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``[b, h, s, d]`` in and out; dropout draws from the tp-rank-specific stream (local heads).
        ``key_padding_mask [b, s]`` (bool, True = padding key) selects bidirectional attention;
        ``document_ids [b, s]`` causal attention within each document (see the module docstring);
        ``causal_padding_mask [b, s]`` causal attention to the keys that are not padding (T5's decoder)."""
        p = self.c.attention_dropout if self.training else 0.0
        if key_padding_mask is not None:
            return self._padded_attention(q, k, v, key_padding_mask, p)
        if causal_padding_mask is not None:
            return self._padded_attention(q, k, v, causal_padding_mask, p, causal=True)
        if self.cp_group is not None and document_ids is None:  # windows and sinks too (transformer/cp_attention.py)
            return cp_attention(self, q, k, v, p, window=self.window, sinks=self.sinks())
        if self.window is not None or self.softmax_type != "vanilla":
            return self._window_sink_attention(q, k, v, document_ids, p)
        if document_ids is not None:
            return self._document_attention(q, k, v, document_ids, p)
        if p == 0.0:
            return self.backend.kernels.attention(q, k, v, causal=True, dropout_p=0.0)
        if self.tracker.in_graph():
            return in_graph_dropout_attention(q, k, v, None, p, self.tracker)
        with self.tracker.fork():
            return self.backend.kernels.attention(q, k, v, causal=True, dropout_p=p)

    def _padded_attention(self, q, k, v, key_padding_mask: torch.Tensor, p: float, causal: bool = False):
        """Attention over the keys that are not padding (plain SDPA with a boolean mask), ``causal``: and not after
        the query (the query's own key is padding when it is: its row still keeps the earlier real keys)."""
        if self.cp_group is not None:
            raise ValueError("attention with a padding mask does not run under context parallelism; "
                             "use --context-parallel-size 1")
        keep = ~key_padding_mask.to(torch.bool)[:, None, None, :]  # [b, 1, 1, s]: True = attend
        if causal:
            s = q.shape[2]
            keep = keep & torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        return self._masked_sdpa(q, k, v, keep, p)

    def _document_attention(self, q, k, v, document_ids: torch.Tensor, p: float) -> torch.Tensor:
        """Causal attention that stops at document boundaries (block-diagonal causal boolean mask)."""
        if self.cp_group is not None:
            raise ValueError("--reset-attention-mask (attention within each packed document) does not run under "
                             "context parallelism; use --context-parallel-size 1 or drop --reset-attention-mask")
        s = q.shape[2]
        if tuple(document_ids.shape) != (q.shape[0], s):
            raise ValueError(f"document_ids must be [batch, seq] = {(q.shape[0], s)}, got {tuple(document_ids.shape)}")
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        same = document_ids[:, :, None] == document_ids[:, None, :]  # [b, s_q, s_k]
        return self._masked_sdpa(q, k, v, (same & causal)[:, None], p)

    def _masked_sdpa(self, q, k, v, keep: torch.Tensor, p: float) -> torch.Tensor:
        """Plain SDPA with a boolean ``keep`` mask (True = attend), grouped-query heads repeated."""
        if k.shape[1] != q.shape[1]:  # grouped-query heads: repeat each key/value head for its queries
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if p == 0.0:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        if self.tracker.in_graph():
            return in_graph_dropout_attention(q, k, v, keep, p, self.tracker)
        with self.tracker.fork():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=p)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor | None, key_padding_mask: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, causal_padding_mask: torch.Tensor | None = None):
        q, k, v = self._project(x)
        s, b = q.shape[:2]
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if freqs is not None:
            rope = self.backend.kernels.rope
            q, k = rope(q, freqs, self.c.rotary_interleaved), rope(k, freqs, self.c.rotary_interleaved)
            if self.rope_factor != 1.0:  # YaRN's concentration on the rotated q and k (transformer/yarn.py)
                q, k = q * self.rope_factor, k * self.rope_factor
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        masks = (key_padding_mask,) if document_ids is None else (key_padding_mask, document_ids)
        if causal_padding_mask is not None:
            masks = (None, None, causal_padding_mask)
        if self.c.recompute_granularity == "selective" and self.training and torch.is_grad_enabled():
            out = checkpoint(self.core_attention, self.tracker, q, k, v, *masks)
        else:
            out = self.core_attention(q, k, v, *masks)
        out = out.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, hq/tp * d]
        y = self.linear_proj(out)
        return y if isinstance(y, tuple) else (y, None)


def extract_rows(full: torch.Tensor, which: str, g: int, qpg: int, d: int) -> torch.Tensor:
    """``q_rows`` or ``kv_rows`` by name (used with a parameter's ``init_from``)."""
    return (QKV.q_rows if which == "q" else QKV.kv_rows)(full, g, qpg, d)
