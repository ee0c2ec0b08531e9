"""Steps of a forward that can interleave with another micro-batch's (``--overlap-moe-expert-parallel-comm``).

A *steps* generator runs a forward up to the point where it has issued an asynchronous all-to-all, yields,
and on resumption waits for it and goes on; its return value is the forward's result. :func:`drive` runs
one to its end (nothing between issue and wait: the plain forward); :func:`interleave` advances several
round-robin, so one micro-batch's dispatch or combine is in flight while the next one computes its
attention, router or experts. The order of collectives is the same on every rank (the round-robin is
fixed), which is all NCCL's ordering asks.
"""
from __future__ import annotations

from typing import Generator, TypeVar

T = TypeVar("T")
Steps = Generator[None, None, T]


def drive(steps: Steps[T]) -> T:
    """Run ``steps`` to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def interleave(all_steps: list[Steps]) -> list:
    """Advance every generator one step in turn until all have returned; their return values, in order."""
    results, live = [None] * len(all_steps), list(range(len(all_steps)))
    while live:
        for i in list(live):
            try:
                next(all_steps[i])
            except StopIteration as stop:
                results[i] = stop.value
                live.remove(i)
    return results
