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

Attention dropout: each step's block draws its keep-mask from a generator seeded by
``(seed, rank, step)`` (:func:`block_dropout`), so backward regenerates exactly the forward's masks
without storing them.
"""
from __future__ import annotations

import math

import torch

from omnitron.core.parallel.context.blocks import REFERENCE, BlockKernel, merge


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


def _step_slices(step: int, src: int, rank: int, c: int, causal: bool) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal mask) this rank computes against rank ``src``'s block at ``step``."""
    every = slice(None)
    if not causal:
        return every, every, False
    if step == 0:
        return every, every, True
    if src < rank:
        return every, slice(0, c), False
    return slice(c, None), every, False


def block_dropout(seed: int, rank: int, step: int, shape, p: float, dtype, device) -> torch.Tensor:
    """The dropout multiplier (0 or ``1 / (1 - p)``) of cp rank ``rank``'s block at ring ``step``."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + rank * 10_007 + step) % 2**63)
    keep = torch.rand(shape, generator=g, device=device, dtype=dtype) >= p
    return keep.to(dtype) / (1.0 - p)


class _Step:
    """What one ring step computes on this rank: query rows, key rows, mask and dropout multiplier."""

    def __init__(self, ctx, ring: _Ring, i: int, q: torch.Tensor, cdt) -> None:
        c = q.shape[2] // 2
        self.rows, self.cols, self.causal = _step_slices(i, (ring.rank - i) % ring.size, ring.rank, c, ctx.causal)
        self.drop = None
        if ctx.dropout_p > 0.0:
            sq, sk = len(range(q.shape[2])[self.rows]), len(range(q.shape[2])[self.cols])
            self.drop = block_dropout(ctx.seed, ring.rank, i, (q.shape[0], q.shape[1], sq, sk), ctx.dropout_p, cdt,
                                      q.device)

    def kw(self, scale: float) -> dict:
        return dict(causal=self.causal, scale=scale, drop=self.drop)


class RingAttention(torch.autograd.Function):
    """forward: ring attention over the cp group; backward: the ring in reverse for dk/dv."""

    @staticmethod
    def forward(ctx, q, k, v, group, collectives, causal: bool, scale: float, kernel: BlockKernel,
                dropout_p: float, seed: int):
        ctx.group, ctx.collectives, ctx.causal, ctx.scale, ctx.kernel = group, collectives, causal, scale, kernel
        ctx.dropout_p, ctx.seed = dropout_p, seed
        ring, cdt = _Ring(group, collectives), torch.promote_types(q.dtype, torch.float32)
        out, lse = None, None
        kv = torch.stack([k, v])  # [2, b, hkv, s, d], the circulating block
        for i in range(ring.size):
            nxt, handles = ring.exchange(kv) if i + 1 < ring.size else (None, [])
            st = _Step(ctx, ring, i, q, cdt)
            o, l = kernel.forward(q[:, :, st.rows], kv[0, :, :, st.cols], kv[1, :, :, st.cols], **st.kw(scale))
            o, l = o.to(cdt), l.to(cdt)  # merged in fp32 (fp64 for fp64 inputs) whatever the kernel's dtype
            if out is None:
                out, lse = o, l  # step 0 covers every row
            else:
                merge(out[:, :, st.rows], lse[:, :, st.rows], o, l)
            _wait(handles)
            kv = nxt
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, cdt = _Ring(ctx.group, ctx.collectives), torch.promote_types(q.dtype, torch.float32)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        kv = torch.stack([k, v])
        dkv_in, dkv_handles = None, []
        for i in range(ring.size):
            nxt, handles = ring.exchange(kv) if i + 1 < ring.size else (None, [])
            st = _Step(ctx, ring, i, q, cdt)
            r, cols = st.rows, st.cols
            dq_b, dk_b, dv_b = ctx.kernel.backward(dout[:, :, r], q[:, :, r], kv[0, :, :, cols], kv[1, :, :, cols],
                                                   out[:, :, r], lse[:, :, r], **st.kw(ctx.scale))
            dq[:, :, r] += dq_b
            dkv = torch.zeros(kv.shape, dtype=cdt, device=kv.device)
            dkv[0, :, :, cols], dkv[1, :, :, cols] = dk_b, dv_b
            _wait(dkv_handles)  # the accumulator of this block from the ranks before us
            if dkv_in is not None:
                dkv += dkv_in
            dkv_in, dkv_handles = ring.exchange(dkv)  # on the last step: home to the block's owner
            _wait(handles)
            kv = nxt
        _wait(dkv_handles)
        return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype), *([None] * 7)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, collectives, causal: bool = True,
                   scale: float | None = None, dropout_p: float = 0.0, seed: int = 0,
                   kernel: BlockKernel = REFERENCE) -> torch.Tensor:
    """Attention of this cp rank's queries over the whole (cp-split) sequence.

    ``q [b, hq, s/cp, d]``, ``k, v [b, hkv, s/cp, d]`` (hq a multiple of hkv), rows in the
    load-balanced order of :mod:`omnitron.core.parallel.context.layout`. Returns ``[b, hq, s/cp, d]``
    in ``q``'s dtype; the block kernel takes the inputs' dtype (the reference computes in fp32, fp64 for
    fp64 inputs; a flash kernel in bf16/fp16 accumulates in fp32) and block results merge in fp32. ``dropout_p > 0``: attention
    dropout with masks drawn from ``seed`` (draw it from the caller's RNG stream per call)."""
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
    return RingAttention.apply(q, k, v, group, collectives, causal, scale, kernel, dropout_p, seed)
