"""``omnitron bench kernels`` / ``bench compare`` end to end on one op, and the peak-memory tracker."""
from __future__ import annotations

import json

import torch

from omnitron.cli import main
from omnitron.kernels.benchmark import PeakTracker


def test_peak_tracker_counts_temporaries():
    x = torch.randn(256, 256)  # 256 KiB, exists before: not counted
    with PeakTracker() as tracker:
        y = x * 2  # +256 KiB
        z = y.exp()  # +256 KiB (peak 512)
        del y  # -256 KiB
        w = z + 1  # +256 KiB (peak stays 512)
    assert tracker.peak == 2 * x.numel() * 4
    assert tracker.cur == 2 * x.numel() * 4
    del z, w


def test_bench_kernels_and_compare(tmp_path, capsys, backend_name):
    out = tmp_path / "a.json"
    assert main(["bench", "kernels", "--backend", backend_name, "--ops", "rms_norm", "--dtypes", "float32",
                 "--rounds", "3", "--size", "tiny", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    impls = {(r["mode"], r["impl"]) for r in report["rows"]}
    assert {("fwd", "eager"), ("fwd", "torch"), ("fwd+bwd", "eager")} <= impls
    assert all(r["ms"] > 0 and r["gbs"] > 0 for r in report["rows"] if not r["note"])
    assert report["extra"]["copy_gbs"] > 0 and report["kind"] == "kernels" and report["schema"] == "omnitron-bench"
    capsys.readouterr()
    assert main(["bench", "compare", str(out), str(out)]) == 0
    text = capsys.readouterr().out
    assert "rms_norm" in text and "(1.00x)" in text
