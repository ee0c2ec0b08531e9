"""``omnitron.plan.calibrate``: measured rates over a device profile's datasheet figures and its curves, worked by
hand on a profile of round numbers (flat curves, no latency) and reports of chosen rows; cpu reports and reports
without usable rows refused in one line."""
from __future__ import annotations

import json
import random

import pytest

from omnitron.cli import main

PROFILE = """name = "round"
title = "round numbers"
gpus_per_node = 8
[peak_tflops]
# made up
bf16 = 100.0
fp16 = 100.0
[memory]
# made up
capacity_gb = 80.0
usable_gib = 70.0
bandwidth_gbs = 1000.0
[links]
# made up; no latency
intra = "switch"
intra_gbs = 100.0
intra_efficiency = 0.5
intra_latency_us = 0.0
nic = "nic"
nic_gbs = 10.0
nic_efficiency = 1.0
inter_latency_us = 0.0
[efficiency.gemm]
# flat
flops = [1e3, 1e15]
fraction = [0.5, 0.5]
[efficiency.attention]
# flat
flops = [1e3, 1e15]
fraction = [0.5, 0.5]
[efficiency.memory]
# flat
bytes = [1e3, 1e12]
fraction = [0.8, 0.8]
"""


def _report(tmp_path, kind: str, rows: list[dict], device_type: str = "cuda") -> str:
    from omnitron.backends import get_backend
    from omnitron.bench.report import new_report

    rep = new_report(kind, get_backend("cpu"), rows)
    rep["machine"]["device_type"] = device_type
    path = tmp_path / f"{kind}-{device_type}.json"
    path.write_text(json.dumps(rep))
    return str(path)


def test_ratios_by_hand(tmp_path, capsys):
    """GEMM bf16 1024^3 at t TFLOP/s: t / 100 of the datasheet, t / 50 of the profile (curve 0.5). A copy at g GB/s:
    g / 1000 and g / 800. An 8-rank all-reduce of 1 GB: the model's ring 2 x 7/8 x 1 GB / (100 x 0.5 GB/s) = 35 ms,
    so a measured m ms is 35 / m of the profile; its busbw b GB/s is b / 100 of the link. Medians per kind; the
    GEMMs' median named as the kernel rate of a profile of this stack."""
    prof = tmp_path / "round.toml"
    prof.write_text(PROFILE)
    t1, t2, g, m = (random.uniform(10, 90) for _ in range(4))
    gemm = _report(tmp_path, "gemm", [{"dtype": "bf16", "shape": "square", "m": 1024, "n": 1024, "k": 1024, "ms": 1.0,
                                       "tflops": t} for t in (t1, t2)])
    mem = _report(tmp_path, "memory", [{"op": "copy", "bytes": 1 << 28, "ms": 2 * (1 << 28) / (g * 1e6), "gbs": g}])
    algbw = 1e9 / (m * 1e-3) / 1e9
    comm = _report(tmp_path, "comm", [{"op": "all_reduce", "bytes": 10**9, "ranks": 8, "ms": m, "algbw_gbs": algbw,
                                       "busbw_gbs": algbw * 1.75, "group": "world", "local": 8, "nodes": 1}])
    out = tmp_path / "cal.json"
    assert main(["bench", "calibrate", gemm, mem, comm, "--device", str(prof), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {(r["kind"], r["measured"]): r for r in res["rows"]}
    for t in (t1, t2):
        assert rows[("gemm bf16", t)]["of_datasheet"] == pytest.approx(t / 100, rel=1e-12)
        assert rows[("gemm bf16", t)]["of_profile"] == pytest.approx(t / 50, rel=1e-12)
    assert rows[("memory", g)]["of_datasheet"] == pytest.approx(g / 1000, rel=1e-12)
    assert rows[("memory", g)]["of_profile"] == pytest.approx(g / 800, rel=1e-9)
    c = rows[("comm", algbw * 1.75)]
    assert c["of_profile"] == pytest.approx(35 / m,
                                            rel=1e-12) and c["of_datasheet"] == pytest.approx(algbw * 1.75 / 100)
    assert res["summary"]["gemm bf16"] == pytest.approx((t1 + t2) / 100, rel=1e-12)  # median of two: their mean
    assert f"kernel_rate = {(t1 + t2) / 100:.3f}" in capsys.readouterr().out


def test_cpu_reports_and_empty_ones_refused(tmp_path, capsys):
    prof = tmp_path / "round.toml"
    prof.write_text(PROFILE)
    row = [{"dtype": "bf16", "shape": "square", "m": 64, "n": 64, "k": 64, "ms": 1.0, "tflops": 1.0}]
    assert main(["bench", "calibrate", _report(tmp_path, "gemm", row, "cpu"), "--device", str(prof)]) == 2
    err = capsys.readouterr().err
    assert "measured on a cpu" in err and len(err.strip().splitlines()) == 1
    fp32 = [dict(row[0], dtype="fp32")]  # the profile has no tf32 peak: nothing to calibrate
    assert main(["bench", "calibrate", _report(tmp_path, "gemm", fp32), "--device", str(prof)]) == 2
    assert "no gemm, memory or intra-node collective rows" in capsys.readouterr().err


def test_an_fp32_gemm_run_in_tf32_is_set_against_tf32s_peak(tmp_path):
    """``omnitron bench gemm`` marks an fp32 row whose GEMM ran in TF32 (a backend's ``fp32_matmul``) with
    ``math`` tf32: its datasheet fraction is over TF32's peak (t / 400 here), not FP32's (t / 25)."""
    prof = tmp_path / "round.toml"
    prof.write_text(PROFILE.replace("bf16 = 100.0", "fp32 = 25.0\ntf32 = 400.0\nbf16 = 100.0"))
    t1, t2 = (random.uniform(10, 90) for _ in range(2))
    gemm = _report(tmp_path, "gemm", [{"dtype": "fp32", "math": math, "shape": "square", "m": 512, "n": 512,
                                       "k": 512, "ms": 1.0, "tflops": t} for math, t in (("tf32", t1), ("fp32", t2))])
    out = tmp_path / "cal.json"
    assert main(["bench", "calibrate", gemm, "--device", str(prof), "--json", str(out)]) == 0
    rows = {r["measured"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows[t1]["of_datasheet"] == pytest.approx(t1 / 400, rel=1e-12)
    assert rows[t2]["of_datasheet"] == pytest.approx(t2 / 25, rel=1e-12)
