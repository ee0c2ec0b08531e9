"""Execute a :class:`Schedule` on an ideal timeline, without processes.

Models the runtime exactly: each rank runs its table in order, sends are asynchronous and an
action waits only for the message it consumes (activation from the previous stage for ``F``,
gradient from the next stage for ``B``), which arrives a transfer time after the sender's action ends
(zero unless given); a combined pair (``combined.py``) waits for both and both its outputs leave at its end.
Used by the unit tests (every micro-batch once per stage, dependencies, deadlock, peak activations) and by the
bubble benchmark's theory column.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from omnitron.core.parallel.pipeline.actions import Action, Schedule


class ScheduleError(RuntimeError):
    """A table is incomplete, repeats work, breaks a dependency, or deadlocks."""


@dataclass
class Timeline:
    """Per-rank ``(start, end, action)`` spans, and derived figures."""

    spans: dict[int, list[tuple[float, float, Action]]] = field(default_factory=dict)
    peak_inflight: dict[int, int] = field(default_factory=dict)
    """Most micro-batches (summed over chunks) a rank held between F and the end of its weight gradient."""
    peak_before_backward: dict[int, int] = field(default_factory=dict)
    """Most micro-batches a rank held between F and B (input gradient)."""

    @property
    def makespan(self) -> float:
        return max(s[-1][1] for s in self.spans.values() if s)

    def bubble(self, rank: int) -> float:
        """Idle fraction of ``rank`` between time 0 and the end of the whole step."""
        busy = sum(e - s for s, e, _ in self.spans[rank])
        return 1.0 - busy / self.makespan


def check_complete(schedule: Schedule) -> None:
    """Every (chunk, micro-batch) has exactly one F and one B on every rank, at most one W after its B."""
    m, vp = schedule.num_microbatches, schedule.vp
    for r, table in schedule.tables.items():
        counts = Counter((a.kind, a.chunk, a.microbatch) for a in table)
        for c in range(vp):
            for i in range(m):
                for kind in "FB":
                    if counts[(kind, c, i)] != 1:
                        raise ScheduleError(f"rank {r}: {c}{kind}{i} appears {counts[(kind, c, i)]} times, expected once")
        extra = [k for k, n in counts.items() if k[0] == "W" and n != 1 or not (0 <= k[1] < vp and 0 <= k[2] < m)]
        if extra:
            raise ScheduleError(f"rank {r}: unexpected actions {extra}")
        pos = {(a.kind, a.chunk, a.microbatch): i for i, a in enumerate(table)}
        for (kind, c, i), p in pos.items():
            if kind == "B" and p < pos[("F", c, i)] or kind == "W" and p < pos[("B", c, i)]:
                raise ScheduleError(f"rank {r}: {c}{kind}{i} comes before the work it needs")


def _need(schedule: Schedule, rank: int, a: Action) -> tuple[str, int, int] | None:
    """The (kind, stage, micro-batch) whose end ``a`` waits for: the previous stage's F (forward), the next
    stage's B (backward; the loss on the last stage: its own F), its own B (weight gradient)."""
    k = schedule.stage(rank, a.chunk)
    if a.kind == "F":
        return ("F", k - 1, a.microbatch) if k > 0 else None
    if a.kind == "B":
        return ("B", k + 1, a.microbatch) if k < schedule.num_stages - 1 else ("F", k, a.microbatch)
    return ("B", k, a.microbatch)


def simulate(schedule: Schedule, cost: dict[str, float] | None = None,
             stage_cost: Callable[[int, str], float] | None = None, complete: bool = True,
             transfer: Callable[[int, str], float] | None = None) -> Timeline:
    """Run the tables on an ideal clock; raise :class:`ScheduleError` on deadlock.

    ``cost`` gives per-action durations for one chunk: ``F``, ``B`` (input grad), ``W``; an
    unsplit backward costs ``B + W``. Defaults 1, 1, 1 (backward twice a forward).
    ``stage_cost(stage, kind)`` (kind ``F``, ``B``, ``W`` or ``BW`` for an unsplit backward)
    overrides them per virtual stage. ``complete=False`` accepts partial tables (forward-only).
    ``transfer(stage, kind)``: seconds from the end of that stage's ``F`` (``B``) until its output reaches the
    next (previous) stage, for sends that overlap the sender's next work (a blocking send's time belongs in the
    sender's own cost instead); a stage's own ``F`` / ``B`` reach its ``B`` / ``W`` at once.
    """
    if complete:
        check_complete(schedule)
    cost = {"F": 1.0, "B": 1.0, "W": 1.0, **(cost or {})}
    pp = schedule.pp
    split = {r: schedule.split_backward(r) for r in range(pp)}
    finish: dict[tuple[str, int, int], float] = {}  # (kind, stage, mb) -> end time
    pos, clock = [0] * pp, [0.0] * pp
    tl = Timeline(spans={r: [] for r in range(pp)})
    held, peak, before_b, peak_b = [0] * pp, [0] * pp, [0] * pp, [0] * pp

    def duration(r: int, a: Action) -> float:
        unsplit = a.kind == "B" and (a.chunk, a.microbatch) not in split[r]
        if stage_cost is not None:
            return stage_cost(schedule.stage(r, a.chunk), "BW" if unsplit else a.kind)
        return cost["B"] + cost["W"] if unsplit else cost[a.kind]

    def arrival(x: tuple[str, int, int], k: int) -> float:  # when stage k has the output x it waits for
        return finish[x] + (transfer(x[1], x[0]) if transfer is not None and x[1] != k else 0.0)

    def account(r: int, a: Action) -> None:  # micro-batches held
        unsplit = a.kind == "B" and (a.chunk, a.microbatch) not in split[r]
        if a.kind == "F":
            held[r] += 1
            before_b[r] += 1
            peak[r], peak_b[r] = max(peak[r], held[r]), max(peak_b[r], before_b[r])
        if a.kind == "B":
            before_b[r] -= 1
        if a.kind == "W" or unsplit:
            held[r] -= 1

    while True:
        progressed = False
        for r in range(pp):
            table = schedule.tables[r]
            while pos[r] < len(table):
                # a combined pair (combined.py) is one action: both inputs in, both outputs out at its end
                n = 2 if schedule.combined and schedule.paired(r, pos[r]) else 1
                acts = table[pos[r]:pos[r] + n]
                needs = [(x, schedule.stage(r, a.chunk)) for a in acts if (x := _need(schedule, r, a)) is not None]
                if any(x not in finish for x, _ in needs):
                    break
                clock[r] = max([clock[r]] + [arrival(x, k) for x, k in needs])
                for a in acts:
                    begin, clock[r] = clock[r], clock[r] + duration(r, a)
                    tl.spans[r].append((begin, clock[r], a))
                    account(r, a)
                for a in acts:
                    finish[(a.kind, schedule.stage(r, a.chunk), a.microbatch)] = clock[r]
                pos[r] += n
                progressed = True
        if all(pos[r] == len(schedule.tables[r]) for r in range(pp)):
            break
        if not progressed:
            stuck = {r: str(schedule.tables[r][pos[r]]) for r in range(pp) if pos[r] < len(schedule.tables[r])}
            raise ScheduleError(f"deadlock: ranks wait forever at {stuck}\n{schedule.format()}")
    tl.peak_inflight, tl.peak_before_backward = dict(enumerate(peak)), dict(enumerate(peak_b))
    return tl


def theory_bubble(name: str, pp: int, m: int, vp: int = 1) -> float:
    """The textbook bubble fraction: 1F1B (p-1)/(m+p-1); interleaved (p-1)/(v*m+p-1);
    ZB-H1 (p-1)/(3m+p-1) with F = B = W (a third of 1F1B's idle time); ZB-V and DualPipeV
    (p-1)/(6m+p-1) in chunk passes (half a stage each): only the start-up of p-1 chunk forwards is idle
    (see ``vshape.py``; DualPipeV with m >= 2p)."""
    if name in ("none",) or pp == 1:
        return 0.0
    if name == "1f1b":
        return (pp - 1) / (m + pp - 1)
    if name == "interleaved":
        return (pp - 1) / (vp * m + pp - 1)
    if name == "zb-h1":
        return (pp - 1) / (3 * m + pp - 1)
    if name in ("zb-v", "dualpipe-v"):
        return (pp - 1) / (6 * m + pp - 1)
    raise ValueError(name)
