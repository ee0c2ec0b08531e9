"""Softmax cross-entropy (vocabulary processed in chunks with an online max/sum, so no float32
copy of the logits exists) and scaled masked / causal softmax, in Triton."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from omnitron.kernels.reference.cross_entropy_shard import whole_vocab_cross_entropy
from omnitron.kernels.registry import register
from omnitron.kernels.triton_kernels._common import (GPU_BACKENDS, NAME, as_rows, available, block_rows, check,
                                                     interpreting)

MAX_SOFTMAX_COLS = 16384  # one row per tile: wider rows would spill registers on a GPU


@triton.jit
def _ce_stats(X, TGT, STATS, n_rows, V, start, valid, BM: tl.constexpr, BV: tl.constexpr):
    """Per row over the valid columns: max, sum exp(x - max), target logit (0 if elsewhere), sum x."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < n_rows
    m = tl.full([BM], float("-inf"), tl.float32)
    s = tl.zeros([BM], tl.float32)
    sx = tl.zeros([BM], tl.float32)
    for c0 in range(0, valid, BV):
        cols = c0 + tl.arange(0, BV)
        m2 = rmask[:, None] & (cols < valid)[None, :]
        x = tl.load(X + rows[:, None].to(tl.int64) * V + cols[None, :], mask=m2, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(x - m_ref[:, None]), axis=1)
        sx += tl.sum(tl.where(m2, x, 0.0), axis=1)
        m = m_new
    t = tl.load(TGT + rows, mask=rmask, other=0) - start
    inside = rmask & (t >= 0) & (t < valid)
    xt = tl.load(X + rows.to(tl.int64) * V + tl.where(inside, t, 0), mask=inside, other=0.0).to(tl.float32)
    tl.store(STATS + rows, tl.where(m == float("-inf"), 0.0, m), mask=rmask)
    tl.store(STATS + n_rows + rows, s, mask=rmask)
    tl.store(STATS + 2 * n_rows + rows, xt, mask=rmask)
    tl.store(STATS + 3 * n_rows + rows, sx, mask=rmask)


@triton.jit
def _ce_grad(DL, X, TGT, LSE, DX, n_rows, V, start, valid, vocab, ls, BM: tl.constexpr, BV: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BV + tl.arange(0, BV)
    rmask = rows < n_rows
    m2 = rmask[:, None] & (cols < V)[None, :]
    offs = rows[:, None].to(tl.int64) * V + cols[None, :]
    x = tl.load(X + offs, mask=m2, other=0.0).to(tl.float32)
    g = tl.load(DL + rows, mask=rmask, other=0.0)
    lse = tl.load(LSE + rows, mask=rmask, other=0.0)
    t = tl.load(TGT + rows, mask=rmask, other=-1) - start
    onehot = tl.where(cols[None, :] == t[:, None], 1.0 - ls, 0.0)
    dx = g[:, None] * (tl.exp(x - lse[:, None]) - ls / vocab - onehot)
    dx = tl.where((cols < valid)[None, :], dx, 0.0)  # padding columns
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=m2)


def _ce_tiles(n, v):
    bv = min(triton.next_power_of_2(max(v, 1)), 1 << 14 if interpreting() else 2048)
    return block_rows(bv), bv


def _stats(x2, t, start, valid, vocab):
    n, v = x2.shape
    if n and (int(t.min()) < 0 or int(t.max()) >= vocab):
        raise IndexError(f"cross-entropy targets must lie in [0, {vocab}); got [{int(t.min())}, {int(t.max())}]")
    stats = torch.empty(4, n, dtype=torch.float32, device=x2.device)
    bm, bv = _ce_tiles(n, v)
    if n:
        _ce_stats[(triton.cdiv(n, bm),)](x2, t, stats, n, v, start, valid, BM=bm, BV=bv)
    return stats


def _grad(dloss, x2, t, lse, start, valid, vocab, ls, out=None):
    n, v = x2.shape
    dx = torch.empty_like(x2) if out is None else out  # out may be x2 itself: each tile is read, then written
    bm, bv = _ce_tiles(n, v)
    if n and v:
        _ce_grad[(triton.cdiv(n, bm), triton.cdiv(v, bv))](dloss, x2, t, lse, dx, n, v, start, valid, vocab, ls,
                                                           BM=bm, BV=bv)
    return dx


_CROSS_ENTROPY = whole_vocab_cross_entropy(_stats, _grad)


def _ce_supports(logits, target, label_smoothing=0.0) -> str | None:
    why = check(logits) or check(target, dtypes=None)
    if why:
        return why
    if target.dtype.is_floating_point:
        return f"target dtype {target.dtype}; class indices must be integers"
    if logits.dim() == 0 or tuple(target.shape) != tuple(logits.shape[:-1]):
        return f"target shape {tuple(target.shape)} does not match logits[..., V] {tuple(logits.shape)}"
    return None


@register("softmax_cross_entropy", NAME, available=available, backends=GPU_BACKENDS, supports=_ce_supports)
def softmax_cross_entropy(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Triton per-token cross-entropy (float32 loss), vocabulary in chunks."""
    return _CROSS_ENTROPY(logits, target, label_smoothing)


@register("cross_entropy_shard_stats", NAME, available=available, backends=GPU_BACKENDS,
          supports=lambda logits, target, start, valid, vocab: _ce_supports(logits, target))
def cross_entropy_shard_stats(logits, target, start: int, valid: int, vocab: int) -> torch.Tensor:
    """Shard statistics ``[4, ...]`` (see the reference), vocabulary read in chunks."""
    stats = _stats(as_rows(logits), target.reshape(-1).long().contiguous(), int(start), int(valid), int(vocab))
    return stats.view(4, *logits.shape[:-1])


@register("cross_entropy_shard_grad", NAME, available=available, backends=GPU_BACKENDS,
          supports=lambda dloss, logits, target, lse, *a, **k: _ce_supports(logits, target))
def cross_entropy_shard_grad(dloss, logits, target, lse, start: int, valid: int, vocab: int,
                             label_smoothing: float = 0.0, out: torch.Tensor | None = None) -> torch.Tensor:
    """d loss / d logits for a shard (see the reference), in the logits' dtype, into ``out`` where given
    (contiguous; it may be ``logits`` itself)."""
    x2 = as_rows(logits)
    dx = _grad(dloss.reshape(-1).float().contiguous(), x2, target.reshape(-1).long().contiguous(),
               lse.reshape(-1).float().contiguous(), int(start), int(valid), int(vocab), float(label_smoothing),
               None if out is None else out.view(x2.shape))
    return dx.view(logits.shape)


@triton.jit
def _softmax_fwd(X, MASK, Y, n_rows, sq, sk, H, scale, m_sb, m_sh, m_sq, m_sk,
                 CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.arange(0, BN)
    rmask = rows < n_rows
    m2 = rmask[:, None] & (cols < sk)[None, :]
    offs = rows[:, None] * sk + cols[None, :]
    x = tl.load(X + offs, mask=m2, other=float("-inf")).to(tl.float32) * scale
    keep = m2
    qi = rows % sq
    if CAUSAL:
        keep = keep & (cols[None, :] <= (qi + sk - sq)[:, None])
    if HAS_MASK:
        bh = rows // sq
        mo = (bh // H) * m_sb + (bh % H) * m_sh + qi * m_sq
        masked = tl.load(MASK + mo[:, None] + cols[None, :] * m_sk, mask=m2, other=1)
        keep = keep & (masked == 0)
    x = tl.where(keep, x, float("-inf"))
    mx = tl.max(x, axis=1)
    e = tl.exp(x - mx[:, None])
    y = e / tl.sum(e, axis=1)[:, None]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=m2)


@triton.jit
def _softmax_bwd(DY, Y, DX, n_rows, sk, scale, BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.arange(0, BN)
    m2 = (rows < n_rows)[:, None] & (cols < sk)[None, :]
    offs = rows[:, None] * sk + cols[None, :]
    y = tl.load(Y + offs, mask=m2, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=m2, other=0.0).to(tl.float32)
    dx = scale * y * (dy - tl.sum(dy * y, axis=1)[:, None])
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=m2)


class _ScaledSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, mask, causal):
        x4 = x.contiguous()
        b, h, sq, sk = x4.shape
        y = torch.empty_like(x4)
        n = b * h * sq
        bn = triton.next_power_of_2(sk)
        bm = block_rows(bn)
        if mask is not None:
            mk = mask.expand(b, h, sq, sk).view(torch.uint8) if mask.dtype == torch.bool else mask.expand(b, h, sq, sk)
            strides = mk.stride()
        else:
            mk, strides = x4, (0, 0, 0, 0)
        _softmax_fwd[(triton.cdiv(n, bm),)](x4, mk, y, n, sq, sk, h, float(scale), *strides, CAUSAL=bool(causal),
                                            HAS_MASK=mask is not None, BM=bm, BN=bn)
        ctx.save_for_backward(y)
        ctx.scale = float(scale)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        sk = y.shape[-1]
        dx = torch.empty_like(y)
        bn = triton.next_power_of_2(sk)
        bm = block_rows(bn)
        n = y.numel() // sk
        _softmax_bwd[(triton.cdiv(n, bm),)](dy.contiguous(), y, dx, n, sk, ctx.scale, BM=bm, BN=bn)
        return dx, None, None, None


def _softmax_supports(x, scale=1.0, mask=None, causal=False) -> str | None:
    why = check(x) or check(mask, dtypes=(torch.bool,))
    if why:
        return why
    if x.dim() != 4:
        return f"x has {x.dim()} dims; the Triton softmax takes [b, h, sq, sk]"
    if x.shape[-1] > MAX_SOFTMAX_COLS:
        return f"sk {x.shape[-1]} > {MAX_SOFTMAX_COLS}"
    if mask is not None:
        try:
            if torch.broadcast_shapes(mask.shape, x.shape) != x.shape:
                return "mask would broadcast x to a larger shape"
        except RuntimeError:
            return f"mask {tuple(mask.shape)} does not broadcast to x {tuple(x.shape)}"
    return None


@register("scaled_softmax", NAME, available=available, backends=GPU_BACKENDS, supports=_softmax_supports)
def scaled_softmax(x: torch.Tensor, scale: float = 1.0, mask: torch.Tensor | None = None,
                   causal: bool = False) -> torch.Tensor:
    """Triton scaled masked / causal softmax over the last dim of ``[b, h, sq, sk]``."""
    return _ScaledSoftmax.apply(x, scale, mask, causal)
