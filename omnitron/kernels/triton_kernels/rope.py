"""Rotary position embedding in Triton for ``[s, b, h, d]`` and ``[b, s, h, d]`` (interleaved or
rotate-half, partial rotary). cos/sin are float32 views expanded to ``[A, B, H, r/2]`` (broadcast
dims have stride 0); the backward is the same kernel rotating by the negative angle."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from omnitron.kernels.reference.rope import rope_call_problem
from omnitron.kernels.registry import register
from omnitron.kernels.triton_kernels._common import GPU_BACKENDS, NAME, available, block_rows, check


@triton.jit
def _rope(T, C, S, Y, n_rows, B, H, d, half, sa, sb, sh, sign,
          INTERLEAVED: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < n_rows
    # row -> (a, b, h) for the broadcast cos/sin offsets
    hh = rows % H
    bb = (rows // H) % B
    aa = rows // (H * B)
    fo = aa * sa + bb * sb + hh * sh
    j = tl.arange(0, BH)
    m2 = rmask[:, None] & (j < half)[None, :]
    c = tl.load(C + fo[:, None] + j[None, :], mask=m2, other=0.0)
    s = tl.load(S + fo[:, None] + j[None, :], mask=m2, other=0.0) * sign
    base = rows[:, None] * d
    if INTERLEAVED:
        i1, i2 = 2 * j, 2 * j + 1
    else:
        i1, i2 = j, j + half
    x1 = tl.load(T + base + i1[None, :], mask=m2, other=0.0).to(tl.float32)
    x2 = tl.load(T + base + i2[None, :], mask=m2, other=0.0).to(tl.float32)
    tl.store(Y + base + i1[None, :], (x1 * c - x2 * s).to(Y.dtype.element_ty), mask=m2)
    tl.store(Y + base + i2[None, :], (x2 * c + x1 * s).to(Y.dtype.element_ty), mask=m2)
    k = tl.arange(0, BD)
    mp = rmask[:, None] & ((k >= 2 * half) & (k < d))[None, :]
    tl.store(Y + base + k[None, :], tl.load(T + base + k[None, :], mask=mp, other=0.0), mask=mp)


def _apply(t, cos, sin, interleaved, sign):
    t = t.contiguous()
    a, b, h, d = t.shape
    half = cos.shape[-1]
    y = torch.empty_like(t)
    n = a * b * h
    bh, bd = triton.next_power_of_2(max(half, 1)), triton.next_power_of_2(d)
    bm = block_rows(bd)
    _rope[(triton.cdiv(n, bm),)](t, cos, sin, y, n, b, h, d, half, cos.stride(0), cos.stride(1), cos.stride(2),
                                 float(sign), INTERLEAVED=interleaved, BM=bm, BH=bh, BD=bd)
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, freqs, interleaved):
        shape = (*t.shape[:3], freqs.shape[-1])
        cos = freqs.float().cos().expand(shape)
        sin = freqs.float().sin().expand(shape)
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return _apply(t, cos, sin, interleaved, 1.0)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _apply(dy, cos, sin, ctx.interleaved, -1.0), None, None


def _supports(t, freqs, interleaved=False) -> str | None:
    return check(t) or check(freqs, dtypes=None) or rope_call_problem(t, freqs, "Triton")


@register("rope", NAME, available=available, backends=GPU_BACKENDS, supports=_supports)
def rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Triton rotary embedding (see the reference)."""
    return _Rope.apply(t, freqs, interleaved)
