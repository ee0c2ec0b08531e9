"""Python garbage collection and the device allocator's cache around the steps (Megatron's ``--manual-gc``,
``--manual-gc-interval`` and ``--empty-unused-memory-level``).

Why: a collection of Python's cyclic garbage pauses the rank it happens on for as long as the heap takes to
walk; at scale the other ranks then wait for it at the next collective, at a different step each time.
With ``--manual-gc`` automatic collection is off during training and every rank collects at the same
iterations (each ``--manual-gc-interval``, and before validation and checkpoint saves). Releasing the
allocator's cached blocks (``--empty-unused-memory-level``: 1 after each step, 2 after validation too) trades
speed for memory other processes can use.
"""
from __future__ import annotations

import gc


class Housekeeping:
    """The run's collection and cache-release points (all no-ops when the flags are off)."""

    def __init__(self, training, backend) -> None:
        self.manual, self.interval = training.manual_gc, training.manual_gc_interval
        self.level, self.backend = training.empty_unused_memory_level, backend
        self._was_enabled = gc.isenabled()

    def start(self) -> None:
        if self.manual:
            gc.disable()
            gc.collect()

    def after_step(self, iteration: int) -> None:
        if self.level >= 1:
            self.backend.empty_cache()
        if self.manual and self.interval and iteration % self.interval == 0:
            gc.collect()

    def before_eval_or_save(self) -> None:
        if self.manual:
            gc.collect()

    def after_eval(self) -> None:
        if self.level >= 2:
            self.backend.empty_cache()

    def close(self) -> None:
        if self.manual and self._was_enabled:
            gc.enable()
