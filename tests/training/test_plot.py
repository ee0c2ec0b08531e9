"""``omnitron plot``: the panels it draws (loss with validation, learning rate, gradient norm; throughput from
zero), read back from the figures, and a clear line for a run with no record yet."""
from __future__ import annotations

import argparse
import json
import math

import pytest

from omnitron.commands import plot


def _records(n=6):
    train = [{"iteration": i, "lm_loss": 5.0 - 0.3 * i, "lr": 1e-3 * min(i, 3) / 3,
              "tokens_per_sec": 900 + 50 * (i % 2),
              "grad_norm": None if i == 2 else 1.0 / i} for i in range(1, n + 1)]
    return train, [{"iteration": 3, "val_loss": 4.5}, {"iteration": 6, "val_loss": 3.9}]


def test_panels_and_zero_based_axes():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, val = _records()
    fig = plot._training_panels(plt, train, val, "run")
    loss, lr, norm = fig.axes
    assert loss.get_title() == "run: training" and [ln.get_label() for ln in loss.get_lines()] == [
        "train lm loss", "validation loss"]
    assert list(lr.get_lines()[0].get_ydata()) == [r["lr"] for r in train] and lr.get_ylim()[0] == 0
    assert list(norm.get_lines()[0].get_xdata()) == [1, 3, 4, 5, 6] and norm.get_ylim()[0] == 0  # skipped step out
    plt.close("all")
    train[1]["lm_loss"] = None  # an interval whose every step was skipped: a gap in the loss curve
    ys = plot._training_panels(plt, train, val, "run").axes[0].get_lines()[0].get_ydata()
    assert math.isnan(ys[1]) and list(ys[2:]) == [r["lm_loss"] for r in train[2:]]
    thr = plot._throughput(plt, train, "run").axes[0]
    assert thr.get_ylim()[0] == 0 and thr.get_title() == "run: throughput"
    plt.close("all")


def test_a_run_without_records_is_one_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"iteration": 2, "val_loss": 3.0}) + "\n")
    assert plot.run(argparse.Namespace(run_dir=str(tmp_path), out=None)) == 2
    assert "holds no training record yet" in capsys.readouterr().err
