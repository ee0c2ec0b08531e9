"""Device-synchronized timing: the median of rounds after a warm-up, stopping early on a time budget."""
from __future__ import annotations

import statistics
import time


def median_ms(fn, backend, *, rounds: int = 10, warmup: int = 2, budget_s: float = 2.0) -> float:
    """Median wall time of ``fn()`` in ms, the device synchronized around each call (at least 3 rounds)."""
    for _ in range(warmup):
        fn()
    backend.synchronize()
    times, start = [], time.perf_counter()
    while len(times) < rounds and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        backend.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3
