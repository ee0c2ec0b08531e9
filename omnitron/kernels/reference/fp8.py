"""FP8 cast + transpose references (the quantisation step of an FP8 linear layer).

``fp8_cast_transpose_amax`` casts with a given scale and reports the amax (delayed scaling: the
amax feeds the next step's scale); ``fp8_cast_transpose_from_amax`` derives the scale from an amax
already known (current scaling: the amax was reduced over the tensor-parallel group first), so a
fused implementation turns the scale arithmetic and the reciprocal into part of the cast kernel.
"""
from __future__ import annotations

import math

import torch

from omnitron.kernels.registry import register

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def fp8_dtype(fmt: str) -> torch.dtype:
    """torch dtype for ``"e4m3"`` / ``"e5m2"``; a clear error otherwise."""
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown FP8 format {fmt!r}: use one of {sorted(FORMATS)}") from None


def scale_from_amax(amax: torch.Tensor, fmt: str, margin: int = 0,
                    previous: torch.Tensor | None = None, pow2: bool = False) -> torch.Tensor:
    """``FP8_MAX[fmt] / 2**margin / amax`` elementwise, float32: one correctly rounded division, as Transformer
    Engine (recipe_common.cuh ``compute_scale_from_amax``, ``__fdiv_rn``) and torchao compute it for every recipe
    (a reciprocal times the target, as computed here until 2026-12-07, is an ulp off for about a quarter of amaxes);
    where the quotient overflows (an amax below about 1e-36) the largest float32, as there (a scale of inf would turn
    zeros into NaN). Every recipe's scale comes from here: delayed, tensorwise, block-wise and FSDP2's.

    Where ``amax`` is zero or not finite the scale is ``previous`` (1 when None): an all-zero
    tensor needs no scaling, and an inf/nan amax must not poison the scale for later steps.
    A few small device ops and no host sync (this runs once per quantized tensor).
    ``pow2``: the scale rounded down to a power of two (:func:`pow2_scale`), as the block-wise recipe takes it.
    """
    if amax.dtype != torch.float32:  # (``.float()`` of a float32 tensor is itself, but still a call)
        amax = amax.float()
    target = FP8_MAX[fmt] / (2.0 ** margin)  # exact: a power of two apart from fp8_max
    ok = (amax > 0) & (amax < math.inf)  # False for nan too
    fresh = torch.div(target, amax)  # lanes where not ok are discarded below
    fresh = pow2_scale(fresh) if pow2 else fresh.clamp_(max=torch.finfo(torch.float32).max)
    return torch.where(ok, fresh, 1.0 if previous is None else previous.float())


def pow2_scale(scale: torch.Tensor) -> torch.Tensor:
    """Positive float32 ``scale`` rounded down to a power of two (its mantissa bits cleared; inf, from a tiny amax,
    first clipped to the largest float32): Transformer Engine's ``Float8BlockScaling`` scales, whose default
    (``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` unset) keeps only the exponent, so ``scale_inv`` is exact and
    ``amax * scale`` lies in ``(fp8_max / 2, fp8_max]``. The quotient rounded is ``fp8_max / amax``, one division as
    there (``reciprocal * target``, which torch's ``float / tensor`` also computes, can fall just below a power of
    two the quotient equals)."""
    finite = scale.clamp(max=torch.finfo(torch.float32).max)  # a new tensor: the mask goes in place
    return finite.view(torch.int32).bitwise_and_(0x7F800000).view(torch.float32)


def cast_to_fp8(x: torch.Tensor, fmt: str, scale: torch.Tensor, saturate: bool = False) -> torch.Tensor:
    """``fp8(x * scale)``: e4m3 saturates at +-448 (nan stays nan); e5m2 overflows to inf unless
    ``saturate`` (then it clips at +-57344 like e4m3, as Transformer Engine's satfinite casts do)."""
    y = x.float() * scale
    if fmt == "e4m3" or saturate:
        y = y.clamp(-FP8_MAX[fmt], FP8_MAX[fmt])  # clamp keeps nan, maps +-inf to +-max
    return y.to(fp8_dtype(fmt))


@register("fp8_cast_transpose_amax", "reference")
def fp8_cast_transpose_amax(x: torch.Tensor, scale: torch.Tensor, fmt: str = "e4m3"):
    """``(q, q_t, amax)``: ``q = saturate(x * scale)`` cast to FP8 ``fmt`` (round to nearest even),
    ``q_t = q.t()`` contiguous (the operand layout the weight/input-gradient GEMMs need), and
    ``amax = max |x|`` as a float32 scalar (NaN when ``x`` holds a NaN). ``x`` is 2-D ``[m, n]``;
    ``scale`` a float32 scalar tensor (per-tensor quantisation scale, not its reciprocal)."""
    q, qt = _cast_transpose(x, scale, fmt, "fp8_cast_transpose_amax")
    x = x.detach()
    # max |x| in one reduction (no |x| temporary); exact, and NaN propagates
    amax = torch.linalg.vector_norm(x, math.inf, dtype=torch.float32) if x.numel() else \
        torch.zeros((), dtype=torch.float32, device=x.device)
    return q, qt, amax


@register("fp8_cast_transpose_from_amax", "reference")
def fp8_cast_transpose_from_amax(x: torch.Tensor, amax: torch.Tensor, fmt: str = "e4m3", margin: int = 0):
    """``(q, q_t, scale_inv)`` under current scaling: ``scale = fp8_max / 2**margin / amax`` (1 where
    ``amax`` is 0, inf or nan, see :func:`scale_from_amax`), ``q`` and ``q_t`` as
    :func:`fp8_cast_transpose_amax` makes them with that scale, ``scale_inv = 1 / scale`` (float32
    scalar, the GEMM's dequantization factor). ``amax`` is a float32 scalar tensor."""
    scale = scale_from_amax(amax if amax.dim() == 0 else amax.reshape(()), fmt, margin)
    q, qt = _cast_transpose(x, scale, fmt, "fp8_cast_transpose_from_amax")
    return q, qt, scale.reciprocal()


def _cast_transpose(x: torch.Tensor, scale: torch.Tensor, fmt: str, op: str) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2:
        raise ValueError(f"{op} takes a 2-D [m, n] tensor, got shape {tuple(x.shape)}: "
                         "flatten leading dims first (x.reshape(-1, x.shape[-1]))")
    dtype, limit = fp8_dtype(fmt), FP8_MAX[fmt]
    if scale.dtype != torch.float32:
        scale = scale.float()
    q = x.detach().to(torch.float32, copy=True).mul_(scale).clamp_(-limit, limit).to(dtype)
    return q, q.t().contiguous()


@register("fp8_amax_history_push", "reference")
def fp8_amax_history_push(history: torch.Tensor, amax: torch.Tensor, scale: torch.Tensor, fmt: str = "e4m3",
                          margin: int = 0, algo: str = "max"):
    """One delayed-scaling update: ``(history', scale', scale_inv')``, all new tensors (the old scale
    may still be saved for a backward pass). ``history' = [amax, history[:-1]]`` (newest first);
    ``scale' = fp8_max / 2**margin / A`` with ``A = max(history')`` (``algo="max"``, NaN if any entry
    is NaN) or ``history'[0]`` (``"most_recent"``), keeping ``scale`` where ``A`` is 0, inf or NaN;
    ``scale_inv' = 1 / scale'``. ``history`` is float32 ``[L]``; ``amax`` and ``scale`` float32 scalars."""
    if algo not in ("max", "most_recent"):
        raise ValueError(f"unknown amax compute algorithm {algo!r}: use 'max' or 'most_recent'")
    hist = torch.roll(history, 1, 0)
    hist[0] = amax.to(hist.device, torch.float32).reshape(())
    summary = hist.amax() if algo == "max" else hist[0]
    new_scale = scale_from_amax(summary, fmt, margin, previous=scale)
    return hist, new_scale, new_scale.reciprocal()
