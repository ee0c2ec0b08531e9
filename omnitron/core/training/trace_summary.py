"""What a ``--profile`` window's Chrome trace says about the device: busy and idle time, top kernels.

torch.profiler's Chrome trace (the file :class:`omnitron.core.training.timers.StepProfiler` writes) holds the
traced iterations as ``user_annotation`` spans ("iteration N") on the host and, on a device backend, one
event per device kernel, copy and memset (``kernel``, ``gpu_memcpy``, ``gpu_memset``; torch names them so
for every device it profiles through Kineto). The device is *busy* where at least one such event runs (the
union of their intervals, so overlapping streams count once) and *idle* for the rest of the window, the
window running from the first traced iteration's start to the last one's end. An idle fraction near zero
means the host keeps the device fed; a large one means the step is bound by the host (launch overhead,
Python), by synchronisation, or by communication outside the device's kernels.

Reading the file keeps this independent of torch's profiler classes, which change between versions.
"""
from __future__ import annotations

import json

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


GAP_BINS_US = (10.0, 100.0, 1000.0)
"""Upper edges of the idle-gap classes (microseconds): launch-bound idle is many gaps of a few to tens of
microseconds between kernels; a host stall (a sync, the optimizer's host work, data) is a few long ones."""


def _merged(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """The union of ``[start, end)`` intervals, clipped to ``[lo, hi)``, as disjoint sorted intervals."""
    out: list[list[float]] = []
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if e <= s:
            continue
        if not out or s > out[-1][1]:
            out.append([s, e])
        else:
            out[-1][1] = max(out[-1][1], e)
    return [(s, e) for s, e in out]


def _idle_gaps(busy: list[tuple[float, float]], lo: float, hi: float) -> dict[str, dict]:
    """Count and total ms of the window's idle stretches by length class (:data:`GAP_BINS_US`)."""
    edges = [lo] + [x for iv in busy for x in iv] + [hi]
    gaps = [edges[i + 1] - edges[i] for i in range(0, len(edges), 2) if edges[i + 1] > edges[i]]
    names = [f"under_{int(b)}us" for b in GAP_BINS_US] + [f"over_{int(GAP_BINS_US[-1])}us"]
    out = {n: {"count": 0, "ms": 0.0} for n in names}
    for g in gaps:
        n = names[next((i for i, b in enumerate(GAP_BINS_US) if g < b), len(GAP_BINS_US))]
        out[n]["count"] += 1
        out[n]["ms"] += g / 1e3
    return out


def summarize(trace: dict, top: int = 10) -> dict:
    """The summary of a loaded Chrome trace: ``window_ms``, ``device_busy_ms``, ``device_idle_fraction``
    (None when the trace has no device events: a host-only backend), ``iterations``, ``top_kernels``
    (name, calls, total ms, share of busy time) and, with device events, ``idle_gaps``: the idle stretches by length
    (count and ms under 10 us, under 100 us, under 1 ms and over it)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    spans = [e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("iteration ")]
    if not spans:
        raise ValueError("trace has no 'iteration N' spans: it was not written by --profile's step profiler")
    lo = min(float(e["ts"]) for e in spans)
    hi = max(float(e["ts"]) + float(e["dur"]) for e in spans)
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    out = {"iterations": sorted(int(e["name"].split()[1]) for e in spans), "window_ms": (hi - lo) / 1e3,
           "device_events": len(device), "device_busy_ms": None, "device_idle_fraction": None, "idle_gaps": None,
           "top_kernels": []}
    if not device:
        return out
    merged = _merged([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in device], lo, hi)
    busy = sum(e - s for s, e in merged)
    out["device_busy_ms"] = busy / 1e3
    out["device_idle_fraction"] = 1.0 - busy / (hi - lo) if hi > lo else None
    out["idle_gaps"] = _idle_gaps(merged, lo, hi)
    by_name: dict[str, list[float]] = {}
    for e in device:
        if lo <= float(e["ts"]) < hi:
            by_name.setdefault(str(e.get("name", "?")), []).append(float(e["dur"]))
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    out["top_kernels"] = [{"name": n[:120], "calls": len(d), "total_ms": sum(d) / 1e3,
                           "share_of_busy": sum(d) / busy if busy else None} for n, d in ranked]
    return out


def summarize_file(path: str, top: int = 10) -> dict:
    with open(path) as f:
        return summarize(json.load(f), top)


def one_line(s: dict) -> str:
    """The log line: window, device busy / idle, the top kernel."""
    its = s["iterations"]
    head = f"profile of iterations {its[0]}-{its[-1]}: {s['window_ms']:.1f} ms"
    if s["device_idle_fraction"] is None:
        return head + "; no device events in the trace (a host-only backend)"
    k = s["top_kernels"][0] if s["top_kernels"] else None
    top = f"; top kernel {k['name'][:60]} x{k['calls']} {k['total_ms']:.1f} ms" if k else ""
    g = s.get("idle_gaps") or {}
    short = sum(v["ms"] for k, v in g.items() if k in ("under_10us", "under_100us"))
    long_ = g.get(f"over_{int(GAP_BINS_US[-1])}us", {}).get("ms", 0.0)
    return (head + f", device busy {s['device_busy_ms']:.1f} ms, idle {100 * s['device_idle_fraction']:.1f}%"
            f" ({s['device_events']} device events; idle in gaps under 100 us {short:.1f} ms, over 1 ms "
            f"{long_:.1f} ms){top}")
