"""Straggler detection: Megatron's ``--log-straggler`` and ``--straggler-minmax-count``.

A slow rank does not show in the step time: every collective makes the others wait for it, so all ranks end
their steps together. What differs is the time a rank spends computing. Each rank sums its own compute spans
per step (the pipeline runtime's forward and backward actions, host clock; the waits for pipeline messages lie
between spans and are excluded) and its step time; every ``--log-interval`` iterations the per-iteration means
are all-gathered (one float64 all-gather over the world) and every rank gets a score, its compute time over
the median rank's: 1.0 is typical, 1.5 computes 50% longer. The ``--straggler-minmax-count`` highest scores are
named slowest first, the same number of lowest fastest.

What the spans include: a tensor-, context- or expert-parallel collective inside a layer runs within its
forward or backward span, so under those layouts a slow rank's group peers wait inside their spans and score
close to it: the slow group is found, and within it the rank with the highest score. On devices with
asynchronous streams the host clock times kernel launches, not kernels: there the score finds host-side
stragglers only (the backend says so once at start). Megatron's detector times GEMM kernels with device events
and also reports power, temperature and clocks, which omnitron's backend contract does not carry.

metrics.jsonl fields (global rank 0 writes them on logged iterations): ``straggler_scores`` (one per rank),
``straggler_compute_ranks_ms``, ``straggler_forward_ranks_ms``, ``straggler_backward_ranks_ms``,
``straggler_step_ranks_ms`` (ms per iteration, one per rank), ``straggler_slowest_ranks``,
``straggler_fastest_ranks``; and the scalars TensorBoard plots too: ``straggler_max_score``,
``straggler_slowest_rank``.
"""
from __future__ import annotations

import logging
import statistics

import torch

log = logging.getLogger("omnitron.train")

SECTIONS = ("step", "compute", "forward", "backward")
"""What each rank reports, per iteration: its step, its compute spans in all, its forward and its backward
(with weight-gradient) spans."""


def scores(compute_ms: list[float]) -> list[float]:
    """Each rank's compute time over the median rank's (1.0 when every rank computed nothing)."""
    mid = statistics.median(compute_ms)
    return [v / mid if mid > 0 else 1.0 for v in compute_ms]


def straggler_fields(table: dict[str, list[float]], count: int) -> tuple[dict, str]:
    """metrics.jsonl fields and the log line of one report; ``table``: section -> ms per iteration per rank."""
    sc = scores(table["compute"])
    order = sorted(range(len(sc)), key=lambda r: (-sc[r], r))  # slowest first; ties: lower rank first
    k = min(count, len(sc))
    fields = {"straggler_scores": sc, **{f"straggler_{s}_ranks_ms": table[s] for s in SECTIONS},
              "straggler_slowest_ranks": order[:k], "straggler_fastest_ranks": order[::-1][:k],
              "straggler_max_score": sc[order[0]], "straggler_slowest_rank": order[0]}

    def name(r: int) -> str:
        return f"rank {r} {table['compute'][r]:.1f} ms (x{sc[r]:.2f})"

    line = (f"stragglers (compute per iteration, x median): slowest {', '.join(name(r) for r in order[:k])} | "
            f"fastest {', '.join(name(r) for r in order[::-1][:k])} | step {min(table['step']):.1f}-"
            f"{max(table['step']):.1f} ms")
    return fields, line


class StragglerDetector:
    """Accumulates this rank's step and compute times; :meth:`report` gathers and scores them (collective over
    the world). ``collectives``: the backend's (None in a one-process run)."""

    def __init__(self, *, world_size: int, collectives, device, minmax_count: int, host_clock_only: bool,
                 rank: int) -> None:
        self.world_size, self.collectives, self.device, self.count = world_size, collectives, device, minmax_count
        self._sums = dict.fromkeys(SECTIONS, 0.0)
        self._n = 0
        if host_clock_only and rank == 0:
            log.info("--log-straggler: this device runs kernels asynchronously; compute spans time their launch "
                     "on the host, so the scores find host-side stragglers only")

    def record(self, step_s: float, sections: dict[str, float] | None) -> None:
        """One step: its wall time and its compute sections (None: the step recorded no spans)."""
        sections = sections or {"forward": 0.0, "backward": 0.0}
        self._sums["step"] += step_s
        self._sums["compute"] += sections["forward"] + sections["backward"]
        for s in ("forward", "backward"):
            self._sums[s] += sections[s]
        self._n += 1

    def report(self) -> tuple[dict, str]:
        """Gather every rank's means since the last report, reset, and return :func:`straggler_fields`."""
        n = max(self._n, 1)
        local = torch.tensor([self._sums[s] * 1e3 / n for s in SECTIONS], dtype=torch.float64)
        self._sums, self._n = dict.fromkeys(SECTIONS, 0.0), 0
        if self.world_size > 1:
            flat = torch.empty(self.world_size * len(SECTIONS), dtype=torch.float64, device=self.device)
            self.collectives.all_gather(flat, local.to(self.device))
            rows = flat.cpu().view(self.world_size, len(SECTIONS))
        else:
            rows = local.view(1, -1)
        table = {s: rows[:, j].tolist() for j, s in enumerate(SECTIONS)}
        return straggler_fields(table, self.count)
