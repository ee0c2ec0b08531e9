"""Phase timers and the profiler window: Megatron's ``--timing-log-level``, ``--timing-log-option``,
``--barrier-with-L1-time`` and ``--profile``, with no globals (the loop builds one :class:`Timers` per run
and passes it to the step).

Levels (Megatron's): 0 — the whole step and checkpoint saves only, nothing added inside the step;
1 — phases that run once per step; 2 — phases that run many times per step (:data:`TIMER_LEVELS`).
A timer above the chosen level is a no-op object, so an unchosen level costs nothing.

A timer's start and stop call ``backend.synchronize()``: the interval covers the device work queued
inside it, not only its launch (free on a synchronous device). With ``--barrier-with-L1-time``
(Megatron's default) a level-1 timer starts after a barrier of every rank, so a rank's phase time
does not include waiting for a slower rank to arrive.

Times are summed over the iterations since the previous log line and divided by their number (ms per
iteration; ``save-checkpoint``: ms in total), then gathered from every rank by :meth:`Timers.reduce`
(a collective of the whole world).
"""
from __future__ import annotations

import contextlib
import logging
import json
import math
import os
import time
from typing import Iterator

import torch

log = logging.getLogger("omnitron.train")

TIMER_LEVELS = {
    "train-step": 0,            # the whole train_step (what step_time_s measures on rank 0)
    "save-checkpoint": 0,       # checkpointing.save, in total (not per iteration)
    "forward-backward": 1,      # the pipeline schedule: every forward and backward of the step
    "all-grads-sync": 1,        # gradient reduction after the micro-batches (finalize_model_grads)
    "optimizer": 1,             # the optimizer step: unscale, norms, clip, update, copy into the model
    "optimizer-copy-main-to-model-params": 1,  # replicated optimizer: fp32 masters into the model
    "params-all-gather": 1,     # distributed optimizer: slices into the model + all-gather (launch only
                                # with --overlap-param-gather; its waits fall in forward-backward)
    "batch-generator": 2,       # drawing (and moving) each micro-batch
    "forward-compute": 2,       # pipeline forward actions (host clock; synchronous devices only)
    "backward-compute": 2,      # pipeline backward and weight-gradient actions (idem)
    "pipeline-wait": 2,         # forward-backward minus compute: receive waits, sends, loss all-reduce (pp > 1)
}
"""Every timer name and its level; the names :meth:`Timers.reduce` gathers are those at or below the run's."""

PER_RUN = ("save-checkpoint",)
"""Timers reported in total over the interval, not per iteration."""

TIMING_LOG_OPTIONS = ("max", "minmax", "all")


class Timer:
    """One named timer: ``start``/``stop`` pairs (or ``add``) accumulate seconds until :meth:`take`."""

    def __init__(self, name: str, sync, barrier=None) -> None:
        self.name, self._sync, self._barrier = name, sync, barrier
        self._t0: float | None = None
        self._seconds = 0.0
        self._ran = False

    def start(self) -> None:
        if self._t0 is not None:
            raise RuntimeError(f"timer {self.name!r} started twice; stop it first")
        if self._barrier is not None:
            self._barrier()
        self._sync()
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        """Stop; returns the seconds of this interval."""
        if self._t0 is None:
            raise RuntimeError(f"timer {self.name!r} stopped without being started")
        self._sync()
        seconds = time.perf_counter() - self._t0
        self._t0 = None
        self.add(seconds)
        return seconds

    def add(self, seconds: float) -> None:
        """Count ``seconds`` measured elsewhere (a derived phase)."""
        self._seconds += seconds
        self._ran = True

    def take(self) -> float | None:
        """Seconds accumulated since the last take (None when it never ran), and reset."""
        out = self._seconds if self._ran else None
        self._seconds, self._ran = 0.0, False
        return out


class _NullTimer:
    """A timer above the log level: every method does nothing."""

    def start(self) -> None:
        pass

    def stop(self) -> float:
        return 0.0

    def add(self, seconds: float) -> None:
        pass


class Timers:
    """The run's timers. ``timers(name)`` is the named timer, or a no-op when its level is above
    ``log_level`` (-1 turns every timer off). ``world_size > 1`` needs the default process group."""

    def __init__(self, backend=None, *, log_level: int = 0, log_option: str = "minmax", barrier_with_l1: bool = True,
                 world_size: int = 1) -> None:
        if log_option not in TIMING_LOG_OPTIONS:
            raise ValueError(f"timing log option {log_option!r} is not one of {', '.join(TIMING_LOG_OPTIONS)}")
        self.backend, self.log_level, self.log_option = backend, log_level, log_option
        self.barrier_with_l1, self.world_size = barrier_with_l1, world_size
        self._timers: dict[str, Timer] = {}

    @classmethod
    def disabled(cls) -> "Timers":
        return cls(log_level=-1)

    def enabled(self, name: str) -> bool:
        if name not in TIMER_LEVELS:
            raise KeyError(f"unknown timer {name!r}; add it to TIMER_LEVELS with its level")
        return TIMER_LEVELS[name] <= self.log_level

    def __call__(self, name: str):
        if not self.enabled(name):
            return _NullTimer()
        if name not in self._timers:
            barrier = None
            if TIMER_LEVELS[name] == 1 and self.barrier_with_l1 and self.world_size > 1:
                barrier = self.backend.collectives.barrier
            self._timers[name] = Timer(name, self.backend.synchronize, barrier)
        return self._timers[name]

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the enclosed block as ``name`` (not stopped when the block raises)."""
        timer = self(name)
        timer.start()
        yield
        timer.stop()

    def timed_iterator(self, name: str, iterator: Iterator | None) -> Iterator | None:
        """``iterator`` with each ``next`` timed as ``name`` (unchanged when that timer is off)."""
        if iterator is None or not self.enabled(name):
            return iterator
        return _TimedIterator(iterator, self(name))

    def names(self) -> list[str]:
        """The timers this run reports, in :data:`TIMER_LEVELS` order (the same on every rank)."""
        return [n for n in TIMER_LEVELS if self.enabled(n)]

    def reduce(self, iterations: int) -> dict[str, list[float | None]]:
        """``{name: [ms on rank 0, ms on rank 1, ...]}`` since the last reduce (per iteration over
        ``iterations``, except :data:`PER_RUN` ones); None where a rank did not run the timer. Timers that
        ran on no rank are left out. Collective over the world; resets every timer."""
        names = self.names()
        if not names:
            return {}
        taken = [self._timers[n].take() if n in self._timers else None for n in names]
        local = torch.tensor([math.nan if s is None else s for s in taken], dtype=torch.float64)
        if self.world_size > 1:
            device = self.backend.current_device()
            flat = torch.empty(self.world_size * len(names), dtype=torch.float64, device=device)
            self.backend.collectives.all_gather(flat, local.to(device))
            table = flat.cpu().view(self.world_size, len(names))
        else:
            table = local.view(1, -1)
        out = {}
        for j, name in enumerate(names):
            scale = 1e3 / (1 if name in PER_RUN else max(iterations, 1))
            col = [None if math.isnan(v) else v * scale for v in table[:, j].tolist()]
            if any(v is not None for v in col):
                out[name] = col
        return out


class _TimedIterator:
    """Iterator wrapper that times every ``next`` (the data loader's share of the step)."""

    def __init__(self, iterator: Iterator, timer: Timer) -> None:
        self.iterator, self.timer = iterator, timer

    def __iter__(self):
        return self

    def __next__(self):
        self.timer.start()
        try:
            return next(self.iterator)
        finally:
            self.timer.stop()


def record_compute_split(timers: Timers, timeline: list, forward_backward_s: float, pipelined: bool) -> None:
    """Level-2 split of one step's forward-backward from the pipeline runtime's compute spans
    (``(start, end, action)`` host-clock seconds): forward, backward (+ weight-gradient) compute and,
    with ``pipelined``, the rest (receive waits and sends). Host clocks measure device work only on
    synchronous devices; the caller passes a timeline only there."""
    sec = compute_sections(timeline)
    timers("forward-compute").add(sec["forward"])
    timers("backward-compute").add(sec["backward"])
    if pipelined:
        timers("pipeline-wait").add(max(forward_backward_s - sec["forward"] - sec["backward"], 0.0))


def compute_sections(timeline: list) -> dict[str, float]:
    """Seconds of forward and of backward (with weight-gradient) compute in one step's runtime spans
    ``(start, end, action)``. A combined pair's span (``0F2&0B1``, --overlap-moe-expert-parallel-comm: the two
    passes run in turns) counts as forward: its parts are not timed apart."""
    fwd = sum(e - s for s, e, a in timeline if "F" in a)
    return {"forward": fwd, "backward": sum(e - s for s, e, a in timeline if "F" not in a)}


def timer_fields(per_rank: dict[str, list[float | None]], option: str) -> dict:
    """metrics.jsonl fields: ``timers_<name>_ms`` (max over ranks); ``minmax`` and ``all`` add
    ``timers_<name>_min_ms``; ``all`` adds ``timers_<name>_ranks_ms`` (one value per rank, None where it did not
    run)."""
    out = {}
    for name, col in per_rank.items():
        key = "timers_" + name.replace("-", "_")
        ran = [v for v in col if v is not None]
        out[key + "_ms"] = max(ran)
        if option in ("minmax", "all"):
            out[key + "_min_ms"] = min(ran)
        if option == "all":
            out[key + "_ranks_ms"] = col
    return out


def format_timers(per_rank: dict[str, list[float | None]], option: str) -> str:
    """One log line: ``timers (ms, min/max over ranks): forward-backward 12.1/12.6 | ...`` (``-``: did not run)."""
    what = {"max": "max over ranks", "minmax": "min/max over ranks", "all": "rank 0/rank 1/..."}[option]
    parts = []
    for name, col in per_rank.items():
        ran = [v for v in col if v is not None]
        if option == "max":
            parts.append(f"{name} {max(ran):.2f}")
        elif option == "minmax":
            parts.append(f"{name} {min(ran):.2f}/{max(ran):.2f}")
        else:
            parts.append(f"{name} " + "/".join("-" if v is None else f"{v:.2f}" for v in col))
    return f"timers (ms, {what}): " + " | ".join(parts)


class StepProfiler:
    """torch.profiler over iterations ``start + 1`` .. ``end`` (Megatron's ``--profile-step-start`` /
    ``--profile-step-end`` count completed iterations) on the ranks in ``ranks``. Each traced step is a
    ``record_function("iteration N")`` span; the Chrome trace goes to ``<log_dir>/profile/`` when the
    window closes (or the run ends inside it). ``activities``: the backend's :meth:`profiler_activities`."""

    def __init__(self, *, enabled: bool, start: int, end: int, activities, log_dir: str, rank: int) -> None:
        self.enabled, self.start, self.end = enabled, start, end
        self.activities, self.log_dir, self.rank = activities, log_dir, rank
        self._prof = None
        self._first: int | None = None
        self._last: int | None = None
        self.trace_path: str | None = None
        self.summary_path: str | None = None

    @contextlib.contextmanager
    def step(self, iteration: int) -> Iterator[None]:
        """Run training iteration ``iteration`` (1-based), traced when it lies in the window."""
        if not self.enabled or not self.start < iteration <= self.end:
            yield
            return
        if self._prof is None:
            from torch.profiler import profile

            self._prof = profile(activities=list(self.activities), record_shapes=False)
            self._prof.start()
            self._first = iteration
        from torch.profiler import record_function

        with record_function(f"iteration {iteration}"):
            yield
        self._last = iteration
        if iteration == self.end:
            self.close()

    def close(self) -> None:
        """Stop the profiler (if running) and write its Chrome trace."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.stop()
        if self._last is None:
            return
        folder = os.path.join(self.log_dir, "profile")
        os.makedirs(folder, exist_ok=True)
        self.trace_path = os.path.join(folder, f"trace_rank{self.rank}_iters{self._first}-{self._last}.json")
        prof.export_chrome_trace(self.trace_path)
        log.info("rank %d: profiler trace of iterations %d-%d written to %s", self.rank, self._first, self._last,
                 self.trace_path)
        self._summarize()

    def _summarize(self) -> None:
        """Device busy / idle over the window and the top kernels, logged and written beside the trace
        (``summary_rank<r>.json``); a trace it cannot read costs a warning, never the run."""
        from omnitron.core.training import trace_summary

        try:
            summary = trace_summary.summarize_file(self.trace_path, top=60)
        except (OSError, ValueError, KeyError) as err:
            log.warning("rank %d: could not summarise %s: %s", self.rank, self.trace_path, err)
            return
        self.summary_path = os.path.join(os.path.dirname(self.trace_path), f"summary_rank{self.rank}.json")
        with open(self.summary_path, "w") as f:
            json.dump(summary, f, indent=1)
        log.info("rank %d: %s", self.rank, trace_summary.one_line(summary))
