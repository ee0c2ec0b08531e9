"""FP8 cast + transpose in Triton: one read of ``x`` writes the scaled FP8 copy and its transpose
(for the weight-gradient GEMM), plus either per-tile amax partials (``fp8_cast_transpose_amax``,
delayed scaling) or, from an amax already reduced, the scale and its reciprocal computed in the
kernel itself (``fp8_cast_transpose_from_amax``, current scaling: no separate scale arithmetic).

The float -> FP8 rounding (round-to-nearest-even, saturating to the format's max) is written with
integer bit operations and stored as bytes, so results are identical on every GPU and under the
interpreter (whose own float8 casts are not exact).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from omnitron.kernels.reference.fp8 import fp8_cast_transpose_from_amax as reference_from_amax
from omnitron.kernels.registry import register
from omnitron.kernels.triton_kernels._common import GPU_BACKENDS, NAME, available, check, interpreting

GRAPH_NAME = "triton_graph"
"""The same kernels, also usable inside a compiled graph (:func:`_as_graph_op`). Not in any backend's default
preference: under ``--torch-compile`` the reference, lowered by inductor, stays the default (measured: FP8 1.09x
bf16 at 1.3B on an H200, 2026-12-04) until this path is measured against it. Opt in with
``OMNITRON_KERNELS=fp8_cast_transpose_from_amax=triton_graph,fp8_cast_transpose_amax=triton_graph``."""

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
def _cast_transpose(X, SCALE, Q, QT, AMAX, SCALE_INV, M, N, LIMIT: tl.constexpr, SHIFT: tl.constexpr,
                    HALF_M1: tl.constexpr, REBIAS: tl.constexpr, SUB_SCALE: tl.constexpr, MIN_NORMAL: tl.constexpr,
                    TARGET: tl.constexpr, FROM_AMAX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    pm, pn = tl.program_id(0), tl.program_id(1)
    rows = pm * BM + tl.arange(0, BM)
    cols = pn * BN + tl.arange(0, BN)
    m2 = (rows < M)[:, None] & (cols < N)[None, :]
    x = tl.load(X + rows[:, None] * N + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    if FROM_AMAX:  # SCALE holds the reduced amax: scale_from_amax's rule, IEEE-rounded like the reference
        amax = tl.load(SCALE)
        ok = (amax > 0.0) & (amax < float("inf"))
        scale = tl.minimum(tl.math.div_rn(TARGET, tl.where(ok, amax, 1.0)), 3.4028234663852886e38)  # float32 max
        scale = tl.where(ok, scale, 1.0)
        if (pm == 0) & (pn == 0):
            tl.store(SCALE_INV, tl.math.div_rn(1.0, scale))
    else:
        scale = tl.load(SCALE)
    code = _to_fp8_bits(x * scale, LIMIT, SHIFT, HALF_M1, REBIAS, SUB_SCALE, MIN_NORMAL)
    tl.store(Q + rows[:, None] * N + cols[None, :], code, mask=m2)
    # transposed tile stored row by row of QT (consecutive rows of x are consecutive bytes there):
    # tl.trans moves the tile through shared memory so these stores coalesce
    tl.store(QT + cols[:, None] * M + rows[None, :], tl.trans(code), mask=tl.trans(m2))
    if not FROM_AMAX:
        ax = tl.abs(x)
        has_nan = tl.max(tl.max(tl.where(ax != ax, 1, 0), axis=1), axis=0)
        mx = tl.max(tl.max(tl.where(ax != ax, 0.0, ax), axis=1), axis=0)
        tl.store(AMAX + pm * tl.num_programs(1) + pn, tl.where(has_nan > 0, float("nan"), mx))  # NaN propagates


def _supports(x, scale, fmt="e4m3", margin=0) -> str | None:
    why = check(x) or check(scale, dtypes=(torch.float32,))
    if why:
        return why
    if fmt not in FORMATS:
        return f"unknown FP8 format {fmt!r}; use one of {sorted(FORMATS)}"
    if x.dim() != 2:
        return f"x has {x.dim()} dims; cast-transpose takes a 2-D [m, n] tensor"
    if scale.numel() != 1:
        return "scale (or amax) must be a single (per-tensor) value"
    return None


def _from_amax_supports(x, amax, fmt="e4m3", margin=0) -> str | None:
    """:func:`_supports` under the from-amax op's parameter names (the registry checks them against its reference)."""
    return _supports(x, amax, fmt, margin)


@register("fp8_cast_transpose_amax", NAME, available=available, backends=GPU_BACKENDS, supports=_supports)
def fp8_cast_transpose_amax(x: torch.Tensor, scale: torch.Tensor, fmt: str = "e4m3"):
    """(``x * scale`` in FP8 ``[m, n]``, the same values transposed ``[n, m]``, amax of ``|x|`` float32 scalar)."""
    q, qt, part = _launch(x, scale.reshape(1).float(), fmt, from_amax=False)
    amax = part.max() if part.numel() else torch.zeros((), dtype=torch.float32, device=x.device)
    return q, qt, amax


@register("fp8_cast_transpose_from_amax", NAME, available=available, backends=GPU_BACKENDS,
          supports=_from_amax_supports)
def fp8_cast_transpose_from_amax(x: torch.Tensor, amax: torch.Tensor, fmt: str = "e4m3", margin: int = 0):
    """(FP8 ``x * scale``, its transpose, ``1 / scale``) with ``scale`` derived from ``amax`` inside the kernel."""
    if not x.numel():  # nothing to launch over; the scale still follows the (group-reduced) amax
        return reference_from_amax(x, amax, fmt, margin)
    return _launch(x, amax.float(), fmt, from_amax=True, margin=margin)  # any 1-element tensor: the kernel loads [0]


def _as_graph_op(name: str, eager, schema: str) -> None:
    """``omnitron::<name>``: the eager cast-transpose as one opaque operator of a compiled graph (what the
    ``triton_graph`` implementations below call; ``triton`` stays the plain launch).

    Why: inductor cannot see into a user Triton launch, so the dispatcher hands a compiling caller the plain-torch
    reference, which inductor lowers to a pointwise kernel whose transposed store is strided; this kernel reads a
    64x64 tile once and writes both layouts through shared memory. The fake implementation gives the outputs'
    shapes and dtypes (``[m, n]`` and ``[n, m]`` FP8, a float32 scalar) for tracing; outputs are fresh tensors (no
    aliasing), so autograd and functionalization need nothing more."""
    def fake(x, other, fmt, *rest):
        dtype = FORMATS[fmt][0]
        m, n = x.shape
        return (x.new_empty((m, n), dtype=dtype), x.new_empty((n, m), dtype=dtype),
                x.new_empty((), dtype=torch.float32))

    torch.library.custom_op(f"omnitron::{name}", eager, mutates_args=(), schema=schema).register_fake(fake)


_as_graph_op("fp8_cast_transpose_amax", fp8_cast_transpose_amax,
             "(Tensor x, Tensor scale, str fmt) -> (Tensor, Tensor, Tensor)")
_as_graph_op("fp8_cast_transpose_from_amax", fp8_cast_transpose_from_amax,
             "(Tensor x, Tensor amax, str fmt, int margin) -> (Tensor, Tensor, Tensor)")


@register("fp8_cast_transpose_amax", GRAPH_NAME, available=available, backends=GPU_BACKENDS, supports=_supports,
          traceable=True)
def graph_cast_transpose_amax(x: torch.Tensor, scale: torch.Tensor, fmt: str = "e4m3"):
    """:func:`fp8_cast_transpose_amax` as the graph op ``omnitron::fp8_cast_transpose_amax``."""
    return torch.ops.omnitron.fp8_cast_transpose_amax(x, scale, fmt)


@register("fp8_cast_transpose_from_amax", GRAPH_NAME, available=available, backends=GPU_BACKENDS,
          supports=_from_amax_supports, traceable=True)
def graph_cast_transpose_from_amax(x: torch.Tensor, amax: torch.Tensor, fmt: str = "e4m3", margin: int = 0):
    """:func:`fp8_cast_transpose_from_amax` as the graph op ``omnitron::fp8_cast_transpose_from_amax``."""
    return torch.ops.omnitron.fp8_cast_transpose_from_amax(x, amax, fmt, margin)


@functools.lru_cache(maxsize=None)
def _constants(fmt: str, from_amax: bool, margin: int) -> dict:
    """The cast kernel's compile-time arguments for one format, mode and margin (derived once, not per launch)."""
    _, mant, bias, limit = FORMATS[fmt]
    shift = 23 - mant
    return dict(LIMIT=limit, SHIFT=shift, HALF_M1=(1 << (shift - 1)) - 1, REBIAS=(127 - bias) << mant,
                SUB_SCALE=float(2.0 ** (bias - 1 + mant)), MIN_NORMAL=float(2.0 ** (1 - bias)),
                TARGET=limit / 2.0 ** margin, FROM_AMAX=from_amax)


def _launch(x: torch.Tensor, scale_or_amax: torch.Tensor, fmt: str, *, from_amax: bool, margin: int = 0):
    """One kernel launch; returns (q, q_t, amax partials) or, ``from_amax``, (q, q_t, scale_inv)."""
    dtype = FORMATS[fmt][0]
    x = x.contiguous()
    m, n = x.shape
    q = torch.empty(m, n, dtype=dtype, device=x.device)  # the kernel stores bytes through uint8 views of these
    qt = torch.empty(n, m, dtype=dtype, device=x.device)
    bm = bn = 64  # 4K elements per program: 4 KiB of FP8 per store side
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    if from_amax:
        extra = torch.empty((), dtype=torch.float32, device=x.device)
    else:
        extra = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=x.device)
    if m and n:
        _cast_transpose[grid](x, scale_or_amax, q.view(torch.uint8), qt.view(torch.uint8), extra, extra, m, n,
                              **_constants(fmt, from_amax, margin), BM=bm, BN=bn)
    return q, qt, extra


@triton.jit
def _history_push(HIST, AMAX, SCALE, NEW_HIST, NEW_SCALE, NEW_SCALE_INV, L, TARGET: tl.constexpr,
                  MOST_RECENT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    amax = tl.load(AMAX)
    prev = tl.load(HIST + i - 1, mask=(i >= 1) & (i < L), other=0.0)
    hist = tl.where(i == 0, amax, prev)
    tl.store(NEW_HIST + i, hist, mask=i < L)
    if MOST_RECENT:
        summary = amax
    else:
        has_nan = tl.max(tl.where((hist != hist) & (i < L), 1, 0), axis=0)
        summary = tl.where(has_nan > 0, float("nan"), tl.max(tl.where(i < L, hist, 0.0), axis=0))
    ok = (summary > 0.0) & (summary < float("inf"))  # False for NaN
    # scale_from_amax's rule: one IEEE-rounded division, clipped to the float32 max (the reference's)
    scale = tl.minimum(tl.math.div_rn(TARGET, tl.where(ok, summary, 1.0)), 3.4028234663852886e38)
    scale = tl.where(ok, scale, tl.load(SCALE))
    tl.store(NEW_SCALE, scale)
    tl.store(NEW_SCALE_INV, tl.math.div_rn(1.0, scale))


def _push_supports(history, amax, scale, fmt="e4m3", margin=0, algo="max") -> str | None:
    why = check(history, amax, scale, dtypes=(torch.float32,))
    if why:
        return why
    if fmt not in FORMATS or algo not in ("max", "most_recent"):
        return f"format {fmt!r} / algorithm {algo!r} not handled here"
    if history.dim() != 1 or not history.is_contiguous() or amax.numel() != 1 or scale.numel() != 1:
        return "history must be a contiguous 1-D tensor, amax and scale single values"
    return None


@register("fp8_amax_history_push", NAME, available=available, backends=GPU_BACKENDS, supports=_push_supports)
def fp8_amax_history_push(history: torch.Tensor, amax: torch.Tensor, scale: torch.Tensor, fmt: str = "e4m3",
                          margin: int = 0, algo: str = "max"):
    """The delayed-scaling update (roll, insert, summarise, rescale, reciprocal) in one launch."""
    new_hist = torch.empty_like(history)
    new_scale = torch.empty((), dtype=torch.float32, device=history.device)
    new_inv = torch.empty((), dtype=torch.float32, device=history.device)
    _history_push[(1,)](history, amax, scale, new_hist, new_scale, new_inv, history.numel(),
                        TARGET=FORMATS[fmt][3] / 2.0 ** margin, MOST_RECENT=algo == "most_recent",
                        BLOCK=triton.next_power_of_2(max(history.numel(), 1)))
    return new_hist, new_scale, new_inv
