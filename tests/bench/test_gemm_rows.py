"""``omnitron bench gemm``'s rows against their definitions: TFLOP/s = 2mnk / time and % of peak against the peak
of the arithmetic the GEMM ran in. A backend whose float32 GEMMs run in TF32 (capabilities ``fp32_matmul``:
torch_musa 2.7's default) gets its fp32 row set against TF32's peak with a note (it was fp32's peak, so the
row read several times 100%); the tf32 row, switched by ``torch.backends.cuda``, is only made on a cuda
device (elsewhere it timed whatever float32 ran as, under TF32's name)."""
from __future__ import annotations

import dataclasses
import random

import pytest

from omnitron.backends import get_backend
from omnitron.bench import gemm


class _As:
    """The CPU backend under another device type and capabilities (peaks, float32 GEMM arithmetic)."""

    def __init__(self, device_type: str, **caps):
        self._inner, self.device_type = get_backend("cpu"), device_type
        self._caps = dataclasses.replace(self._inner.capabilities(), **caps)

    def capabilities(self):
        return self._caps

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.mark.parametrize("device_type,fp32_matmul", [("musa", "tf32"), ("musa", "fp32"), ("cuda", None)])
def test_fp32_and_tf32_rows_against_the_peak_of_their_arithmetic(device_type, fp32_matmul):
    rng = random.Random()
    peaks = {"fp32": rng.uniform(1e12, 1e14), "tf32": rng.uniform(1e14, 1e15)}
    be = _As(device_type, fp32_matmul=fp32_matmul, peak_flops=peaks)
    size = rng.choice([16, 32, 48])
    rows = gemm.run(be, sizes=[size], dtypes=["fp32", "tf32"], rounds=3, budget_s=0.05, log=lambda *_: None)
    assert [r["dtype"] for r in rows] == (["fp32", "tf32"] if device_type == "cuda" else ["fp32"])
    for r in rows:
        ran_as = "tf32" if r["dtype"] == "tf32" or fp32_matmul == "tf32" else "fp32"
        assert r["math"] == ran_as
        tflops = 2 * size**3 / (r["ms"] * 1e-3) / 1e12  # float64: ~1e-16
        assert r["tflops"] == pytest.approx(tflops, rel=1e-12)
        assert r["peak_tflops"] == pytest.approx(peaks[ran_as] / 1e12, rel=1e-12)
        assert r["pct_peak"] == pytest.approx(100 * tflops * 1e12 / peaks[ran_as], rel=1e-12)
        assert ("TF32" in r["note"]) == (r["dtype"] == "fp32" and fp32_matmul == "tf32")
