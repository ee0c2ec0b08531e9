"""The per-tensor FP8 cast-transpose priced at its measured rate (:meth:`omnitron.plan.device_rates.DeviceRates.
cast_transpose`): a profile's ``[fp8] cast_transpose`` fraction of the copy rate, worked by hand; an ``omnitron bench
kernels`` report's compiled ``fp8_cast_transpose_amax`` row replacing it; a profile without it (every shipped one:
the one measured rate is the eager path's kernel, see h200.toml) at the copy rate, noted."""
from __future__ import annotations

import json
import math
import random
import tomllib

import pytest

from omnitron.plan.fp8 import AMAX, CAST
from omnitron.plan.profile import load


def _rates(name="h200", bench=None):
    from omnitron.commands.plan import settings_of
    from omnitron.plan.cluster import device_rates

    r = device_rates(name, 8, bench)
    r.bind(settings_of({"model": "gpt2_tiny", "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 256,
                        "bf16": True, "fp8_format": "hybrid", "fp8_recipe": "tensorwise"}))
    return r


def _copy_s(table: dict, nbytes: float) -> float:
    """Seconds to move ``nbytes`` at the file's bandwidth times its memory curve, interpolated here in log(bytes)."""
    xs, ys = table["efficiency"]["memory"]["bytes"], table["efficiency"]["memory"]["fraction"]
    i = next(i for i in range(1, len(xs)) if nbytes <= xs[i])
    w = math.log(nbytes / xs[i - 1]) / math.log(xs[i] / xs[i - 1])
    return nbytes / (table["memory"]["bandwidth_gbs"] * 1e9 * (ys[i - 1] + w * (ys[i] - ys[i - 1])))


def _profile_with_fraction(tmp_path, frac: float) -> str:
    path = tmp_path / "h200-cast.toml"
    path.write_text(f'based_on = "h200"\n[fp8]\ncast_transpose = {frac!r}\n')
    return str(path)


def test_cast_transpose_at_the_profiles_fraction_by_hand(tmp_path):
    """A profile based on the H200's with ``[fp8] cast_transpose = 0.208``: 2.5e7 bf16 elements are 1e8 bytes cast
    (2 read, 1 + 1 written), a point of the memory curve (0.701): 4,800 GB/s x 0.701 x 0.208 = 699.9 GB/s, 0.1429 ms.
    A random fraction and size between the curve's points likewise, from the file's own numbers; the amax kernel
    (the 2-byte source read) stays at the copy rate."""
    with open(load("h200").path, "rb") as f:
        table = tomllib.load(f)
    r = _rates(_profile_with_fraction(tmp_path, 0.208))
    assert math.isclose(r.elementwise_s(CAST, "fwd", 2.5e7), 1e8 / (4800e9 * 0.701 * 0.208), rel_tol=1e-12)
    assert math.isclose(r.elementwise_s(CAST, "fwd", 2.5e7) * 1e3, 0.1429, rel_tol=1e-3)  # the figure above
    frac, n = random.uniform(0.05, 1.0), random.uniform(1e5, 2e8)
    r = _rates(_profile_with_fraction(tmp_path, frac))
    for mode in ("fwd", "bwd"):
        assert math.isclose(r.elementwise_s(CAST, mode, n), _copy_s(table, 4 * n) / frac, rel_tol=1e-12)
        assert math.isclose(r.elementwise_s(AMAX, mode, n), _copy_s(table, 2 * n), rel_tol=1e-12)
    assert not any("cast-transpose" in note for note in r.notes)


def _report(tmp_path, kind: str, rows: list[dict], **extra) -> str:
    """A report of ``kind`` as if measured on an accelerator (a cpu one's machine fields, retyped)."""
    from omnitron.backends import get_backend
    from omnitron.bench.report import new_report

    rep = new_report(kind, get_backend("cpu"), rows, **extra)
    rep["machine"]["device_type"] = "cuda"
    path = tmp_path / f"{kind}.json"
    path.write_text(json.dumps(rep))
    return str(path)


def _row(impl: str, dtype: str, gbs: float) -> dict:
    return {"op": "fp8_cast_transpose_amax", "dtype": dtype, "mode": "step", "impl": impl, "ms": 1.0, "gbs": gbs,
            "peak_mib": 1.0, "speedup": 1.0, "note": "", "min_ms": 1.0}


def test_bench_kernels_report_replaces_the_profiles_fraction(tmp_path):
    """``--device ... --bench``: a kernels report's bf16 ``fp8_cast_transpose_amax`` row of the ``compile``
    implementation (what a compiled layer runs), over the same report's copy bandwidth, replaces the profile's
    fraction (noted), whatever faster rows of other implementations say; a report without a compiled row leaves
    the profile's."""
    rng = random.Random()
    copy = rng.uniform(2000, 5000)
    gbs = {"triton": rng.uniform(1000, 1500), "compile": rng.uniform(100, 999)}
    rows = [_row(impl, "bfloat16", g) for impl, g in gbs.items()]
    rows += [_row("eager", "bfloat16", 1900.0), _row("compile", "float32", 1950.0)]  # not taken
    gemm = [{"dtype": "bf16", "shape": "square:1024", "m": 1024, "n": 1024, "k": 1024, "ms": 1.0, "tflops": 2.1}]
    prof = _profile_with_fraction(tmp_path, 0.5)
    paths = [_report(tmp_path, "gemm", gemm), _report(tmp_path, "kernels", rows, copy_gbs=copy)]
    r, plain = _rates(prof, bench=paths), _rates(prof)
    n = rng.uniform(1e5, 1e9)
    copy_rate_s = plain.elementwise_s(CAST, "fwd", n) * 0.5
    assert math.isclose(r.elementwise_s(CAST, "fwd", n), copy_rate_s / (gbs["compile"] / copy), rel_tol=1e-12)
    assert r.elementwise_s(AMAX, "fwd", n) == plain.elementwise_s(AMAX, "fwd", n)
    assert any("bench report's compile kernel" in note for note in r.notes)
    no_compiled = [_report(tmp_path, "gemm", gemm), _report(tmp_path, "kernels", [rows[0], rows[2]], copy_gbs=copy)]
    assert _rates(prof, bench=no_compiled).elementwise_s(CAST, "fwd", n) == plain.elementwise_s(CAST, "fwd", n)


def test_profile_without_the_rate_prices_the_copy_rate_and_says_so(tmp_path):
    """A profile without ``[fp8] cast_transpose`` (B200's; the H200's, whose one measurement is the eager path's)
    prices the cast-transpose at the copy rate of its bytes, with a note; a fraction outside (0, 1] is refused in
    one line naming the key."""
    from omnitron.core.config.parallel import ConfigError

    assert load("h200").fp8_cast_transpose is None
    p, r = load("b200"), _rates("b200")
    assert p.fp8_cast_transpose is None
    n = random.uniform(1e5, 1e9)
    assert math.isclose(r.elementwise_s(CAST, "fwd", n), 4 * n / (p.memory_bw * p.memory(4 * n)), rel_tol=1e-12)
    assert any("priced at the copy rate" in note for note in r.notes)
    bad = tmp_path / "bad.toml"
    bad.write_text('based_on = "h200"\n[fp8]\ncast_transpose = 1.5\n')
    with pytest.raises(ConfigError, match=r"fp8\.cast_transpose 1\.5 outside"):
        load(str(bad))
