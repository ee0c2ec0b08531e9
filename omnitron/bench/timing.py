"""Device-synchronized timing: the median of rounds after a warm-up, stopping early on a time budget."""
from __future__ import annotations

import statistics
import time


def median_ms(fn, backend, *, rounds: int = 10, warmup: int = 2, budget_s: float = 2.0,
              slow_once: bool = False) -> float:
    """Median wall time of ``fn()`` in ms, the device synchronized around each call (at least 3 rounds).
    ``slow_once``: a call longer than the budget gets one warm-up and one timed round (a 2048-cubed fp16 GEMM
    on a CPU without fp16 kernels takes about a minute a call: 5 calls were 340 s of ``bench all``'s 457 s on
    2026-12-03). Only for single-process timing: ranks timing a collective must make the same calls."""
    start = time.perf_counter()
    for _ in range(warmup):
        fn()
        if slow_once and time.perf_counter() - start > budget_s:
            break
    backend.synchronize()
    times, start = [], time.perf_counter()
    while len(times) < rounds and (len(times) < 3 or time.perf_counter() - start < budget_s):
        if slow_once and times and times[0] > budget_s:
            break
        t0 = time.perf_counter()
        fn()
        backend.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3
