"""FP8 cast + transpose + amax in Triton: one read of ``x`` writes the scaled FP8 copy, its
transpose (for the weight-gradient GEMM) and per-tile amax partials.

The float -> FP8 rounding (round-to-nearest-even, saturating to the format's max) is written with
integer bit operations and stored as bytes, so results are identical on every GPU and under the
interpreter (whose own float8 casts are not exact).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from omnitron.kernels.registry import register
from omnitron.kernels.triton_kernels._common import GPU_BACKENDS, NAME, available, check, interpreting

FORMATS = {"e4m3": (torch.float8_e4m3fn, 3, 7, 448.0), "e5m2": (torch.float8_e5m2, 2, 15, 57344.0)}


@triton.jit
def _to_fp8_bits(y, LIMIT: tl.constexpr, SHIFT: tl.constexpr, HALF_M1: tl.constexpr, REBIAS: tl.constexpr,
                 SUB_SCALE: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """uint8 codes of float32 ``y`` in an FP8 format, round-to-nearest-even, saturating at LIMIT.
    Normal numbers: round the float32 bits to the format's mantissa, re-bias the exponent.
    Subnormals: multiples of 1 / SUB_SCALE, rounded to even by the 2^23 magic-number trick."""
    y = tl.minimum(tl.maximum(y, -LIMIT), LIMIT)
    bits = y.to(tl.uint32, bitcast=True)
    sign = (bits >> 31) << 7
    a = bits & 0x7FFFFFFF
    normal = ((a + HALF_M1 + ((a >> SHIFT) & 1)) >> SHIFT) - REBIAS
    af = a.to(tl.float32, bitcast=True)
    sub = ((af * SUB_SCALE + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(af < MIN_NORMAL, sub, normal)
    code = tl.where(y != y, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def _cast_transpose(X, SCALE, Q, QT, AMAX, M, N, LIMIT: tl.constexpr, SHIFT: tl.constexpr, HALF_M1: tl.constexpr,
                    REBIAS: tl.constexpr, SUB_SCALE: tl.constexpr, MIN_NORMAL: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr):
    pm, pn = tl.program_id(0), tl.program_id(1)
    rows = pm * BM + tl.arange(0, BM)
    cols = pn * BN + tl.arange(0, BN)
    m2 = (rows < M)[:, None] & (cols < N)[None, :]
    x = tl.load(X + rows[:, None] * N + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    scale = tl.load(SCALE)
    code = _to_fp8_bits(x * scale, LIMIT, SHIFT, HALF_M1, REBIAS, SUB_SCALE, MIN_NORMAL)
    tl.store(Q + rows[:, None] * N + cols[None, :], code, mask=m2)
    # transposed tile stored row by row of QT (consecutive rows of x are consecutive bytes there):
    # tl.trans moves the tile through shared memory so these stores coalesce
    tl.store(QT + cols[:, None] * M + rows[None, :], tl.trans(code), mask=tl.trans(m2))
    ax = tl.abs(x)
    has_nan = tl.max(tl.max(tl.where(ax != ax, 1, 0), axis=1), axis=0)
    mx = tl.max(tl.max(tl.where(ax != ax, 0.0, ax), axis=1), axis=0)
    tl.store(AMAX + pm * tl.num_programs(1) + pn, tl.where(has_nan > 0, float("nan"), mx))  # NaN propagates


def _supports(x, scale, fmt="e4m3") -> str | None:
    why = check(x) or check(scale, dtypes=(torch.float32,))
    if why:
        return why
    if fmt not in FORMATS:
        return f"unknown FP8 format {fmt!r}; use one of {sorted(FORMATS)}"
    if x.dim() != 2:
        return f"x has {x.dim()} dims; cast-transpose takes a 2-D [m, n] tensor"
    if scale.numel() != 1:
        return "scale must be a single (per-tensor) value"
    return None


@register("fp8_cast_transpose_amax", NAME, available=available, backends=GPU_BACKENDS, supports=_supports)
def fp8_cast_transpose_amax(x: torch.Tensor, scale: torch.Tensor, fmt: str = "e4m3"):
    """(``x * scale`` in FP8 ``[m, n]``, the same values transposed ``[n, m]``, amax of ``|x|`` float32 scalar)."""
    dtype, mant, bias, limit = FORMATS[fmt]
    x = x.contiguous()
    m, n = x.shape
    q = torch.empty(m, n, dtype=torch.uint8, device=x.device)
    qt = torch.empty(n, m, dtype=torch.uint8, device=x.device)
    bm = bn = 64  # 4K elements per program: 4 KiB of FP8 per store side
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    part = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=x.device)
    if m and n:
        shift = 23 - mant
        _cast_transpose[grid](x, scale.reshape(1).float(), q, qt, part, m, n, LIMIT=limit, SHIFT=shift,
                              HALF_M1=(1 << (shift - 1)) - 1, REBIAS=(127 - bias) << mant,
                              SUB_SCALE=float(2.0 ** (bias - 1 + mant)), MIN_NORMAL=float(2.0 ** (1 - bias)),
                              BM=bm, BN=bn)
    amax = part.max() if part.numel() else torch.zeros((), dtype=torch.float32, device=x.device)
    return q.view(dtype), qt.view(dtype), amax
