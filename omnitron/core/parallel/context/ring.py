"""Ring attention over ``groups.cp``: exact softmax attention over a sequence split across ranks.

Every cp rank holds the query, key and value rows of its load-balanced slice (``layout.py``:
chunks ``r`` and ``2cp-1-r``, ``c`` rows each). Forward: the local key/value block travels
``cp - 1`` hops around the ring (rank r sends to r+1 and receives from r-1); the transfer of the
next block is posted before the current block is computed, so they overlap. Block outputs are
merged exactly with their log-sum-exps. Under the causal mask, step ``i`` holds the block of rank
``src = r - i``:

- ``i == 0``: local causal attention (the slice's positions are increasing);
- ``src < r``: all local queries see only the block's early chunk (its late chunk is future);
- ``src > r``: only the local late chunk sees anything, and it sees the whole block;

so every step costs every rank the same. Backward re-circulates the key/value blocks and sends a
gradient accumulator for each block along with it; after ``cp`` hops it is back at its owner
holding every rank's contribution. Communication happens only inside this Function's forward and
backward (autograd never differentiates through it).

Attention dropout is counter-based (:mod:`omnitron.kernels.hash_dropout`): a score element is kept by a hash
of ``(seed, batch, head_offset + head, global query position, global key position)``, so each tile draws its
mask from the positions it covers, backward regenerates it, nothing is stored, and the ring's masks are those
of one process (or any other cp layout) under the same seed.

Sliding window (``window = (left, right)``, causal): a step's block is cut into tiles by global position
(:mod:`.tiles`): tiles outside the window are skipped, whole ones run the kernel, those the window's edge
cuts run the reference kernel with their mask. Blocks and tiles merge by log-sum-exp from an empty start
(a row that has seen no key yet has ``lse = -inf``).
Attention sinks (``sinks [hq]``, one logit ``a`` per query head): the merged blocks give the output ``o``
and log-sum-exp ``L`` over every key; the sink enters each row's denominator once, after the merge:
``L' = logaddexp(L, a)``, ``o' = o exp(L - L')``. Backward runs the blocks given ``o', L'`` (the sink's
column carries no value) and ``da = -sum_rows exp(a - L') rowsum(do * o')``.

Keys and values travel as one tensor, concatenated on the head dim, so ``v``'s head dim may differ from
``q``'s and ``k``'s (multi-latent attention).
"""
from __future__ import annotations

import math

import torch

from omnitron.core.parallel.context.blocks import REFERENCE, BlockKernel, add_sinks, merge, sink_grad
from omnitron.core.parallel.context.layout import chunk_positions
from omnitron.core.parallel.context.tiles import _step_slices, step_plan  # noqa: F401 - tests read _step_slices
from omnitron.kernels.function_output import cast_output
from omnitron.kernels.hash_dropout import block_positions


class _Ring:
    """Send-to-next / receive-from-previous over the cp group, one posted exchange at a time."""

    def __init__(self, group, collectives) -> None:
        r, n = group.rank, group.size
        self.group, self.coll, self.rank, self.size = group, collectives, r, n
        self.next, self.prev = group.global_rank((r + 1) % n), group.global_rank((r - 1) % n)

    def exchange(self, send: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Post ``send`` to the next rank and a receive of the same shape from the previous one. While dynamo
        traces (``--torch-compile``): the same shift as one functional all-to-all that sends only to the next
        rank and receives only from the previous one, which dynamo records into the graph (point-to-point
        operations have no functional form)."""
        if torch.compiler.is_compiling():
            return self._shift(send), []
        recv = torch.empty_like(send)
        handles = self.coll.batch_p2p([("send", send, self.next), ("recv", recv, self.prev)], group=self.group.handle)
        return recv, handles


    def _shift(self, send: torch.Tensor) -> torch.Tensor:
        """``send`` of the previous rank (graph-traceable: see :meth:`exchange`)."""
        import torch.distributed._functional_collectives as funcol

        n, flat = send.numel(), send.contiguous().reshape(-1)
        to_next = [n if j == (self.rank + 1) % self.size else 0 for j in range(self.size)]
        from_prev = [n if j == (self.rank - 1) % self.size else 0 for j in range(self.size)]
        return funcol.all_to_all_single(flat, from_prev, to_next, self.group.handle).reshape(send.shape)


def _wait(handles: list) -> None:
    for h in handles:
        h.wait()


class _Step:
    """What one ring step computes on this rank: its tiles (:func:`.tiles.step_plan`) with their dropout (the
    hash dropout of the tile's global positions; None without dropout)."""

    def __init__(self, ctx, ring: _Ring, i: int, q: torch.Tensor) -> None:
        s_l = q.shape[2]
        self.tiles = step_plan(i, ring.rank, ring.size, s_l, ctx.causal, ctx.window, q.device)
        self.drops = [None] * len(self.tiles)
        if ctx.dropout_p > 0.0:
            mine, theirs = (chunk_positions(s_l * ring.size, ring.size, r, q.device)
                            for r in (ring.rank, (ring.rank - i) % ring.size))
            drop = block_positions(mine, theirs, ctx.seed, ctx.dropout_p, ctx.head_offset, q.device)
            self.drops = [drop.narrow(t.rows, t.cols) for t in self.tiles]

    def __iter__(self):
        """``(tile, its kernel, its keyword arguments)``: masked tiles run the reference (only it takes a mask)."""
        for t, drop in zip(self.tiles, self.drops):
            kw = dict(causal=t.causal, scale=self.scale, drop=drop)
            yield t, (self.kernel if t.mask is None else REFERENCE), kw if t.mask is None else {**kw, "mask": t.mask}

    def bind(self, kernel: BlockKernel, scale: float) -> "_Step":
        self.kernel, self.scale = kernel, scale
        return self


class RingAttention(torch.autograd.Function):
    """forward: ring attention over the cp group; backward: the ring in reverse for dk/dv (and the sinks).

    _first_received: eager, the backward exchanges the key/value blocks again (nothing saved but the local
    ones). Compiled, the forward saves the block it received first and the backward starts from it, the graph
    AOTAutograd's CSE made of the two identical exchanges up to torch 2.13; from 2.14 its partitioner kept a
    dead recomputed copy of that exchange in the backward of some ranks and not others, which then issued
    different collectives and hung (cp2 with causal tiles: rank 1's backward had 3 all-to-alls, rank 0's 2)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, group, collectives, causal: bool, scale: float, kernel: BlockKernel,
                dropout_p: float, seed: int, head_offset: int, window):
        ctx.group, ctx.collectives, ctx.causal, ctx.scale, ctx.kernel = group, collectives, causal, scale, kernel
        ctx.dropout_p, ctx.seed, ctx.head_offset, ctx.window, ctx.dk = dropout_p, seed, head_offset, window, k.shape[-1]
        ring, cdt = _Ring(group, collectives), torch.promote_types(q.dtype, torch.float32)
        dk = ctx.dk
        out = q.new_zeros(q.shape[:3] + v.shape[3:], dtype=cdt)  # v's head dim (MLA: not q's)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=cdt, device=q.device)
        kv = torch.cat([k, v], dim=-1)  # [b, hkv, s, dk + dv], the circulating block
        received = None  # compiled: the block received first, saved for the backward (see _first_received)
        for i in range(ring.size):
            nxt, handles = ring.exchange(kv) if i + 1 < ring.size else (None, [])
            for t, kern, kw in _Step(ctx, ring, i, q).bind(kernel, scale):
                blk = kv[:, :, t.cols]
                o, l = kern.forward(q[:, :, t.rows], blk[..., :dk], blk[..., dk:], **kw)
                # merged in fp32 (fp64 for fp64 inputs) whatever the kernel's dtype
                merge(out[:, :, t.rows], lse[:, :, t.rows], o.to(cdt), l.to(cdt))
            _wait(handles)
            if i == 0 and torch.compiler.is_compiling():
                received = nxt
            kv = nxt
        if sinks is not None:
            out, lse = add_sinks(out, lse, sinks)
        result = cast_output(out, q.dtype)
        ctx.save_for_backward(q, k, v, result, lse, sinks, received)
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks, received = ctx.saved_tensors
        ring, cdt, dk = _Ring(ctx.group, ctx.collectives), torch.promote_types(q.dtype, torch.float32), ctx.dk
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        kv = torch.cat([k, v], dim=-1)
        dkv_in, dkv_handles = None, []
        for i in range(ring.size):
            if i == 0 and received is not None:
                nxt, handles = received, []  # _first_received
            else:
                nxt, handles = ring.exchange(kv) if i + 1 < ring.size else (None, [])
            dkv = torch.zeros(kv.shape, dtype=cdt, device=kv.device)
            for t, kern, kw in _Step(ctx, ring, i, q).bind(ctx.kernel, ctx.scale):
                r, cols, blk = t.rows, t.cols, kv[:, :, t.cols]
                dq_b, dk_b, dv_b = kern.backward(dout[:, :, r], q[:, :, r], blk[..., :dk], blk[..., dk:],
                                                 out[:, :, r], lse[:, :, r], **kw)
                dq[:, :, r] += dq_b
                dkv[:, :, cols, :dk] += dk_b
                dkv[:, :, cols, dk:] += dv_b
            _wait(dkv_handles)  # the accumulator of this block from the ranks before us
            if dkv_in is not None:
                dkv += dkv_in
            dkv_in, dkv_handles = ring.exchange(dkv)  # on the last step: home to the block's owner
            _wait(handles)
            kv = nxt
        _wait(dkv_handles)
        dsinks = None if sinks is None or not ctx.needs_input_grad[3] else sink_grad(dout, out, lse, sinks)
        return (dq.to(q.dtype), dkv_in[..., :dk].to(k.dtype), dkv_in[..., dk:].to(v.dtype), dsinks,
                *([None] * 9))


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, collectives, causal: bool = True,
                   scale: float | None = None, dropout_p: float = 0.0, seed: int = 0,
                   kernel: BlockKernel = REFERENCE, window: tuple[int, int] | None = None,
                   sinks: torch.Tensor | None = None, head_offset: int = 0) -> torch.Tensor:
    """Attention of this cp rank's queries over the whole (cp-split) sequence.

    ``q [b, hq, s/cp, d]``, ``k [b, hkv, s/cp, d]``, ``v [b, hkv, s/cp, dv]`` (hq a multiple of hkv), rows in the
    load-balanced order of :mod:`omnitron.core.parallel.context.layout`. Returns ``[b, hq, s/cp, dv]``
    in ``q``'s dtype; the block kernel takes the inputs' dtype (the reference computes in fp32, fp64 for
    fp64 inputs; a flash kernel in bf16/fp16 accumulates in fp32) and block results merge in fp32. ``dropout_p > 0``:
    attention dropout, the hash masks of ``seed`` (draw it from the caller's RNG stream per call, the same on every cp
    rank) with query heads numbered from ``head_offset`` (the head split of a2a+p2p). ``window``: causal
    sliding window ``(left, right)``; ``sinks [hq]``: one sink logit per query head (see the module docstring)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"ring attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    if causal and q.shape[2] % 2:
        raise ValueError(f"ring attention: the local sequence ({q.shape[2]}) must hold two equal chunks; "
                         f"--seq-length must be divisible by 2 x --context-parallel-size")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if group.size == 1:
        raise ValueError("ring attention needs a context-parallel group of at least 2 ranks")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"ring attention: dropout_p must be in [0, 1), got {dropout_p}")
    if window is not None and not causal:
        raise ValueError("ring attention: a sliding window is causal here; pass causal=True")
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"ring attention: sinks must hold one logit per query head ({q.shape[1]}), "
                         f"got shape {tuple(sinks.shape)}")
    return RingAttention.apply(q, k, v, sinks, group, collectives, causal, scale, kernel, dropout_p, seed,
                               head_offset, None if window is None else tuple(window))
