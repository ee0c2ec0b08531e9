"""Execute a :class:`Schedule` on an ideal timeline, without processes.

Models the runtime exactly: each rank runs its table in order, sends are asynchronous and an
action waits only for the message it consumes (activation from the previous stage for ``F``,
gradient from the next stage for ``B``), which arrives a transfer time after the sender's action ends
(zero unless given); a combined pair (``combined.py``) waits for both and both its outputs leave at its end.
Used by the unit tests (every micro-batch once per stage, dependencies, deadlock, peak activations) and by the
bubble benchmark's theory column.
"""
from __future__ import annotations

from array import array
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
                        raise ScheduleError(f"rank {r}: {c}{kind}{i} appears {counts[(kind, c, i)]} times, expected "
                                            "once")
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
             transfer: Callable[[int, str], float] | None = None,
             pair_credit: Callable[[int, int], float] | None = None) -> Timeline:
    """Run the tables on an ideal clock; raise :class:`ScheduleError` on deadlock.

    ``cost`` gives per-action durations for one chunk: ``F``, ``B`` (input grad), ``W``; an
    unsplit backward costs ``B + W``. Defaults 1, 1, 1 (backward twice a forward).
    ``stage_cost(stage, kind)`` (kind ``F``, ``B``, ``W`` or ``BW`` for an unsplit backward)
    overrides them per virtual stage. ``complete=False`` accepts partial tables (forward-only).
    ``transfer(stage, kind)``: seconds from the end of that stage's ``F`` (``B``) until its output reaches the
    next (previous) stage, for sends that overlap the sender's next work (a blocking send's time belongs in the
    sender's own cost instead); a stage's own ``F`` / ``B`` reach its ``B`` / ``W`` at once.
    ``pair_credit(forward's stage, backward's stage)``: seconds a combined pair (``combined.py``) takes less than its
    two actions one after the other (the communication each hides behind the other's compute), at most the
    backward's own duration; taken off the pair's backward, so the pair ends that much earlier.

    Each action starts when its rank's previous one ends and its input has arrived, so the clock is a
    longest-path walk over the tables: a rank runs until it waits for an output not yet produced, and is run
    again when that output is (the planner's search simulates thousands of tables of tens of thousands of actions).
    """
    if complete:
        check_complete(schedule)
    c = _compiled(schedule)
    cost = {"F": 1.0, "B": 1.0, "W": 1.0, **(cost or {})}
    dur = [0.0] * (4 * schedule.num_stages)
    for slot in c.slots:
        k, code = divmod(slot, 4)
        kind = _CODES[code]
        if stage_cost is not None:
            dur[slot] = stage_cost(k, kind)
        else:
            dur[slot] = cost["B"] + cost["W"] if kind == "BW" else cost[kind]
    hop = [0.0] * (2 * schedule.num_stages)
    if transfer is not None:
        for h in c.hops:
            hop[h] = transfer(h // 2, "FB"[h % 2])
    return _run(schedule, c, dur, hop, pair_credit if schedule.combined else None)


_KINDS = {"F": 0, "B": 1, "W": 2}
_CODES = ("F", "B", "W", "BW")


@dataclass(frozen=True)
class _Compiled:
    """A schedule's tables as integer arrays (:func:`_compiled`), per rank and indexed like its table: each action's
    duration slot (``4 stage + code``: F 0, B 1, W 2, an unsplit backward 3), the finish key it waits for (-1: none;
    a key numbers (kind, virtual stage, micro-batch)) and that input's transfer slot (``2 stage + (kind is B)``, -1:
    none) and its own finish key. A step is one action, or a combined pair (``combined.py``): ``starts`` gives each
    step's first index and, last, the table's length (None: every step one action). The micro-batches a rank holds
    change in its table's order whatever the clock, so their peaks are found here. Arrays of C ints: a search keeps
    hundreds of compiled tables of up to 10^5 actions."""

    tables: tuple[tuple, ...]
    """The tables compiled (held, so that a table replaced is never mistaken for them)."""
    starts: tuple[array | None, ...]
    slot: tuple[array, ...]
    need: tuple[array, ...]
    hop: tuple[array, ...]
    out: tuple[array, ...]
    peak_held: tuple[int, ...]
    """Most micro-batches (summed over chunks) each rank holds between F and the end of its weight gradient."""
    peak_before: tuple[int, ...]
    """Most micro-batches each rank holds between F and B."""
    slots: tuple[int, ...]
    """Every duration slot the tables use."""
    hops: tuple[int, ...]
    """Every transfer slot the tables use."""


def _compiled(schedule: Schedule) -> _Compiled:
    """The integer form of ``schedule``'s tables, built once per schedule object (kept on it, checked against its
    tables by identity: a table replaced is compiled again)."""
    tables = tuple(schedule.tables[r] for r in range(schedule.pp))
    c = getattr(schedule, "_simulate_compiled", None)
    if c is None or any(a is not b for a, b in zip(c.tables, tables)):
        c = _compile(schedule, tables)
        object.__setattr__(schedule, "_simulate_compiled", c)  # a cache, not state: the tables are unchanged
    return c


def _compile(schedule: Schedule, tables: tuple[tuple, ...]) -> _Compiled:
    """:class:`_Compiled` of ``tables`` (the schedule's), each action's dependency as :func:`_need` names it."""
    s, m = schedule.num_stages, schedule.num_microbatches
    cols = {name: [] for name in ("starts", "slot", "need", "hop", "out", "peak_held", "peak_before")}
    slots, hops = set(), set()
    for r in range(schedule.pp):
        table, split = tables[r], schedule.split_backward(r)
        col = {name: array("i") for name in ("starts", "slot", "need", "hop", "out")}
        held = before = peak_held = peak_before = 0
        for i, a in enumerate(table):
            # a combined pair (combined.py) is one step: both inputs in, both outputs out at its end
            if not (i and schedule.combined and schedule.paired(r, i - 1)):
                col["starts"].append(i)
            k = schedule.stage(r, a.chunk)
            unsplit = a.kind == "B" and (a.chunk, a.microbatch) not in split
            col["slot"].append(4 * k + (3 if unsplit else _KINDS[a.kind]))
            x = _need(schedule, r, a)
            h = 2 * x[1] + (x[0] == "B") if x is not None and x[1] != k else -1
            col["need"].append(-1 if x is None else (_KINDS[x[0]] * s + x[1]) * m + x[2])
            col["hop"].append(h)
            col["out"].append((_KINDS[a.kind] * s + k) * m + a.microbatch)
            held += 1 if a.kind == "F" else -1 if a.kind == "W" or unsplit else 0
            before += 1 if a.kind == "F" else -1 if a.kind == "B" else 0
            peak_held, peak_before = max(peak_held, held), max(peak_before, before)
        col["starts"].append(len(table))
        slots.update(col["slot"])
        hops.update(h for h in col["hop"] if h >= 0)
        if len(col["starts"]) == len(table) + 1:
            col["starts"] = None
        for name, v in col.items():
            cols[name].append(v)
        cols["peak_held"].append(peak_held)
        cols["peak_before"].append(peak_before)
    return _Compiled(tables, **{k: tuple(v) for k, v in cols.items()}, slots=tuple(sorted(slots)),
                     hops=tuple(sorted(hops)))


def _run(schedule: Schedule, c: _Compiled, dur: list[float], hop: list[float], credit=None) -> Timeline:
    """The walk of :func:`simulate` over the compiled tables with durations ``dur``, transfers ``hop`` and each
    combined pair's ``credit`` (:func:`simulate`'s ``pair_credit``)."""
    pp = schedule.pp
    finish: list[float | None] = [None] * (3 * schedule.num_stages * schedule.num_microbatches)
    waiting: dict[int, list[int]] = {}  # finish key -> ranks stopped at a step that needs it
    pos, clock = [0] * pp, [0.0] * pp
    durs = [[dur[x] for x in c.slot[r]] for r in range(pp)]
    for r in range(pp) if credit is not None else ():
        table = schedule.tables[r]
        for i in schedule.pairs.get(r, ()):
            f, b = schedule.stage(r, table[i].chunk), schedule.stage(r, table[i + 1].chunk)
            durs[r][i + 1] -= min(credit(f, b), durs[r][i + 1])
    extra = [[hop[x] if x >= 0 else 0.0 for x in c.hop[r]] for r in range(pp)]
    tl = Timeline(spans={r: [] for r in range(pp)})
    ready = list(range(pp - 1, -1, -1))
    while ready:
        r = ready.pop()
        table, spans = schedule.tables[r], tl.spans[r]
        if c.starts[r] is not None:
            pos[r], clock[r] = _walk_steps(r, pos[r], clock[r], table, c, durs[r], extra[r], finish, waiting, ready,
                                           spans)
            continue
        # every step one action: the rank runs until an action waits for an output not yet produced
        need, out, dr, ex, append = c.need[r], c.out[r], durs[r], extra[r], spans.append
        i, t, n = pos[r], clock[r], len(table)
        while i < n:
            begin = t
            key = need[i]
            if key >= 0:
                end = finish[key]
                if end is None:
                    waiting.setdefault(key, []).append(r)
                    break
                end += ex[i]
                if end > begin:
                    begin = end
            t = begin + dr[i]
            append((begin, t, table[i]))
            key = out[i]
            finish[key] = t
            if key in waiting:
                ready.extend(waiting.pop(key))
            i += 1
        pos[r], clock[r] = i, t
    n = [len(schedule.tables[r]) if c.starts[r] is None else len(c.starts[r]) - 1 for r in range(pp)]
    stuck = {r: str(schedule.tables[r][pos[r] if c.starts[r] is None else c.starts[r][pos[r]]]) for r in range(pp)
             if pos[r] < n[r]}
    if stuck:
        raise ScheduleError(f"deadlock: ranks wait forever at {stuck}\n{schedule.format()}")
    tl.peak_inflight, tl.peak_before_backward = dict(enumerate(c.peak_held)), dict(enumerate(c.peak_before))
    return tl


def _walk_steps(r, p, t, table, c, durs, extra, finish, waiting, ready, spans) -> tuple[int, float]:
    """Rank ``r``'s steps from ``p`` at clock ``t`` until one waits for an output not yet produced (registered in
    ``waiting``), a step being one action or a combined pair's two (both in, both out at the pair's end). Returns
    the rank's next step and clock."""
    starts, need, out = c.starts[r], c.need[r], c.out[r]
    while p < len(starts) - 1:
        i0, i1 = starts[p], starts[p + 1]
        begin = t
        for i in range(i0, i1):
            key = need[i]
            if key < 0:
                continue
            end = finish[key]
            if end is None:
                waiting.setdefault(key, []).append(r)
                return p, t
            end += extra[i]
            if end > begin:
                begin = end
        t = begin
        for i in range(i0, i1):
            begin, t = t, t + durs[i]
            spans.append((begin, t, table[i]))
        for i in range(i0, i1):
            finish[out[i]] = t
            if out[i] in waiting:
                ready.extend(waiting.pop(out[i]))
        p += 1
    return p, t


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
