"""Flash attention over one ring block in Triton, with context parallelism's hash dropout fused.

``attention_block_forward`` / ``attention_block_backward`` (the per-block kernel of ring attention, see
:mod:`omnitron.kernels.reference.attention_block`): online softmax over key tiles, the block's output (float32,
normalised within the block) and log-sum-exp; the backward, given the final output and log-sum-exp, recomputes
each tile's probabilities. Neither stores ``[sq, sk]`` scores nor a mask: the dropout decision of element
``(b, h, q, k)`` is the hash of :mod:`omnitron.kernels.hash_dropout` (row key from seed, batch, head and the
row's global position; column key from the key's global position; one mix per element), computed in uint32
registers per tile, in forward and again in both backward kernels: bit for bit the reference's mask, scaled by
``1 / (1 - p)`` where kept. The log-sum-exp is that of the undropped scores (dropout leaves it unchanged).

Causal blocks are masked top-left (key ``j > `` query ``i`` dropped), as the reference does. Grouped-query
attention reads key/value head ``h // (hq / hkv)``. Backward runs two kernels, both deterministic: per key tile
``dk, dv`` summed over the tile's query heads and rows, and per query tile ``dq``. fp32 inputs multiply in IEEE
fp32 (no TF32); bf16/fp16 inputs multiply in their dtype and accumulate in fp32, as flash attention does.
Registered for the GPU backends: the CUDA backend prefers ATen's flash kernel where there is no dropout (it
declines dropout calls, which come here); the CPU keeps the chunked reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from omnitron.kernels.hash_dropout import as_int32, row_key, threshold
from omnitron.kernels.registry import register
from omnitron.kernels.triton_kernels._common import GPU_BACKENDS, NAME, available, check, interpreting

_LOG2E = 1.4426950408889634
_MAX_HEAD_DIM = 256


@triton.jit
def _mix(x):
    """:func:`omnitron.kernels.hash_dropout.mix32_int` on uint32 (logical shifts, products modulo 2^32)."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)


@triton.jit
def _row_keys(QP, rows, rmask, b, head, SEEDP, seed, SEED_PTR: tl.constexpr):
    """uint32 ``[BM]``: the row keys ``mix(mix(mix(b ^ seed) ^ head) ^ q)`` of the tile's query rows."""
    if SEED_PTR:
        s = tl.load(SEEDP).to(tl.uint32, bitcast=True)
    else:
        s = seed.to(tl.uint32, bitcast=True)
    r = _mix(b.to(tl.uint32, bitcast=True) ^ s)
    r = _mix(r ^ head.to(tl.uint32, bitcast=True))
    qp = tl.load(QP + rows, mask=rmask, other=0).to(tl.uint32, bitcast=True)
    return _mix(r ^ qp)


@triton.jit
def _col_keys(KP, cols, cmask):
    """uint32 ``[BN]``: the column keys ``mix(k ^ SALT)`` of the tile's key rows."""
    kp = tl.load(KP + cols, mask=cmask, other=0).to(tl.uint32, bitcast=True)
    return _mix(kp ^ 0x1E3779B9)


@triton.jit
def _keep(rk, ck, thr):
    """Boolean ``[BM, BN]``: element kept iff ``mix(row ^ col) >= threshold`` (unsigned)."""
    return _mix(rk[:, None] ^ ck[None, :]) >= thr.to(tl.uint32, bitcast=True)


@triton.jit
def _valid(rows, cols, sk, CAUSAL: tl.constexpr):
    """``[BM, BN]``: a key of the block, not above the (top-left) diagonal when causal. Padding rows (``>= sq``:
    zero queries, outputs, gradients) see key 0 like any row, so their statistics stay finite."""
    ok = (cols < sk)[None, :] & (rows >= 0)[:, None]
    if CAUSAL:
        ok = ok & (cols[None, :] <= rows[:, None])
    return ok


@triton.jit
def _at(ptr, b, h, sb, sh):
    """``ptr`` advanced to batch ``b``, head ``h`` (int64 offsets)."""
    return ptr + b.to(tl.int64) * sb + h.to(tl.int64) * sh


@triton.jit
def _tile(base, rows, n, stride, cols, ncols):
    """``base[rows, cols]`` (row stride ``stride``), zero outside ``n`` rows x ``ncols`` columns."""
    return tl.load(base + rows[:, None] * stride + cols[None, :], mask=(rows < n)[:, None] & (cols < ncols)[None, :],
                   other=0.0)


@triton.jit
def _query_program(hq, rep, CAUSAL: tl.constexpr, BM: tl.constexpr):
    """A program over one query tile of one (batch, query head): ``(tile, b * hq + h, b, h, kv head, rows)``. The
    grid is ``(b * hq, tiles)``, heads varying fastest, and causal blocks take their last query tiles (the most
    keys) first: the longest programs start first and the short ones fill in behind them."""
    bh = tl.program_id(0)
    pid = tl.program_id(1)
    if CAUSAL:
        pid = tl.num_programs(1) - 1 - pid
    h = bh % hq
    return pid, bh, bh // hq, h, h // rep, pid * BM + tl.arange(0, BM)


@triton.jit
def _key_end(pid, sk, CAUSAL: tl.constexpr, BM: tl.constexpr):
    """The keys query tile ``pid`` sees: all, or (causal) those up to its last row."""
    if CAUSAL:
        return tl.minimum(sk, (pid + 1) * BM)
    return sk


@triton.jit(do_not_specialize=["seed", "thr"])
def _fwd(Q, K, V, O, LSE, QP, KP, SEEDP, seed, thr, inv_keep, qk_scale, sq, sk, hq, rep, head0, d, dv,
         sqb, sqh, sqs, skb, skh, sks, svb, svh, svs,
         CAUSAL: tl.constexpr, DROP: tl.constexpr, SEED_PTR: tl.constexpr, PREC: tl.constexpr,
         BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr):
    pid, bh, b, h, hk, rows = _query_program(hq, rep, CAUSAL, BM)
    rmask = rows < sq
    dc, vc = tl.arange(0, BD), tl.arange(0, BDV)
    kb, vb = _at(K, b, hk, skb, skh), _at(V, b, hk, svb, svh)
    q = _tile(_at(Q, b, h, sqb, sqh), rows, sq, sqs, dc, d)
    if DROP:
        rk = _row_keys(QP, rows, rmask, b, head0 + h, SEEDP, seed, SEED_PTR)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BDV], tl.float32)
    for n0 in range(0, _key_end(pid, sk, CAUSAL, BM), BN):
        cols = n0 + tl.arange(0, BN)
        cmask = cols < sk
        k = _tile(kb, cols, sk, sks, dc, d)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        s = tl.where(_valid(rows, cols, sk, CAUSAL), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROP:
            p = tl.where(_keep(rk, _col_keys(KP, cols, cmask), thr), p * inv_keep, 0.0)
        v = _tile(vb, cols, sk, svs, vc, dv)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    ob = bh.to(tl.int64) * sq
    tl.store(O + (ob + rows[:, None]) * dv + vc[None, :], acc / l_i[:, None], mask=rmask[:, None] & (vc < dv)[None, :])
    tl.store(LSE + ob + rows, (m_i + tl.log2(l_i)) / 1.4426950408889634, mask=rmask)


@triton.jit(do_not_specialize=["seed", "thr"])
def _bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, QP, KP, SEEDP, seed, thr, inv_keep, qk_scale, scale,
              sq, sk, hq, hkv, rep, head0, d, dv,
              sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds,
              CAUSAL: tl.constexpr, DROP: tl.constexpr, SEED_PTR: tl.constexpr, PREC: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr):
    bh = tl.program_id(0)
    pid = tl.program_id(1)  # key tiles slowest: a causal block's first ones (the most query rows) start first
    b, hk = bh // hkv, bh % hkv
    cols = pid * BN + tl.arange(0, BN)
    cmask = cols < sk
    dc, vc = tl.arange(0, BD), tl.arange(0, BDV)
    k = _tile(_at(K, b, hk, skb, skh), cols, sk, sks, dc, d)
    v = _tile(_at(V, b, hk, svb, svh), cols, sk, svs, vc, dv)
    if DROP:
        ck = _col_keys(KP, cols, cmask)
    dk = tl.zeros([BN, BD], tl.float32)
    dvacc = tl.zeros([BN, BDV], tl.float32)
    lo = 0
    if CAUSAL:
        lo = (pid * BN // BM) * BM  # query rows above the tile's first key see none of it
    for r in range(0, rep):
        h = hk * rep + r
        qb, db = _at(Q, b, h, sqb, sqh), _at(DO, b, h, sdb, sdh)
        sb = (b * hq + h).to(tl.int64) * sq
        for m0 in range(lo, sq, BM):
            rows = m0 + tl.arange(0, BM)
            rmask = rows < sq
            q = _tile(qb, rows, sq, sqs, dc, d)
            do = _tile(db, rows, sq, sds, vc, dv)
            lse = tl.load(LSE + sb + rows, mask=rmask, other=0.0) * 1.4426950408889634
            delta = tl.load(DELTA + sb + rows, mask=rmask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
            p = tl.where(_valid(rows, cols, sk, CAUSAL), tl.exp2(s - lse[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            pm = p
            if DROP:
                kept = _keep(_row_keys(QP, rows, rmask, b, head0 + h, SEEDP, seed, SEED_PTR), ck, thr)
                pm = tl.where(kept, p * inv_keep, 0.0)
                dp = tl.where(kept, dp * inv_keep, 0.0)
            dvacc += tl.dot(tl.trans(pm.to(do.dtype)), do, input_precision=PREC)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC)
    out = bh.to(tl.int64) * sk
    tl.store(DK + (out + cols[:, None]) * d + dc[None, :], dk * scale, mask=cmask[:, None] & (dc < d)[None, :])
    tl.store(DV + (out + cols[:, None]) * dv + vc[None, :], dvacc, mask=cmask[:, None] & (vc < dv)[None, :])


@triton.jit(do_not_specialize=["seed", "thr"])
def _bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, QP, KP, SEEDP, seed, thr, inv_keep, qk_scale, scale,
            sq, sk, hq, rep, head0, d, dv,
            sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds,
            CAUSAL: tl.constexpr, DROP: tl.constexpr, SEED_PTR: tl.constexpr, PREC: tl.constexpr,
            BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr):
    pid, bh, b, h, hk, rows = _query_program(hq, rep, CAUSAL, BM)
    rmask = rows < sq
    dc, vc = tl.arange(0, BD), tl.arange(0, BDV)
    q = _tile(_at(Q, b, h, sqb, sqh), rows, sq, sqs, dc, d)
    do = _tile(_at(DO, b, h, sdb, sdh), rows, sq, sds, vc, dv)
    sb = bh.to(tl.int64) * sq
    lse = tl.load(LSE + sb + rows, mask=rmask, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + sb + rows, mask=rmask, other=0.0)
    kb, vb = _at(K, b, hk, skb, skh), _at(V, b, hk, svb, svh)
    if DROP:
        rk = _row_keys(QP, rows, rmask, b, head0 + h, SEEDP, seed, SEED_PTR)
    dq = tl.zeros([BM, BD], tl.float32)
    for n0 in range(0, _key_end(pid, sk, CAUSAL, BM), BN):
        cols = n0 + tl.arange(0, BN)
        cmask = cols < sk
        k = _tile(kb, cols, sk, sks, dc, d)
        v = _tile(vb, cols, sk, svs, vc, dv)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        p = tl.where(_valid(rows, cols, sk, CAUSAL), tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        if DROP:
            dp = tl.where(_keep(rk, _col_keys(KP, cols, cmask), thr), dp * inv_keep, 0.0)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    tl.store(DQ + (sb + rows[:, None]) * d + dc[None, :], dq * scale, mask=rmask[:, None] & (dc < d)[None, :])


@triton.jit
def _delta(O, DO, DELTA, sq, dv, sob, soh, sos, sdb, sdh, sds, hq, BM: tl.constexpr, BDV: tl.constexpr):
    """``delta[b, h, rows] = rowsum(dout * out)`` in fp32 (the softmax gradient's correction), without the
    ``[b, hq, sq, dv]`` fp32 products a torch expression would allocate."""
    bh = tl.program_id(0)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    vc = tl.arange(0, BDV)
    b, h = bh // hq, bh % hq
    o = _tile(_at(O, b, h, sob, soh), rows, sq, sos, vc, dv).to(tl.float32)
    do = _tile(_at(DO, b, h, sdb, sdh), rows, sq, sds, vc, dv).to(tl.float32)
    tl.store(DELTA + bh.to(tl.int64) * sq + rows, tl.sum(o * do, 1), mask=rows < sq)


class _Drop:
    """The kernels' dropout arguments from a :class:`~omnitron.kernels.hash_dropout.HashDropout` (or none): the
    positions as int32, the seed key as an int32 scalar or, inside a compiled layer, the 0-dim int32 tensor that
    holds it (read by the kernel: no host sync), the threshold's bit pattern and ``1 / (1 - p)``."""

    def __init__(self, drop, like: torch.Tensor) -> None:
        self.on = drop is not None
        if not self.on:
            self.qp = self.kp = self.seedp = like
            self.seed = self.thr = self.head0 = 0
            self.inv = 1.0
            return
        key = row_key(drop.seed)
        self.seed_ptr = isinstance(key, torch.Tensor)
        self.seedp, self.seed = (key.reshape(1), 0) if self.seed_ptr else (like, int(key))
        self.qp, self.kp = drop.q_pos.to(torch.int32).contiguous(), drop.k_pos.to(torch.int32).contiguous()
        self.thr, self.inv, self.head0 = as_int32(threshold(drop.p)), 1.0 / (1.0 - drop.p), int(drop.head0)

    def args(self) -> tuple:
        return self.qp, self.kp, self.seedp, self.seed, self.thr, self.inv

    def flags(self) -> dict:
        return dict(DROP=self.on, SEED_PTR=self.on and self.seed_ptr)


def _dims(q, v) -> dict:
    """The padded head dims, the matmul precision (IEEE for fp32: no TF32) and the per-kernel tile sizes."""
    bd, bdv = (max(16, triton.next_power_of_2(t.shape[-1])) for t in (q, v))
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    return dict(BD=bd, BDV=bdv, PREC=prec)


def _tiles(kind: str, bd: int) -> tuple[int, int, dict]:
    """``(BM, BN, launch options)`` of kernel ``kind`` ("fwd", "dkdv", "dq") at padded head dim ``bd``: 32 x 32
    under the interpreter (partial tiles at the tests' sizes), else flash-attention-2-like tiles."""
    if interpreting():
        return 32, 32, {}
    wide = bd > 128
    tiles = {"fwd": (64, 32) if wide else (128, 64), "dkdv": (32, 64) if wide else (32, 128),
             "dq": (64, 32) if wide else (128, 32)}[kind]
    return (*tiles, dict(num_warps=4 if wide or kind != "fwd" else 8, num_stages=2 if wide else 3))


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def flash_forward(q, k, v, *, causal: bool, scale: float, drop=None):
    """(``out [b, hq, sq, dv]`` float32, ``lse [b, hq, sq]`` float32) of one block (see the module)."""
    q, k, v = (_last_contiguous(t) for t in (q, k, v))
    b, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[-1]
    out = torch.empty(b, hq, sq, dv, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    dr, dims = _Drop(drop, q), _dims(q, v)
    bm, bn, opts = _tiles("fwd", dims["BD"])
    _fwd[(b * hq, triton.cdiv(sq, bm))](
        q, k, v, out, lse, *dr.args(), scale * _LOG2E, sq, sk, hq, hq // hkv, dr.head0, d, dv,
        *_strides(q), *_strides(k), *_strides(v), CAUSAL=causal, **dr.flags(), **dims, BM=bm, BN=bn, **opts)
    return out, lse


def flash_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float, drop=None):
    """(dq, dk, dv), float32, of one block given the final ``out`` and ``lse`` of its query rows."""
    q, k, v, dout, out = (_last_contiguous(t) for t in (q, k, v, dout, out))
    b, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[-1]
    lse = lse.float().contiguous()
    delta = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    bdv = max(16, triton.next_power_of_2(dv))
    rows = max(1, min(64, 8192 // bdv))
    _delta[(b * hq, triton.cdiv(sq, rows))](out, dout, delta, sq, dv, *_strides(out), *_strides(dout), hq, BM=rows,
                                            BDV=bdv)
    dq = torch.empty(b, hq, sq, d, dtype=torch.float32, device=q.device)
    dk = torch.empty(b, hkv, sk, d, dtype=torch.float32, device=q.device)
    dvv = torch.empty(b, hkv, sk, dv, dtype=torch.float32, device=q.device)
    dr, dims = _Drop(drop, q), _dims(q, v)
    common = (*dr.args(), scale * _LOG2E, scale)
    strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(dout))
    bm, bn, opts = _tiles("dkdv", dims["BD"])
    _bwd_dkdv[(b * hkv, triton.cdiv(sk, bn))](
        q, k, v, dout, lse, delta, dk, dvv, *common, sq, sk, hq, hkv, hq // hkv, dr.head0, d, dv, *strides,
        CAUSAL=causal, **dr.flags(), **dims, BM=bm, BN=bn, **opts)
    bm, bn, opts = _tiles("dq", dims["BD"])
    _bwd_dq[(b * hq, triton.cdiv(sq, bm))](
        q, k, v, dout, lse, delta, dq, *common, sq, sk, hq, hq // hkv, dr.head0, d, dv, *strides,
        CAUSAL=causal, **dr.flags(), **dims, BM=bm, BN=bn, **opts)
    return dq, dk, dvv


def _why_not(q, k, v, drop, mask) -> str | None:
    if mask is not None:
        return "an explicit mask (sliding-window tiles) runs the reference"
    why = check(q, k, v)
    if why:
        return why
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "needs 4-D q, k, v [b, h, s, d]"
    if q.dtype != k.dtype or k.dtype != v.dtype:
        return "q, k and v must share a dtype"
    if interpreting() and q.dtype == torch.bfloat16:
        return "bf16 under TRITON_INTERPRET: the interpreter's tl.dot of bf16 tiles is wrong (Triton 3.9; GPUs are not)"
    if q.shape[1] % k.shape[1]:
        return "query heads must be a multiple of key/value heads"
    if max(q.shape[-1], v.shape[-1]) > _MAX_HEAD_DIM:
        return f"head dim over {_MAX_HEAD_DIM}"
    if q.shape[2] == 0 or k.shape[2] == 0:
        return "an empty block"
    if drop is not None:
        seed = drop.seed
        if isinstance(seed, torch.Tensor) and (seed.device != q.device or seed.dtype != torch.int32):
            return "the seed key tensor must be int32 on q's device"
        if drop.q_pos.device != q.device or drop.k_pos.device != q.device:
            return "the dropout positions must be on q's device"
    return None


def _fwd_supports(q, k, v, *, causal, scale, drop=None, mask=None):
    return _why_not(q, k, v, drop, mask)


def _bwd_supports(dout, q, k, v, out, lse, *, causal, scale, drop=None, mask=None):
    return _why_not(q, k, v, drop, mask) or check(dout, out) or check(lse, dtypes=None)


@register("attention_block_forward", NAME, available=available, backends=GPU_BACKENDS, supports=_fwd_supports)
def block_forward(q, k, v, *, causal: bool, scale: float, drop=None, mask=None):
    """Triton flash block with fused hash dropout (see the module); ``mask`` is always None here."""
    return flash_forward(q, k, v, causal=causal, scale=scale, drop=drop)


@register("attention_block_backward", NAME, available=available, backends=GPU_BACKENDS, supports=_bwd_supports)
def block_backward(dout, q, k, v, out, lse, *, causal: bool, scale: float, drop=None, mask=None):
    """Gradients of one block given the final output and log-sum-exp (see the module)."""
    return flash_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, drop=drop)
