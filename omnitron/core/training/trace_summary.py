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


def _union_us(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Total length of the union of ``[start, end)`` intervals, clipped to ``[lo, hi)``."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def summarize(trace: dict, top: int = 10) -> dict:
    """The summary of a loaded Chrome trace: ``window_ms``, ``device_busy_ms``, ``device_idle_fraction``
    (None when the trace has no device events: a host-only backend), ``iterations``, ``top_kernels``
    (name, calls, total ms, share of busy time)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    spans = [e for e in events if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("iteration ")]
    if not spans:
        raise ValueError("trace has no 'iteration N' spans: it was not written by --profile's step profiler")
    lo = min(float(e["ts"]) for e in spans)
    hi = max(float(e["ts"]) + float(e["dur"]) for e in spans)
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    out = {"iterations": sorted(int(e["name"].split()[1]) for e in spans), "window_ms": (hi - lo) / 1e3,
           "device_events": len(device), "device_busy_ms": None, "device_idle_fraction": None, "top_kernels": []}
    if not device:
        return out
    busy = _union_us([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in device], lo, hi)
    out["device_busy_ms"] = busy / 1e3
    out["device_idle_fraction"] = 1.0 - busy / (hi - lo) if hi > lo else None
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
    return (head + f", device busy {s['device_busy_ms']:.1f} ms, idle {100 * s['device_idle_fraction']:.1f}%"
            f" ({s['device_events']} device events){top}")
