"""FP8 quantization: round-trip error bounds, saturation / overflow, inf and nan, block-wise scales."""
from __future__ import annotations

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.backends.fp8 import FP8_MAX, block_amax, cast_to_fp8, expand_blocks, scale_from_amax

# half an ulp relative to the value (3 / 2 mantissa bits), and half the smallest subnormal
REL = {"e4m3": 2.0 ** -4, "e5m2": 2.0 ** -3}
SUB = {"e4m3": 2.0 ** -10, "e5m2": 2.0 ** -17}


@pytest.fixture(scope="module")
def fp8():
    return get_backend().fp8


def _check_round_trip(x, deq, fmt, scale):
    err = (deq.double() - x.double()).abs()
    bound = torch.maximum(REL[fmt] * x.double().abs(), torch.full_like(err, SUB[fmt]) / scale.double())
    assert bool((err <= bound * (1 + 1e-6)).all()), f"{fmt}: worst excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_round_trip_within_format_bound(fp8, fmt):
    g = torch.Generator().manual_seed(1)
    # normal values spanning the range, values deep in the subnormal range, and exact zeros
    x = torch.cat([torch.randn(4096, generator=g) * 10 ** torch.empty(4096).uniform_(-3, 2, generator=g),
                   torch.zeros(16)])
    scale = scale_from_amax(x.abs().amax(), fmt)
    q, amax = fp8.quantize(x, fmt, scale)
    assert q.dtype == {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    assert amax.item() == x.abs().max().item()
    deq = q.float() / scale
    _check_round_trip(x, deq, fmt, scale)
    # the bound is tight: a finer claim (half of it) must fail somewhere, so the check can fail
    err = (deq.double() - x.double()).abs()
    assert bool((err > 0.5 * REL[fmt] * x.double().abs()).any())
    # the largest value lands on (or within an ulp of) the format maximum
    assert q.float().abs().max().item() <= FP8_MAX[fmt]


def test_e4m3_saturates_and_keeps_nan(fp8):
    x = torch.tensor([1.0, 447.0, 449.0, 500.0, 1e6, float("inf"), -float("inf"), -1e9, float("nan")])
    q, amax = fp8.quantize(x, "e4m3", torch.tensor(1.0))
    got = q.float()
    assert got[:8].tolist() == [1.0, 448.0, 448.0, 448.0, 448.0, 448.0, -448.0, -448.0]
    assert torch.isnan(got[8])
    assert torch.isnan(amax)  # nan propagates into amax, so the scale rule must ignore it (below)


def test_e5m2_overflows_to_inf(fp8):
    x = torch.tensor([57344.0, 60000.0, 61440.0, 1e6, -1e6, float("inf"), float("nan")])
    got = fp8.quantize(x, "e5m2", torch.tensor(1.0))[0].float()
    assert got[0].item() == 57344.0 and got[1].item() == 57344.0  # rounds down to the largest finite value
    assert torch.isinf(got[2:6]).all() and (got[2:5].sign() == torch.tensor([1.0, 1.0, -1.0])).all()
    assert torch.isnan(got[6])


def test_scale_rule_ignores_zero_and_non_finite_amax():
    prev = torch.tensor(3.0)
    amax = torch.tensor([2.0, 0.0, float("inf"), float("nan")])
    s = scale_from_amax(amax, "e4m3", margin=1, previous=prev)
    assert s.tolist() == [448.0 / 2 / 2.0, 3.0, 3.0, 3.0]
    assert scale_from_amax(torch.tensor(0.0), "e5m2").item() == 1.0


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_scale_is_one_correctly_rounded_division(fmt):
    """Every recipe's scale (tensorwise, delayed, FSDP2's, block-wise before its power-of-two rounding) is
    ``fp8_max / 2**margin / amax`` rounded once to float32, as Transformer Engine's ``compute_scale_from_amax``
    (``__fdiv_rn``) and torchao divide; the reciprocal times the target it was computed as is an ulp off for about
    a quarter of amaxes. Reference: the exact rational quotient rounded to nearest even (fractions), on fresh random
    amaxes spread log-uniformly over float32's normal range; a quotient above the largest float32 is that."""
    from fractions import Fraction

    g = torch.Generator().manual_seed(torch.randint(0, 2 ** 31, ()).item())
    amax = torch.exp(torch.empty(2000, dtype=torch.float64).uniform_(-87.0, 88.0, generator=g)).float()
    amax = torch.cat([amax, torch.tensor([1e-38, 2e-37, 3e-45])])  # quotients beyond float32's range
    flt_max = torch.finfo(torch.float32).max
    for margin in (0, int(torch.randint(1, 5, (), generator=g))):
        got = scale_from_amax(amax, fmt, margin)
        target = Fraction(FP8_MAX[fmt]) / 2 ** margin
        for a, s in zip(amax.tolist(), got.tolist()):
            q = target / Fraction(a)
            want = flt_max if q > flt_max else _rn32(q)
            assert s == want, f"{fmt} margin {margin} amax {a!r}: {s!r} != {want!r}"
    off = (amax.reciprocal() * FP8_MAX[fmt] != torch.div(FP8_MAX[fmt], amax)).float().mean().item()
    assert off > 0.1  # the rule replaced: the reference above tells the two apart on this draw


def _rn32(q) -> float:
    """Rational ``q`` (within float32's normal range) rounded to the nearest float32, ties to even: the float32
    neighbours of a first guess compared exactly."""
    from fractions import Fraction

    guess = torch.tensor(float(q), dtype=torch.float32)
    cands = [guess, torch.nextafter(guess, torch.tensor(float("inf"))), torch.nextafter(guess, torch.tensor(0.0))]
    return min((c.item() for c in cands),
               key=lambda v: (abs(Fraction(v) - q), torch.tensor(v).view(torch.int32).item() & 1))


def test_tiny_amax_keeps_zeros_zero(fp8):
    """An amax whose quotient overflows float32 (a gradient of about 1e-37) gives the largest float32 scale, as
    Transformer Engine clips it: the tensor's zeros quantize to zero (a scale of inf made them NaN)."""
    x = torch.tensor([0.0, 1e-37, -3e-38, 0.0])
    scale = scale_from_amax(x.abs().amax(), "e4m3")
    assert scale.item() == torch.finfo(torch.float32).max
    q = fp8.quantize(x, "e4m3", scale)[0].float()
    assert not torch.isnan(q).any() and q[0].item() == 0.0 and q[3].item() == 0.0 and q[1].item() > 0


@pytest.mark.parametrize("block", [(1, 128), (128, 128), (128, 1)])
def test_block_quantize_per_tile_scales(fp8, block):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(200, 300, generator=g)  # ragged edges: 200, 300 are not multiples of 128
    x[7, 5] = 1000.0  # one outlier only affects its own tile
    q, sinv = fp8.quantize_blocks(x, "e4m3", block, pow2=False)  # the unrounded scale
    gm, gk = -(-200 // block[0]), -(-300 // block[1])
    assert sinv.shape == (gm, gk) and q.shape == x.shape
    # every tile's scale maps its own amax onto 448
    ref_amax = torch.zeros(gm, gk)
    for i in range(gm):
        for j in range(gk):
            ref_amax[i, j] = x[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].abs().max()
    torch.testing.assert_close(block_amax(x, block), ref_amax, rtol=0, atol=0)
    torch.testing.assert_close(sinv, ref_amax / 448.0, rtol=1e-6, atol=0)
    scale = expand_blocks(1.0 / sinv, block, tuple(x.shape))
    _check_round_trip(x, q.float() / scale, "e4m3", scale)
    # the outlier's tile has a coarse scale; other tiles keep fine resolution
    i0, j0 = 7 // block[0], 5 // block[1]
    assert sinv[i0, j0] == sinv.max() and (sinv < sinv[i0, j0]).sum() == sinv.numel() - 1


def test_cast_to_fp8_matches_provider(fp8):
    x = torch.randn(64, 64)
    s = torch.tensor(7.5)
    assert torch.equal(cast_to_fp8(x, "e4m3", s).view(torch.uint8), fp8.quantize(x, "e4m3", s)[0].view(torch.uint8))
