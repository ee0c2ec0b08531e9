"""The V-shaped schedules: two chunks per rank, chunk 0 = stage ``r``, chunk 1 = stage ``2p - 1 - r``.

Both split the backward into B (input gradient) and W (weight gradient) and leave the W passes to fill
the gaps, as ZB-H1 does; the V puts the first and the last stage on rank 0, so a micro-batch turns at
rank ``p - 1`` without communication and every rank's work is balanced at ``2m`` chunk passes of each kind.

* ``zb-v`` (Qi et al., "Zero Bubble Pipeline Parallelism", section 6): list-scheduled on an ideal clock: a
  warm-up of forwards, then F and B one after the other (1F1B), W passes filling the gaps and forced by a cap on
  the chunk activations held between F and W (the B's W inputs counted).
* ``dualpipe-v`` (DeepSeek's DualPipe cut in half, as torchtitan and FlagScale ship it): the published
  eight phases: warm-up forwards of chunk 0, pairs of chunk-0 / chunk-1 forwards, zero-bubble chunk-1
  backwards, then the steady state of two "overlapped" pairs per micro-batch (F of chunk 0 with B of
  chunk 1, F of chunk 1 with B of chunk 0), and a cool-down whose second half splits B and W.

DualPipeV's overlapped pairs (forward of one micro-batch, backward of another: ``Schedule.pairs``) are two
consecutive table entries that the runtime overlaps as DualPipe does with communication: the backward's
receive is posted before the forward computes and waited after it, the forward's send is posted before the
backward computes and waited after it (``p2p.py``; order recorded in ``tests/parallel/test_pipeline_overlap.py``).
Unlike DualPipe, which waits for both receives before the pair, the forward does not wait for the backward's
input, so the pair costs no bubble on the ideal clock; for that reason the last rank's first steady-state forward
and backward are a pair here too, which DualPipeV runs unpaired (the one difference from its order and pairs:
``tests/parallel/test_vshape_reference.py``; the combined clock is the same either way). NOTE: the two passes'
compute runs one after the other (MoE all-to-all inside a pair is not overlapped with the other pass:
``--overlap-moe-expert-parallel-comm`` pairs forwards without pipelining only).

Ideal clock with chunk passes F = B = W = 1 (stage 0: B = 0, W = 2, see ``zb_stage_cost``): rank
``p - 1`` cannot start before ``p - 1`` forwards have run and every rank has ``6m`` units of work, so the
step takes at least ``6m + p - 1`` units; both schedules reach it (dualpipe-v at its m >= 2p; zb-v at
m >= p, p = 2 ... 16): bubble ``(p - 1) / (6m + p - 1)`` (``theory_bubble``), half of ZB-H1's idle time in the
same units of model work.
"""
from __future__ import annotations

from typing import Callable

from omnitron.core.config.parallel import ConfigError
from omnitron.core.parallel.pipeline.actions import Action, Schedule, _check, virtual_stage, zb_stage_cost
from omnitron.core.parallel.pipeline.simulate import simulate


class _VClock:
    """List scheduling of one V-shaped step on an ideal clock (state of :func:`_list_schedule`).

    Memory is counted as omnitron's split backward spends it (``wgrad.py``): a chunk's F holds one chunk's
    activations until its W; its B keeps them and adds the W inputs, about as much again, until that W. So
    ``held`` (F to W) is capped at ``cap`` and ``held`` plus the B's waiting for their W at ``cap + 1``.
    ``tail_first``: once a rank has started all its forwards, the B of chunk 1 goes before an older chunk 0's
    (its micro-batch has the longer way left: chunk 1's stages below and all of chunk 0's).
    """

    def __init__(self, pp: int, m: int, stage_cost: Callable[[int, str], float], tail_first: bool = False) -> None:
        self.pp, self.m, self.cost, self.last, self.tail_first = pp, m, stage_cost, 2 * pp - 1, tail_first
        self.done: dict[tuple[str, int, int], float] = {}  # (kind, stage, mb) -> finish time
        self.tables: dict[int, list[Action]] = {r: [] for r in range(pp)}
        self.next_f = [[0, 0] for _ in range(pp)]
        self.next_b = [[0, 0] for _ in range(pp)]
        self.pending_w: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
        self.held = [0] * pp  # chunk activations between F and the end of W
        self.after_b = [False] * pp  # the rank's last F or B pass was a B

    def ready(self, kind: str, stage: int, mb: int, t: float) -> bool:
        if kind == "F":
            need = ("F", stage - 1, mb) if stage > 0 else None
        else:
            need = ("F", stage, mb) if stage == self.last else ("B", stage + 1, mb)
        return need is None or self.done.get(need, float("inf")) <= t

    def pick(self, r: int, t: float, cap: int) -> Action | None:
        """Within the memory caps an F or the B of the oldest ready micro-batch, one after the other when both are
        ready (1F1B's steady state; F chunk 1 first), else the oldest W: a W fills a gap or, at the cap, frees
        memory. (B before F whenever both are ready runs the B's ahead and starves the ranks below of forwards:
        11 units over the bound at p = 8, m = 16 under these caps.)"""
        room = self.held[r] + len(self.pending_w[r]) <= cap
        backs = [(self.next_b[r][c], c) for c in (0, 1) if self.next_b[r][c] < self.next_f[r][c]
                 and self.ready("B", virtual_stage(r, c, self.pp, "v"), self.next_b[r][c], t)] if room else []
        fwds = [(c, self.next_f[r][c]) for c in (1, 0) if self.next_f[r][c] < self.m
                and self.ready("F", virtual_stage(r, c, self.pp, "v"), self.next_f[r][c], t)]
        if fwds and room and self.held[r] < cap and (self.after_b[r] or not backs):
            c, mb = fwds[0]
            self.next_f[r][c] += 1
            self.held[r] += 1
            self.after_b[r] = False
            return Action(c, "F", mb)
        if backs:
            tail = self.tail_first and min(self.next_f[r]) >= self.m
            mb, c = min(backs, key=lambda b: (-b[1], b[0])) if tail else min(backs)
            self.next_b[r][c] += 1
            self.pending_w[r].append((c, mb))
            self.after_b[r] = True
            return Action(c, "B", mb)
        if self.pending_w[r]:
            c, mb = self.pending_w[r].pop(0)
            self.held[r] -= 1
            return Action(c, "W", mb)
        return None


def _list_schedule(pp: int, m: int, cap: int, stage_cost: Callable[[int, str], float],
                   tail_first: bool = False) -> Schedule | None:
    """ZB-V's table for one cap on held chunk activations, or None when the cap starves the pipeline."""
    clock = _VClock(pp, m, stage_cost, tail_first)
    busy_until, t = [0.0] * pp, 0
    while any(len(clock.tables[r]) < 6 * m for r in range(pp)):
        if t > 8 * m * pp + 8:  # far past any schedule's makespan: nothing can start any more
            return None
        started = []
        for r in range(pp):
            while busy_until[r] <= t:  # zero-cost actions let a rank start another in the same tick
                act = clock.pick(r, t, cap)
                if act is None:
                    break
                clock.tables[r].append(act)
                stage = virtual_stage(r, act.chunk, pp, "v")
                busy_until[r] = t + stage_cost(stage, act.kind)
                started.append(((act.kind, stage, act.microbatch), busy_until[r]))
        for key, end in started:
            clock.done[key] = end
        t += 1
    return Schedule("zb-v", pp, 2, m, {r: tuple(v) for r, v in clock.tables.items()}, style="v")


def schedule_zb_v(pp: int, num_microbatches: int,
                  stage_cost: Callable[[int, str], float] = zb_stage_cost) -> Schedule:
    """ZB-V: the list schedule of :class:`_VClock` over the V with ``2p`` chunk activations held (1F1B's peak in
    half-stage units), ``2p + 1`` with the W inputs of the B's waiting for their W.

    These caps reach the bound ``6m + p - 1`` at m >= p for p = 2 ... 16 (p = 32 at m = 2p and 8p checked),
    holding no more on any rank than Sea AI's published ZB-V with the B priced the same
    (``tests/parallel/test_vshape_reference.py``). Where they miss it (m < p, which the published scheduler
    takes too), the tail's chunk-1-first order and caps raised by up to three are tried too, and the shortest kept,
    then the one holding least (no other schedule is fallen back to): at m <= p / 2 that reaches ``4p + 2m - 1``, the
    bound of rank ``p - 1``'s 2m forwards and the path after them, above p / 2 ``4m + 3p - 1`` (8 units over both
    bounds at p = 16, m = 12), the shortest step of any V table there: an exact solver finds none shorter for any
    m < p up to p = 16, even without memory caps or p2p order (``tests/parallel/zbv_optimum``); shorter than ZB-H1
    and 1F1B in every case (``tests/parallel/test_pipeline_schedules.py``); one unit
    shorter for one chunk more (2p + 2 with the W inputs) at (p, m) = (10, 9), (11, 8), (12, 10), (14, 10),
    (15, 12), (15, 14) up to p = 16. NOTE: pure Python, built once per micro-batch count: 2 s at p = 32, m = 256.
    """

    _check(pp, num_microbatches)
    m, bound = num_microbatches, 6 * num_microbatches + pp - 1
    best, best_key = None, None
    for cap in range(2 * pp, 2 * pp + 4):
        for tail_first in (False, True):
            s = _list_schedule(pp, m, cap, stage_cost, tail_first)
            if s is None:
                continue
            tl = simulate(s, stage_cost=stage_cost)
            if tl.makespan <= bound:
                return s
            key = (tl.makespan, max(_held_with_w_inputs(s)))
            if best_key is None or key < best_key:
                best, best_key = s, key
    if best is None:  # NOTE: not reached for pp >= 1, m >= 1 (cap 2p always leaves a forward to start)
        raise ConfigError(f"zb-v found no schedule for pp={pp}, m={m}; use --pipeline-schedule zb-h1")
    return best


def _held_with_w_inputs(schedule: Schedule) -> list[int]:
    """Per rank, the most chunk activations held, a B's W inputs counted as one more until its W."""
    most = []
    for r in range(schedule.pp):
        held = top = 0
        for a in schedule.tables[r]:
            held += {"F": 1, "B": 1, "W": -2}[a.kind]
            top = max(top, held)
        most.append(top)
    return most


def schedule_dualpipe_v(pp: int, num_microbatches: int) -> Schedule:
    """DualPipeV's eight phases per rank (see the module docstring); needs ``m >= 2 pp``.

    Backwards are full (B and W together) in the steady state; the zero-bubble split (B now, W queued,
    first in first out) is used in phase 3, from the middle of phase 6 on, and in phase 7.
    """
    _check(pp, num_microbatches)
    m = num_microbatches
    if m < 2 * pp:
        raise ConfigError(f"--pipeline-schedule dualpipe-v needs at least 2 x pipeline size = {2 * pp} micro-batches, "
                          f"got {m}; raise --global-batch-size or use --pipeline-schedule zb-v")
    ranks = {r: _dualpipe_v_rank(pp, r, m) for r in range(pp)}
    return Schedule("dualpipe-v", pp, 2, m, {r: t for r, (t, _) in ranks.items()}, style="v",
                    pairs={r: frozenset(p) for r, (_, p) in ranks.items()})


def _dualpipe_v_rank(pp: int, r: int, m: int) -> tuple[tuple[Action, ...], list[int]]:
    """Rank ``r``'s DualPipeV table, and the indices of the forwards overlapped with the backward after them."""
    table: list[Action] = []
    nf, nb, queue, pairs = [0, 0], [0, 0], [], []

    def f(c: int) -> None:
        table.append(Action(c, "F", nf[c]))
        nf[c] += 1

    def b(c: int, split: bool = False) -> None:
        table.append(Action(c, "B", nb[c]))
        if split:
            queue.append((c, nb[c]))
        nb[c] += 1

    def w() -> None:
        c, mb = queue.pop(0)
        table.append(Action(c, "W", mb))

    for _ in range(2 * (pp - r - 1)):  # 1: chunk-0 forwards
        f(0)
    for _ in range(r + 1):  # 2: chunk-0 and chunk-1 forwards
        f(0), f(1)
    for _ in range(pp - r - 1):  # 3: zero-bubble chunk-1 backward, its W, a chunk-1 forward
        b(1, True), w(), f(1)
    def pair(c: int) -> None:
        pairs.append(len(table))
        f(c), b(1 - c)

    for _ in range(m - 2 * pp + r + 1):  # 4: steady state, pairs (F0 & B1), (F1 & B0)
        pair(0), pair(1)
    for _ in range(pp - r - 1):  # 5: B1, pair (F1 & B0)
        b(1), pair(1)
    split = False
    for i in range(r + 1):  # 6: backwards of both chunks; the split starts half-way
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        b(1, split)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        b(0, split)
    for _ in range(pp - r - 1):  # 7: W, zero-bubble chunk-0 backward
        w(), b(0, True)
    while queue:  # 8: the remaining W passes (r + 1 of them)
        w()
    return tuple(table), pairs
