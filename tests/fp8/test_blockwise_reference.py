"""The block-wise recipe (``--fp8-recipe blockwise``) against its definition evaluated in float64 without omnitron.

Megatron turns the flag into Transformer Engine's ``Float8BlockScaling`` at its defaults: inputs and output
gradients in 1x128 tiles along the GEMM's contraction (the weight-grad GEMM contracts over tokens, so there both
are re-tiled 128x1), weights in 128x128 blocks, e4m3 forward and (``hybrid``) e5m2 gradients, and every tile's
scale ``fp8_max / amax`` rounded down to a power of two (``NVTE_FP8_BLOCK_SCALING_FP32_SCALES`` unset), with no
margin: the recipe takes none, and Megatron passes ``--fp8-margin`` to ``DelayedScaling`` alone. Here each scale
is derived in exact rational arithmetic (``math.frexp`` of the float32 quotient), the FP8 codes with one rounding
from the exact product, and the forward output and both gradients of one linear as float64 products of the
dequantized reference operands, on fresh random inputs with outliers and ragged (non-multiple-of-128) shapes.
"""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.core.precision.fp8 import FP8Config, FP8Linear

FMAX = {"e4m3": 448.0, "e5m2": 57344.0}
DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
F32_MAX = torch.finfo(torch.float32).max


def _pow2_scale(amax: float, fmt: str) -> float:
    """The tile's scale: ``fl32(fp8_max / amax)`` rounded down to a power of two (1 for an all-zero tile). The
    float32 rounding of the exact quotient only matters where it rounds up onto a power of two; compare exactly."""
    if amax == 0.0:
        return 1.0
    q = Fraction(FMAX[fmt]) / Fraction(amax)
    if q > F32_MAX:  # overflows float32 (an amax below ~1e-36): TE's compute_scale_from_amax takes the largest float32
        q = Fraction(F32_MAX)
    f32 = torch.tensor(float(q), dtype=torch.float32)
    near = [f32, torch.nextafter(f32, torch.tensor(math.inf)), torch.nextafter(f32, torch.tensor(-math.inf))]
    rounded = min((c.item() for c in near if c.isfinite()), key=lambda v: (abs(Fraction(v) - q), torch.tensor(v).view(
        torch.int32).item() & 1))
    mant, exp = math.frexp(rounded)  # rounded = mant * 2**exp, mant in [0.5, 1)
    return 2.0 ** (exp - 1)


def _tiles(t: torch.Tensor, block: tuple[int, int]):
    (m, k), (bm, bk) = t.shape, block
    for i in range(0, m, bm):
        for j in range(0, k, bk):
            yield slice(i, i + bm), slice(j, j + bk)


def _quantize(t: torch.Tensor, fmt: str, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 codes, float64 per-element scale_inv) of 2-D ``t`` under the recipe, tile by tile."""
    codes, sinv = torch.empty(t.shape, dtype=DTYPE[fmt]), torch.empty(t.shape, dtype=torch.float64)
    for r, c in _tiles(t, block):
        tile = t[r, c].double()
        s = _pow2_scale(tile.abs().max().item(), fmt)
        codes[r, c] = (tile * s).float().clamp(-FMAX[fmt], FMAX[fmt]).to(DTYPE[fmt])  # exact product, one rounding
        sinv[r, c] = 1.0 / s
    return codes, sinv


def _deq(t: torch.Tensor, fmt: str, block: tuple[int, int]) -> torch.Tensor:
    codes, sinv = _quantize(t, fmt, block)
    return codes.double() * sinv


def _bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 GEMM of exactly representable operands (FP8 codes times powers of two): each product exact in float32
    (4 x 3 significant bits), k of them summed in float32: at most k 2^-24 of the sum of magnitudes, 1% slack."""
    return (a.shape[1] + 1) * 2.0 ** -24 * 1.01 * (a.abs() @ b.abs())


def _inputs(tokens: int, k: int, n: int, g: torch.Generator):
    x = torch.randn(tokens, k, generator=g) * 3.0
    x.view(-1)[torch.randint(0, x.numel(), (5,), generator=g)] *= 50.0
    w = torch.randn(n, k, generator=g) * 0.02
    w.view(-1)[torch.randint(0, w.numel(), (3,), generator=g)] *= 40.0
    gy = torch.randn(tokens, n, generator=g) * 1e-4
    return x, w, gy


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("margin", [0, 2])
def test_blockwise_linear_matches_the_recipe_in_float64(fmt, margin):
    """Forward output, data gradient and weight gradient of one linear (x [200, 300], w [136, 300]) within the fp32
    accumulation bound of the float64 products of the reference operands, for two steps on fresh inputs
    (block-wise scaling has no state; the second step checks nothing is carried). ``--fp8-margin`` changes nothing."""
    g = torch.Generator().manual_seed(torch.randint(0, 2 ** 31, ()).item())
    be = get_backend()
    ex, dev = FP8Linear(FP8Config(fp8_recipe="blockwise", fp8_format=fmt, fp8_margin=margin), be.fp8), be.device()
    fb = "e5m2" if fmt == "hybrid" else "e4m3"
    for _ in range(2):
        x, w, gy = _inputs(200, 300, 136, g)
        xd, wd = x.to(dev).requires_grad_(), w.to(dev).requires_grad_()
        y = ex(xd, wd, None)
        y.backward(gy.to(dev))
        dx_w = _deq(w, "e4m3", (128, 128))
        cases = ((y, _deq(x, "e4m3", (1, 128)), dx_w.t(), "forward"),
                 (xd.grad, _deq(gy, fb, (1, 128)), dx_w, "data-grad"),
                 (wd.grad, _deq(gy.t().contiguous(), fb, (1, 128)), _deq(x, "e4m3", (128, 1)), "weight-grad"))
        for got, a, b, name in cases:
            err = (got.detach().cpu().double() - a @ b).abs()
            bound = _bound(a, b)
            assert bool((err <= bound).all()), f"{name}: over the bound by {(err - bound).max().item():.3g}"


def test_blockwise_codes_and_scales_are_the_recipes_bit_for_bit():
    """The provider's block quantization under the recipe: every code and every (power-of-two) scale_inv equal to
    the reference's, including a tile whose quotient is exactly a power of two (amax 3.5 = 448 / 128) and an
    all-zero tile (scale 1)."""
    g = torch.Generator().manual_seed(torch.randint(0, 2 ** 31, ()).item())
    x = torch.randn(3, 384, generator=g)
    x[0, :128] *= 3.5 / x[0, :128].abs().max()
    x[1, 128:256] = 0.0
    be = get_backend()
    for fmt in ("e4m3", "e5m2"):
        q, sinv = (t.cpu() for t in be.fp8.quantize_blocks(x.to(be.device()), fmt, (1, 128), pow2=True))
        codes, ref_sinv = _quantize(x, fmt, (1, 128))
        assert torch.equal(q.view(torch.uint8), codes.view(torch.uint8)), fmt
        assert torch.equal(sinv.double().repeat_interleave(128, 1), ref_sinv), fmt


def test_a_tile_of_tiny_values_scales_by_the_largest_float32_power_of_two():
    """A tile whose amax is below fp8_max / float32 max (about 1.3e-36 for e4m3): the quotient overflows float32,
    the recipe takes the largest float32 and rounds it down to 2**127. An inf scale instead would turn the tile's
    zeros into NaN (0 * inf) and every other value into +-fp8_max; the tile beside it keeps its own scale."""
    g = torch.Generator().manual_seed(torch.randint(0, 2 ** 31, ()).item())
    x = torch.randn(2, 256, generator=g)
    x[0, :128] = torch.randn(128, generator=g) * 1e-38  # float32 subnormals: amax about 3e-38
    x[0, :128:3] = 0.0
    be = get_backend()
    for fmt in ("e4m3", "e5m2"):
        q, sinv = (t.cpu() for t in be.fp8.quantize_blocks(x.to(be.device()), fmt, (1, 128), pow2=True))
        codes, ref_sinv = _quantize(x, fmt, (1, 128))
        assert ref_sinv[0, 0] == 2.0 ** -127, fmt  # the reference's own reading of the rule
        assert not q.float().isnan().any(), fmt
        assert torch.equal(q.view(torch.uint8), codes.view(torch.uint8)), fmt
        assert torch.equal(sinv.double().repeat_interleave(128, 1), ref_sinv), fmt
