"""Gated activations (SwiGLU, GeGLU) and bias + GeLU in Triton; the backward recomputes the
activation from the input rather than saving it."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from omnitron.kernels.registry import register
from omnitron.kernels.triton_kernels._common import GPU_BACKENDS, NAME, as_rows, available, block_rows, check

K0 = 0.7978845608028654  # sqrt(2 / pi)
K1 = 0.044715


@triton.jit
def _act(a, KIND: tl.constexpr):
    """(act(a), d act / da) in float32; KIND 0 = silu, 1 = tanh-gelu written as a * sigmoid(2u)."""
    if KIND == 0:
        s = 1.0 / (1.0 + tl.exp(-a))
        return a * s, s * (1.0 + a * (1.0 - s))
    else:
        u2 = 2.0 * 0.7978845608028654 * (a + 0.044715 * a * a * a)
        s = 1.0 / (1.0 + tl.exp(-u2))
        return a * s, s + a * s * (1.0 - s) * 2.0 * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * a * a)


@triton.jit
def _glu_fwd(X, Y, n_rows, f, KIND: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    m2 = (rows < n_rows)[:, None] & (cols < f)[None, :]
    xa = X + rows[:, None] * (2 * f) + cols[None, :]
    a = tl.load(xa, mask=m2, other=0.0).to(tl.float32)
    b = tl.load(xa + f, mask=m2, other=0.0).to(tl.float32)
    v, _ = _act(a, KIND)
    tl.store(Y + rows[:, None] * f + cols[None, :], (v * b).to(Y.dtype.element_ty), mask=m2)


@triton.jit
def _glu_bwd(DY, X, DX, n_rows, f, KIND: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    m2 = (rows < n_rows)[:, None] & (cols < f)[None, :]
    offs = rows[:, None] * (2 * f) + cols[None, :]
    a = tl.load(X + offs, mask=m2, other=0.0).to(tl.float32)
    b = tl.load(X + offs + f, mask=m2, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows[:, None] * f + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    v, dv = _act(a, KIND)
    tl.store(DX + offs, (dy * b * dv).to(DX.dtype.element_ty), mask=m2)
    tl.store(DX + offs + f, (dy * v).to(DX.dtype.element_ty), mask=m2)


@triton.jit
def _gelu_fwd(X, B, Y, n_rows, n_cols, BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    cmask = cols < n_cols
    m2 = (rows < n_rows)[:, None] & cmask[None, :]
    offs = rows[:, None] * n_cols + cols[None, :]
    a = (tl.load(X + offs, mask=m2, other=0.0).to(tl.float32)
         + tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :])
    v, _ = _act(a, 1)
    tl.store(Y + offs, v.to(Y.dtype.element_ty), mask=m2)


@triton.jit
def _gelu_bwd(DY, X, B, DX, n_rows, n_cols, BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    cmask = cols < n_cols
    m2 = (rows < n_rows)[:, None] & cmask[None, :]
    offs = rows[:, None] * n_cols + cols[None, :]
    a = (tl.load(X + offs, mask=m2, other=0.0).to(tl.float32)
         + tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :])
    _, dv = _act(a, 1)
    dx = tl.load(DY + offs, mask=m2, other=0.0).to(tl.float32) * dv
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=m2)


def _tiles(n_rows, n_cols):
    bn = min(1024, triton.next_power_of_2(n_cols))
    bm = block_rows(bn)
    return bm, bn, (triton.cdiv(n_rows, bm), triton.cdiv(n_cols, bn))


class _GLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kind):
        x2 = as_rows(x)
        n, f = x2.shape[0], x2.shape[1] // 2
        y = torch.empty(n, f, dtype=x.dtype, device=x.device)
        bm, bn, grid = _tiles(n, f)
        _glu_fwd[grid](x2, y, n, f, KIND=kind, BM=bm, BN=bn)
        ctx.save_for_backward(x2)
        ctx.kind = kind
        return y.view(*x.shape[:-1], f)

    @staticmethod
    def backward(ctx, dy):
        (x2,) = ctx.saved_tensors
        n, f = x2.shape[0], x2.shape[1] // 2
        dx = torch.empty_like(x2)
        bm, bn, grid = _tiles(n, f)
        _glu_bwd[grid](as_rows(dy), x2, dx, n, f, KIND=ctx.kind, BM=bm, BN=bn)
        return dx.view(*dy.shape[:-1], 2 * f), None


def _glu_supports(x, bias=None, approximate="tanh") -> str | None:
    why = check(x, bias)
    if why:
        return why
    if x.dim() == 0 or x.shape[-1] % 2:
        return "last dim must be even ([a | b] halves)"
    if approximate != "tanh":
        return f"approximate={approximate!r}; the Triton kernels implement the tanh form only"
    return None


@register("swiglu", NAME, available=available, backends=GPU_BACKENDS,
          supports=lambda x, bias=None: _glu_supports(x, bias))
def swiglu(x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton SwiGLU; a bias is added first (by torch)."""
    return _GLU.apply(x if bias is None else x + bias, 0)


@register("geglu", NAME, available=available, backends=GPU_BACKENDS, supports=_glu_supports)
def geglu(x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "tanh") -> torch.Tensor:
    """Triton GeGLU (tanh form); a bias is added first (by torch)."""
    return _GLU.apply(x if bias is None else x + bias, 1)


class _BiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        x2, b = as_rows(x), bias.contiguous()
        y = torch.empty_like(x2)
        bm, bn, grid = _tiles(*x2.shape)
        _gelu_fwd[grid](x2, b, y, x2.shape[0], x2.shape[1], BM=bm, BN=bn)
        ctx.save_for_backward(x2, b)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, b = ctx.saved_tensors
        dx = torch.empty_like(x2)
        bm, bn, grid = _tiles(*x2.shape)
        _gelu_bwd[grid](as_rows(dy), x2, b, dx, x2.shape[0], x2.shape[1], BM=bm, BN=bn)
        # bias grad: column sums of dx as stored (what autograd of the unfused op computes)
        return dx.view(dy.shape), dx.sum(0, dtype=torch.float32).to(b.dtype)


def _gelu_supports(x, bias=None, approximate="tanh") -> str | None:
    why = check(x, bias)
    if why:
        return why
    if bias is None or bias.dim() != 1 or x.dim() == 0 or bias.shape[0] != x.shape[-1]:
        return "needs a 1-D bias over x's last dim (without one, use torch's gelu)"
    if approximate != "tanh":
        return f"approximate={approximate!r}; the Triton kernel implements the tanh form only"
    return None


@register("bias_gelu", NAME, available=available, backends=GPU_BACKENDS, supports=_gelu_supports)
def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "tanh") -> torch.Tensor:
    """Triton fused ``gelu_tanh(x + bias)``."""
    return _BiasGelu.apply(x, bias)
