"""The FP8 linear's GEMM operands bit for bit, and its results, against a reference derived in exact arithmetic.

Every float8 code and every dequantization factor the layer hands to its three GEMMs (forward, data-grad,
weight-grad) must equal, bit for bit, the recipe's definition evaluated here without omnitron: amax in float64
(exact), ``scale = fl32(fp8_max / 2**margin / amax)`` (Transformer Engine's one division, every recipe) and
``scale_inv = fl32(1 / scale)`` rounded from exact rationals, ``q = fp8(clamp(fl32(x * scale)))`` (the float64
product of a float32 scale and a bf16 / fp32 value is exact, so one rounding to float32). Delayed scaling: the scale
in force at use ``t`` follows the history of the previous uses' amaxes (scaling.py), standalone and once per step as
training runs it. Any change to the host path that moves a result (a scale computed in another order, a role's
format or margin, a stale or skipped history update, an operand swapped or re-rounded) fails here, on fresh random
inputs.
"""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.backends.fp8 import FP8Provider
from omnitron.core.precision.fp8 import FP8Config, FP8Linear
from omnitron.core.precision.fp8.scaling import AmaxReducer

FMAX = {"e4m3": 448.0, "e5m2": 57344.0}
DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _rn32(q: Fraction) -> float:
    """``q`` rounded to the nearest float32, ties to even: the float32 neighbours of a first guess compared as
    exact rationals (no double rounding through float64)."""
    guess = torch.tensor(float(q), dtype=torch.float32)
    cands = [guess, torch.nextafter(guess, torch.tensor(math.inf)), torch.nextafter(guess, torch.tensor(-math.inf))]
    return min((c.item() for c in cands),
               key=lambda v: (abs(Fraction(v) - q), torch.tensor(v).view(torch.int32).item() & 1))


def _scales(amax: float, fmt: str, margin: int) -> tuple[float, float]:
    """(scale, scale_inv) of the recipe for a reduced ``amax`` (finite, positive here): the target over the amax
    rounded once, as Transformer Engine's ``compute_scale_from_amax`` divides (a rounded reciprocal times the target
    is an ulp off for about a quarter of amaxes), and the scale's reciprocal rounded once."""
    target = Fraction(FMAX[fmt]) / 2 ** margin
    scale = _rn32(target / Fraction(amax))
    return scale, _rn32(1 / Fraction(scale))


def _quantize(t: torch.Tensor, fmt: str, scale: float) -> torch.Tensor:
    """fp8 codes of ``t`` (2-D) under ``scale``: exact product, one rounding to float32, saturation, RNE to fp8."""
    y = (t.double() * scale).float().clamp(-FMAX[fmt], FMAX[fmt])
    return y.to(DTYPE[fmt])


def _amax(t: torch.Tensor) -> float:
    return t.double().abs().max().item()


class _Spy:
    """Records the operands of each ``scaled_mm`` call of a provider, on the host."""

    def __init__(self, provider: FP8Provider) -> None:
        self.calls, real = [], provider.scaled_mm

        def spy(a, b, sa, sb, out_dtype=torch.float32):
            self.calls.append((a.cpu(), b.cpu(), sa.cpu().reshape(()).item(), sb.cpu().reshape(()).item()))
            return real(a, b, sa, sb, out_dtype=out_dtype)

        provider.scaled_mm = spy


def _same_codes(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(
        got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))


def _gemm_bound(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Error bound of an FP8 GEMM result against the float64 product of its dequantized operands ``a``, ``b``:
    each operand is dequantized to float32 (relative 2^-24 each), each product rounded (2^-24) and k of them
    summed in float32 (k 2^-24 of the sum of magnitudes), so (k + 3) 2^-24 |a| @ |b| with 1% slack for the
    second-order terms; then one rounding to ``out_dtype`` (half an ulp: 2^-8 bf16, none for float32)."""
    acc = (a.shape[1] + 3) * 2.0 ** -24 * 1.01 * (a.abs() @ b.abs())
    unit = {torch.bfloat16: 2.0 ** -8, torch.float32: 0.0}[out_dtype]
    return acc + unit * ((a @ b).abs() + acc)


def _inputs(shape, dtype, growth):
    """x [*, 64] with outliers, w [48, 64], and one output gradient per call; call ``t``'s x scaled by growth[t]."""
    g = torch.Generator().manual_seed(torch.randint(0, 2 ** 31, ()).item())
    w = torch.randn(48, 64, generator=g) * 0.05
    w.view(-1)[torch.randint(0, w.numel(), (3,), generator=g)] *= 40.0
    xs, gys = [], []
    for k in growth:
        x = torch.randn(*shape, 64, generator=g) * k
        x.view(-1)[torch.randint(0, x.numel(), (4,), generator=g)] *= 30.0
        xs.append(x.to(dtype))
        gys.append((torch.randn(*shape, 48, generator=g) * 1e-3 * k).to(dtype))
    return w.to(dtype), xs, gys


def _scales_in_force(amaxes: list[float], fmt: str, margin: int, recipe: str, hist_len: int,
                     algo: str = "max") -> list[tuple]:
    """(scale, scale_inv) used at each use: the use's own amax (tensorwise, and delayed's first use), else the max
    of the last ``hist_len`` earlier amaxes (delayed, ``max``) or the previous use's (delayed, ``most_recent``),
    standalone and once per step alike."""
    out = []
    for t, a in enumerate(amaxes):
        if recipe == "tensorwise" or t == 0:
            ref = a
        else:
            ref = max(amaxes[max(0, t - hist_len):t]) if algo == "max" else amaxes[t - 1]
        out.append(_scales(ref, fmt, margin))
    return out


@pytest.mark.parametrize("recipe,per_step,algo", [("tensorwise", False, "max"), ("delayed", False, "max"),
                                                  ("delayed", True, "max"), ("delayed", True, "most_recent")])
@pytest.mark.parametrize("fmt,margin,dtype,shape", [("hybrid", 0, torch.bfloat16, (4, 12)),
                                                     ("e4m3", 1, torch.float32, (40,))])
def test_gemm_operands_are_the_recipes_bit_for_bit(recipe, per_step, algo, fmt, margin, dtype, shape):
    """Three uses of one layer (the third with a larger input than the history has seen: delayed scaling
    saturates it), each forward and backward; operands exact, results within the fp32-accumulation bound."""
    be, hist_len = get_backend(), 2
    cfg = FP8Config(fp8_recipe=recipe, fp8_format=fmt, fp8_margin=margin, fp8_amax_history_len=hist_len,
                    fp8_amax_compute_algo=algo)
    provider = FP8Provider(be)
    spy = _Spy(provider)
    reducer = AmaxReducer((), None, per_step=True) if per_step else None
    ex = FP8Linear(cfg, provider, reducer=reducer)
    w, xs, gys = _inputs(shape, dtype, growth=(1.0, 0.5, 4.0))
    bias = torch.randn(48).to(dtype)
    dev = be.device()
    wd, bd = w.to(dev).requires_grad_(), bias.to(dev).requires_grad_()
    fb = cfg.backward_format
    x2s, g2s = [x.reshape(-1, 64) for x in xs], [gy.reshape(-1, 48) for gy in gys]
    m = margin if recipe == "delayed" else 0  # --fp8-margin is delayed scaling's alone (Megatron: TE's DelayedScaling)
    sx = _scales_in_force([_amax(x) for x in x2s], "e4m3", m, recipe, hist_len, algo)
    sw = _scales_in_force([_amax(w)] * 3, "e4m3", m, recipe, hist_len, algo)
    sg = _scales_in_force([_amax(g) for g in g2s], fb, m, recipe, hist_len, algo)
    for t in range(3):
        spy.calls.clear()
        xd = xs[t].to(dev).requires_grad_()
        y = ex(xd, wd, bd)
        y.backward(gys[t].to(dev))
        if reducer is not None:
            reducer.step()
        qx, qw, qg = (_quantize(x2s[t], "e4m3", sx[t][0]), _quantize(w, "e4m3", sw[t][0]),
                      _quantize(g2s[t], fb, sg[t][0]))
        want = [(qx, qw.t(), sx[t][1], sw[t][1]),   # forward  y  = x @ w.T
                (qg, qw, sg[t][1], sw[t][1]),       # data     dx = g @ w
                (qg.t(), qx, sg[t][1], sx[t][1])]   # weight   dw = g.T @ x
        assert len(spy.calls) == 3, len(spy.calls)
        for i, ((a, b, sa, sb), (wa, wb, wsa, wsb)) in enumerate(zip(spy.calls, want)):
            assert _same_codes(a, wa) and _same_codes(b, wb), f"use {t}, GEMM {i}: FP8 codes differ"
            assert (sa, sb) == (wsa, wsb), f"use {t}, GEMM {i}: scale_inv {(sa, sb)} != {(wsa, wsb)}"
        # results: float64 products of the reference operands, within the bound
        deq = [(wa.double() * wsa, wb.double() * wsb) for wa, wb, wsa, wsb in want]
        for got, (a, b), out_dtype, extra in ((y, deq[0], dtype, bias.double()), (xd.grad, deq[1], dtype, 0.0),
                                               (wd.grad, deq[2], dtype, 0.0)):
            ref = a @ b + extra
            bound = _gemm_bound(a, b, out_dtype)
            if got is y:  # the bias add in the output dtype rounds once more: half an ulp of the sum
                bound = bound + {torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}[dtype] * (ref.abs() + bound)
            err = (got.detach().cpu().double().reshape(ref.shape) - ref).abs()
            assert bool((err <= bound).all()), f"use {t}: over the bound by {(err - bound).max().item():.3g}"
        wd.grad = None
