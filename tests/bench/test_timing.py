"""bench timing: a call slower than the budget is not repeated five times when the caller allows it."""
from __future__ import annotations

import time
import types

from omnitron.bench.timing import median_ms


def _counted(seconds: float):
    calls = []

    def fn():
        calls.append(1)
        time.sleep(seconds)

    return fn, calls


def test_slow_call_is_timed_once_when_allowed():
    backend = types.SimpleNamespace(synchronize=lambda: None)
    fn, calls = _counted(0.03)
    ms = median_ms(fn, backend, rounds=10, budget_s=0.01, slow_once=True)
    assert len(calls) == 2 and 25 <= ms < 1000  # one warm-up, one timed round (the sleep, plus scheduling)
    fn, calls = _counted(0.03)
    median_ms(fn, backend, rounds=10, budget_s=0.01)
    assert len(calls) == 5  # the default (collectives): 2 warm-ups and 3 rounds on every rank alike
    fn, calls = _counted(0.0)
    median_ms(fn, backend, rounds=10, budget_s=5.0, slow_once=True)
    assert len(calls) == 12  # fast calls: every round
