"""--profile's trace summary: device busy time is the union of the device events inside the traced window.

The traces here are written by hand (a Chrome trace is a JSON list of events with microsecond ``ts``/``dur``),
so every expected figure is worked out below from the intervals, independently of the summary's code.
"""
import random

import pytest

from omnitron.core.training.trace_summary import one_line, summarize


def _ev(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_busy_is_the_union_clipped_to_the_window():
    # window: iteration 4 at [1000, 1600) and iteration 5 at [1600, 2000) -> 1000 us
    # kernels: [900, 1100) (clipped to [1000, 1100): 100), [1050, 1250) overlapping it (union to 1250: +150),
    # a copy [1500, 1600) (+100), a memset [1900, 2100) (clipped: +100), a CPU op that must not count
    trace = {"traceEvents": [
        _ev("user_annotation", "iteration 4", 1000, 600), _ev("user_annotation", "iteration 5", 1600, 400),
        _ev("kernel", "gemm", 900, 200), _ev("kernel", "gemm", 1050, 200), _ev("gpu_memcpy", "Memcpy DtoH", 1500, 100),
        _ev("gpu_memset", "Memset", 1900, 200), _ev("cpu_op", "aten::mm", 1000, 1000)]}
    s = summarize(trace)
    assert s["iterations"] == [4, 5] and s["window_ms"] == pytest.approx(1.0)
    assert s["device_busy_ms"] == pytest.approx(0.45)  # 100 + 150 + 100 + 100 us
    assert s["device_idle_fraction"] == pytest.approx(0.55)
    assert s["top_kernels"][0]["name"] == "gemm" and s["top_kernels"][0]["calls"] == 1  # [900, ..) starts outside
    assert "idle 55.0%" in one_line(s)
    # idle stretches: [1250, 1500) and [1600, 1900), 250 and 300 us, both in the 100 us - 1 ms class
    assert s["idle_gaps"] == {"under_10us": {"count": 0, "ms": 0.0}, "under_100us": {"count": 0, "ms": 0.0},
                              "under_1000us": {"count": 2, "ms": pytest.approx(0.55)},
                              "over_1000us": {"count": 0, "ms": 0.0}}


def test_idle_gaps_at_the_class_edges_and_the_window_ends():
    # window [0, 5000); kernels [5, 100), [110, 200), [300, 400), [1400, 1500): idle stretches of 5 us (before the
    # first kernel), 10, 100, 1000 and 3500 us (after the last one); a class holds the lengths below its edge
    trace = {"traceEvents": [_ev("user_annotation", "iteration 1", 0, 5000)]
             + [_ev("kernel", "k", ts, end - ts) for ts, end in ((5, 100), (110, 200), (300, 400), (1400, 1500))]}
    g = summarize(trace)["idle_gaps"]
    assert {k: v["count"] for k, v in g.items()} == {"under_10us": 1, "under_100us": 1, "under_1000us": 1,
                                                      "over_1000us": 2}
    assert [v["ms"] for v in g.values()] == pytest.approx([0.005, 0.010, 0.100, 4.5])


def test_random_intervals_against_a_microsecond_grid():
    """The union on fresh random integer intervals against counting each covered microsecond."""
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    kernels = [(rng.randrange(0, 3000), rng.randrange(1, 300)) for _ in range(60)]
    trace = {"traceEvents": [_ev("user_annotation", "iteration 1", 500, 2000)]
             + [_ev("kernel", f"k{i % 3}", ts, dur) for i, (ts, dur) in enumerate(kernels)]}
    covered = set()
    for ts, dur in kernels:
        covered.update(t for t in range(ts, ts + dur) if 500 <= t < 2500)
    s = summarize(trace)
    assert s["device_busy_ms"] * 1e3 == pytest.approx(len(covered), abs=1e-6), seed
    assert s["device_idle_fraction"] == pytest.approx(1 - len(covered) / 2000, abs=1e-9), seed
    # idle stretches: runs of uncovered microseconds in the window, classed by length (< 10, < 100, < 1000, rest)
    runs, n = [], 0
    for t in range(500, 2501):
        if t < 2500 and t not in covered:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    for name, lo, hi in (("under_10us", 0, 10), ("under_100us", 10, 100), ("under_1000us", 100, 1000),
                         ("over_1000us", 1000, 1 << 30)):
        want = [r for r in runs if lo <= r < hi]
        assert s["idle_gaps"][name]["count"] == len(want), (seed, name)
        assert s["idle_gaps"][name]["ms"] * 1e3 == pytest.approx(sum(want), abs=1e-6), (seed, name)


def test_host_only_trace_and_a_foreign_trace():
    s = summarize({"traceEvents": [_ev("user_annotation", "iteration 2", 0, 50), _ev("cpu_op", "aten::add", 0, 10)]})
    assert s["device_idle_fraction"] is None and s["idle_gaps"] is None and "no device events" in one_line(s)
    with pytest.raises(ValueError, match="no 'iteration N' spans"):
        summarize({"traceEvents": [_ev("kernel", "k", 0, 10)]})
