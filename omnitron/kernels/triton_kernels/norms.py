"""RMSNorm and LayerNorm in Triton: a tile of rows per program, float32 statistics kept for the
backward, weight/bias gradients as per-program partial sums reduced by one torch ``sum``."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from omnitron.kernels.registry import register
from omnitron.kernels.triton_kernels._common import (GPU_BACKENDS, NAME, as_rows, available, block_rows, check,
                                                     interpreting)

MAX_COLS = 16384  # one row per tile: wider rows would spill registers on a GPU


@triton.jit
def _norm_fwd(X, R, H, W, B, Y, MEAN, RSTD, n_rows, n_cols, eps,
              RMS: tl.constexpr, HAS_B: tl.constexpr, HAS_R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.arange(0, BN)
    rmask, cmask = rows < n_rows, cols < n_cols
    m2 = rmask[:, None] & cmask[None, :]
    offs = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(X + offs, mask=m2, other=0.0).to(tl.float32)
    if HAS_R:  # h = x + residual, rounded to the storage dtype as the unfused reference does
        h = (x + tl.load(R + offs, mask=m2, other=0.0).to(tl.float32)).to(H.dtype.element_ty)
        tl.store(H + offs, h, mask=m2)
        x = h.to(tl.float32)
    if RMS:
        mean = tl.zeros([BM], dtype=tl.float32)
        xc = x
    else:
        mean = tl.sum(x, axis=1) / n_cols
        xc = tl.where(m2, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_B:
        y += tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=m2)
    tl.store(MEAN + rows, mean, mask=rmask)
    tl.store(RSTD + rows, rstd, mask=rmask)


@triton.jit
def _norm_bwd(DY, X, W, MEAN, RSTD, DRES, DX, DW, DB, n_rows, n_cols, rows_per_prog,
              RMS: tl.constexpr, HAS_DRES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Each program walks ``rows_per_prog`` rows in tiles of BM, keeping its weight/bias gradient
    partials in registers; one ``[programs, n_cols]`` partial per program is written at the end."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BN)
    cmask = cols < n_cols
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BN], tl.float32)
    db = tl.zeros([BN], tl.float32)
    first = pid * rows_per_prog
    for r0 in range(first, tl.minimum(first + rows_per_prog, n_rows), BM):
        rows = r0 + tl.arange(0, BM)
        rmask = rows < tl.minimum(first + rows_per_prog, n_rows)
        m2 = rmask[:, None] & cmask[None, :]
        offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
        x = tl.load(X + offs, mask=m2, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=m2, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=rmask, other=0.0)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        xhat = tl.where(m2, (x - mean[:, None]) * rstd[:, None], 0.0)
        g = dy * w[None, :]
        c1 = tl.sum(g * xhat, axis=1) / n_cols
        if RMS:
            dx = (g - xhat * c1[:, None]) * rstd[:, None]
        else:
            c2 = tl.sum(g, axis=1) / n_cols
            dx = (g - c2[:, None] - xhat * c1[:, None]) * rstd[:, None]
        if HAS_DRES:  # gradient reaching h directly through the residual stream
            dx += tl.load(DRES + offs, mask=m2, other=0.0).to(tl.float32)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=m2)
        dw += tl.sum(dy * xhat, axis=0)
        db += tl.sum(dy, axis=0)
    tl.store(DW + pid * n_cols + cols, dw, mask=cmask)
    tl.store(DB + pid * n_cols + cols, db, mask=cmask)


def _launch_fwd(x2, r2, weight, bias, eps, rms):
    n, d = x2.shape
    bn = triton.next_power_of_2(d)
    bm = block_rows(bn)
    y = torch.empty_like(x2)
    h = torch.empty_like(x2) if r2 is not None else None
    mean = torch.empty(n, dtype=torch.float32, device=x2.device)
    rstd = torch.empty_like(mean)
    _norm_fwd[(triton.cdiv(n, bm),)](x2, r2 if r2 is not None else x2, h if h is not None else y, weight,
                                      bias if bias is not None else weight, y, mean, rstd, n, d, eps, RMS=rms,
                                      HAS_B=bias is not None, HAS_R=r2 is not None, BM=bm, BN=bn)
    return y, mean, rstd, h


def _launch_bwd(dy2, x2, weight, mean, rstd, dres, rms):
    n, d = x2.shape
    bn = triton.next_power_of_2(d)
    bm = block_rows(bn)
    # enough programs to fill a GPU, few enough that the [programs, d] partials stay small; the
    # interpreter (sequential anyway) uses 2 so the tests walk the multi-tile loop
    programs = max(1, min(triton.cdiv(n, bm), 2 if interpreting() else 512))
    rows_per_prog = triton.cdiv(triton.cdiv(n, programs), bm) * bm
    programs = triton.cdiv(n, rows_per_prog) if n else 1
    dx = torch.empty_like(x2)
    dw = torch.zeros(programs, d, dtype=torch.float32, device=x2.device)
    db = torch.zeros_like(dw)
    if n:
        _norm_bwd[(programs,)](dy2, x2, weight, mean, rstd, dres if dres is not None else dy2, dx, dw, db, n, d,
                               rows_per_prog, RMS=rms, HAS_DRES=dres is not None, BM=bm, BN=bn)
    return dx, dw.sum(0), db.sum(0)


class _Norm(torch.autograd.Function):
    """RMSNorm or LayerNorm; with a residual returns ``(norm(h), h)``, ``h = x + residual``."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, rms):
        ctx.set_materialize_grads(False)
        x2 = as_rows(x)
        r2 = None if residual is None else as_rows(residual)
        w = weight.contiguous()
        b = None if bias is None else bias.contiguous()
        y, mean, rstd, h = _launch_fwd(x2, r2, w, b, float(eps), rms)
        ctx.save_for_backward(x2 if h is None else h, w, mean, rstd)
        ctx.rms, ctx.has_res = rms, residual is not None
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return (y.view(x.shape), h.view(x.shape)) if ctx.has_res else y.view(x.shape)

    @staticmethod
    def backward(ctx, dy, dh=None):
        src, w, mean, rstd = ctx.saved_tensors
        dy2 = torch.zeros_like(src) if dy is None else as_rows(dy)
        dres = None if dh is None else as_rows(dh)
        dx, dw, db = _launch_bwd(dy2, src, w, mean, rstd, dres, ctx.rms)
        db = db.to(ctx.dtypes[1]) if ctx.dtypes[1] is not None else None
        dx = dx.view((dy if dy is not None else dh).shape)
        return dx, (dx if ctx.has_res else None), dw.to(ctx.dtypes[0]), db, None, None


def _supports(x, weight, bias=None, eps=1e-5, residual=None) -> str | None:
    why = check(x, weight, bias, residual)
    if why:
        return why
    if x.dim() == 0 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        return "weight must be 1-D with x's last dim"
    if bias is not None and bias.shape != weight.shape:
        return "bias must match weight's shape"
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        return "residual must match x's shape and dtype"
    if x.shape[-1] > MAX_COLS:
        return f"last dim {x.shape[-1]} > {MAX_COLS} (one row per tile)"
    return None


@register("rms_norm", NAME, available=available, backends=GPU_BACKENDS,
          supports=lambda x, weight, eps=1e-5: _supports(x, weight))
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """Triton RMSNorm (see the reference)."""
    return _Norm.apply(x, None, weight, None, eps, True)


@register("layer_norm", NAME, available=available, backends=GPU_BACKENDS, supports=_supports)
def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5) -> torch.Tensor:
    """Triton LayerNorm (see the reference)."""
    return _Norm.apply(x, None, weight, bias, eps, False)


@register("add_rms_norm", NAME, available=available, backends=GPU_BACKENDS,
          supports=lambda x, residual, weight, eps=1e-5: _supports(x, weight, residual=residual))
def add_rms_norm(x, residual, weight, eps: float = 1e-5):
    """Triton ``h = x + residual; (rms_norm(h), h)`` in one pass."""
    return _Norm.apply(x, residual, weight, None, eps, True)


@register("add_layer_norm", NAME, available=available, backends=GPU_BACKENDS,
          supports=lambda x, residual, weight, bias, eps=1e-5: _supports(x, weight, bias, residual=residual))
def add_layer_norm(x, residual, weight, bias, eps: float = 1e-5):
    """Triton ``h = x + residual; (layer_norm(h), h)`` in one pass."""
    return _Norm.apply(x, residual, weight, bias, eps, False)
