"""``cast_to_fp8``'s saturation: e4m3 always clips to +-448, e5m2 overflows to +-inf unless ``saturate`` (Transformer
Engine's satfinite casts), and NaN stays NaN either way.

Reference: the scaled value computed in float64 (the scale a power of two, so float32's product is exact and the
one rounding is the cast's), clipped in float64 where the format saturates, then cast by torch.
"""
from __future__ import annotations

import pytest
import torch

from omnitron.backends.fp8 import cast_to_fp8

E5M2_MAX = 57344.0


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, generator=g) * 4e4  # a good share beyond e5m2's range once scaled
    x[:3] = torch.tensor([float("inf"), -float("inf"), float("nan")])
    scale = torch.tensor(2.0 ** int(torch.randint(-1, 3, (), generator=g)))
    return x, scale


def _reference(x: torch.Tensor, scale: torch.Tensor, clip: float | None, dtype: torch.dtype) -> torch.Tensor:
    y = x.double() * scale.double()
    if clip is not None:
        y = y.clamp(-clip, clip)  # clamp keeps NaN
    return y.to(dtype)


@pytest.mark.parametrize("seed", [0, 1])
def test_e5m2_saturates_only_when_asked(seed):
    x, scale = _inputs(seed)
    sat = cast_to_fp8(x, "e5m2", scale, saturate=True)
    want = _reference(x, scale, E5M2_MAX, torch.float8_e5m2)
    assert torch.equal(sat.float().isnan(), want.float().isnan())
    assert torch.equal(sat.view(torch.uint8)[3:], want.view(torch.uint8)[3:])  # bit for bit past the nan
    assert sat.float()[:2].tolist() == [E5M2_MAX, -E5M2_MAX] and not sat.float().isinf().any()
    # IEEE-like: from the midpoint between the largest finite value 1.75 * 2^15 and 2^16 on, the value rounds to inf
    # (at the midpoint itself, to even: 2^16, i.e. inf)
    wide = cast_to_fp8(x, "e5m2", scale)
    big = (x.double() * scale.double()).abs() >= 61440.0
    assert big[3:].any() and wide.float()[big].isinf().all()
    assert torch.equal(wide.view(torch.uint8)[~big & ~x.isnan()], sat.view(torch.uint8)[~big & ~x.isnan()])


@pytest.mark.parametrize("saturate", [False, True])
def test_e4m3_always_saturates(saturate):
    x, scale = _inputs(2)
    x = x / 100.0  # ~400 scaled: across 448
    got = cast_to_fp8(x, "e4m3", scale * 1.0, saturate=saturate)
    want = _reference(x, scale, 448.0, torch.float8_e4m3fn)
    assert torch.equal(got.float().isnan(), want.float().isnan()) and got.float()[:2].tolist() == [448.0, -448.0]
    assert torch.equal(got.view(torch.uint8)[3:], want.view(torch.uint8)[3:])
