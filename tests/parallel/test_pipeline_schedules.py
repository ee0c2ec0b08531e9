"""Pipeline schedules and layer placement as pure data: no processes."""

import os

import pytest

from omnitron.core.config import ConfigError
from omnitron.core.parallel.pipeline import (Action, ScheduleError, build_schedule, pipeline_layer_ranges, simulate,
                                             theory_bubble)
from omnitron.core.parallel.pipeline.p2p import input_message, nccl_order_makespan, plan_exchanges
from omnitron.core.parallel.pipeline.schedules import Schedule, schedule_1f1b, zb_stage_cost

CASES = [("none", 1, 1, m) for m in (1, 3)] + [
    ("1f1b", p, 1, m) for p in (2, 3, 4, 8) for m in (1, 2, 4, 5, 8, 16)] + [
    ("zb-h1", p, 1, m) for p in (2, 3, 4, 8) for m in (1, 2, 4, 5, 8, 16)] + [
    ("interleaved", p, v, m) for p in (2, 4) for v in (2, 3) for m in (p, 2 * p, 4 * p)] + [
    ("zb-v", p, 2, m) for p in (2, 3, 4, 8) for m in (1, 2, 4, 5, 8, 16)] + [
    ("dualpipe-v", p, 2, m) for p in (2, 3, 4, 8) for m in (2 * p, 2 * p + 1, 4 * p)]


@pytest.mark.parametrize("name,pp,vp,m", CASES)
def test_every_schedule_is_complete_ordered_and_deadlock_free(name, pp, vp, m):
    s = build_schedule(name, pp, vp, m)
    tl = simulate(s)  # raises on a missing/duplicate action, a broken dependency or a deadlock
    for r, table in s.tables.items():
        fs = [a for a in table if a.kind == "F"]
        # each chunk forwards micro-batches in order, and exactly once
        for c in range(vp):
            assert [a.microbatch for a in fs if a.chunk == c] == list(range(m))
        if name in ("zb-h1", "zb-v"):  # every backward split
            assert sum(a.kind == "W" for a in table) == m * vp
        elif name == "dualpipe-v":  # the split only where the phases use it (see vshape.py)
            assert 0 < sum(a.kind == "W" for a in table) < m * vp
        else:
            assert all(a.kind != "W" for a in table)
        # a chunk's W passes run in the order of their B passes (first in, first out: the paper's ZB-H1 / ZB-V and
        # DualPipe's weight-gradient queue), so the oldest held micro-batch is released first
        for c in range(vp):
            split = {a.microbatch for a in table if a.kind == "W" and a.chunk == c}
            b_order = [a.microbatch for a in table if a.kind == "B" and a.chunk == c and a.microbatch in split]
            assert [a.microbatch for a in table if a.kind == "W" and a.chunk == c] == b_order, (r, c)
    # the simulation honours dependencies: a stage's F starts after the previous stage's F ends
    ends = {(s.stage(r, a.chunk), a.kind, a.microbatch): (st, en) for r, sp in tl.spans.items() for st, en, a in sp}
    for (k, kind, i), (st, _) in ends.items():
        if kind == "F" and k > 0:
            assert st >= ends[(k - 1, "F", i)][1]
        if kind == "B" and k < s.num_stages - 1:
            assert st >= ends[(k + 1, "B", i)][1]


def test_messages_arrive_a_transfer_time_after_their_send():
    """1F1B, pp 2, two micro-batches, F = 1, backward 2, each message 0.5 on the wire (worked by hand). Rank 1:
    F0 [1.5, 2.5] (rank 0's F0 ends at 1), its own B0 at once [2.5, 4.5], F1 [4.5, 5.5] (arrived at 2.5), B1
    [5.5, 7.5]. Rank 0: F0 [0, 1], F1 [1, 2], B0 [5, 7] (rank 1's B0 ends at 4.5), B1 [8, 10]. Without transfer
    times the same table ends at 9."""
    s = build_schedule("1f1b", 2, 1, 2)
    cost = {"F": 1.0, "B": 1.0, "W": 1.0}
    tl = simulate(s, cost=cost, transfer=lambda k, kind: 0.5)
    spans = {r: [(a.kind + str(a.microbatch), b, e) for b, e, a in sp] for r, sp in tl.spans.items()}
    assert spans[0] == [("F0", 0, 1), ("F1", 1, 2), ("B0", 5, 7), ("B1", 8, 10)]
    assert spans[1] == [("F0", 1.5, 2.5), ("B0", 2.5, 4.5), ("F1", 4.5, 5.5), ("B1", 5.5, 7.5)]
    assert simulate(s, cost=cost).makespan == 9


@pytest.mark.parametrize("pp,m", [(2, 4), (2, 8), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_bubble_and_peak_activations_match_theory(pp, m):
    one = simulate(build_schedule("1f1b", pp, 1, m), stage_cost=zb_stage_cost)
    for r in range(pp):
        assert one.bubble(r) == pytest.approx(theory_bubble("1f1b", pp, m), abs=1e-9)
        assert one.peak_inflight[r] == min(pp - r, m)
    if m % pp == 0:
        v = 2
        inter = simulate(build_schedule("interleaved", pp, v, m), cost={"F": 1 / v, "B": 1 / v, "W": 1 / v})
        assert (max(inter.bubble(r) for r in range(pp))
                == pytest.approx(theory_bubble("interleaved", pp, m, v), abs=1e-9))
        for r in range(pp):
            warmup = min((pp - r - 1) * 2 + (v - 1) * pp, m * v)  # Megatron's, m == pp included
            assert inter.peak_inflight[r] == min(warmup + 1, m * v)
    # stage 0 has no input gradient: its B is free and its W does the whole backward
    zb = simulate(build_schedule("zb-h1", pp, 1, m), stage_cost=zb_stage_cost)
    assert max(zb.bubble(r) for r in range(pp)) == pytest.approx(theory_bubble("zb-h1", pp, m), abs=1e-9)
    # about a third of 1F1B's idle time, and the same F-to-B activation limit as 1F1B
    assert zb.makespan - 3 * m == pytest.approx((one.makespan - 3 * m) / 3)
    for r in range(pp):
        assert zb.peak_before_backward[r] <= min(pp - r, m)
        assert zb.peak_inflight[r] <= min(2 * pp - 1 - r, m)


@pytest.mark.parametrize("name,pp,m", [(n, p, m) for n in ("zb-v", "dualpipe-v") for p, m in
                                       [(2, 4), (2, 8), (4, 8), (4, 16), (8, 16)]] + [("zb-v", 4, 4)])
def test_v_schedules_bubble_and_activations_match_theory(name, pp, m):
    """Chunk passes F = B = W = 1 (stage 0: B free, W = 2): the step is 6m chunk passes per rank plus the
    start-up of p - 1 forwards (theory_bubble); the memory bound is the builders' (vshape.py)."""
    s = build_schedule(name, pp, 2, m)
    assert s.style == "v" and s.stage(0, 0) == 0 and s.stage(0, 1) == 2 * pp - 1 and s.place(pp) == (pp - 1, 1)
    tl = simulate(s, stage_cost=zb_stage_cost)
    assert all(sum(e - st for st, e, _ in tl.spans[r]) == 6 * m for r in range(pp))
    measured = max(tl.bubble(r) for r in range(pp))
    assert abs(measured - theory_bubble(name, pp, m)) < 0.02
    zb = simulate(build_schedule("zb-h1", pp, 1, m), stage_cost=zb_stage_cost)
    assert measured < max(zb.bubble(r) for r in range(pp))
    # chunk activations (half a stage each): DualPipeV's published p + 1 stages; zb-v's cap, 1F1B's p (m >= p here)
    bound = 2 * pp + 1 if name == "dualpipe-v" else 2 * pp
    assert max(tl.peak_inflight.values()) <= bound


def test_zb_v_reaches_the_ideal_step_at_every_m_from_p():
    """BENCHMARKS.md's claim: zb-v's list schedule reaches 6m + p - 1 (6m chunk passes a rank after p - 1 start-up
    forwards) at every m >= p, on the ideal clock priced as ``zb_stage_cost`` and with every pass one unit."""
    from omnitron.core.parallel.pipeline.vshape import schedule_zb_v

    def uniform(stage: int, kind: str) -> float:
        return 2.0 if kind == "BW" else 1.0

    for cost in (zb_stage_cost, uniform):
        for pp in range(2, 9):
            for m in range(pp, 3 * pp + 2):
                span = simulate(schedule_zb_v(pp, m, stage_cost=cost), stage_cost=cost).makespan
                assert span == 6 * m + pp - 1, (cost.__name__, pp, m, span)


def test_zb_v_below_p_micro_batches_is_a_valid_v_no_slower_than_the_one_chunk_schedules():
    """At m < p zb-v does not fall back to another schedule: its search (caps 2p ... 2p + 3, tail-first order) keeps
    the shortest V table, which the simulator runs (every pass once, dependencies met). Its step is at least the
    bound hand-derived here and equals it while m <= p / 2: rank p - 1 runs both chunks' forwards of every
    micro-batch, 2m units from time p - 1 at the earliest, and the micro-batch of its last one still has p - 1
    forwards, 2p - 1 B's (stage 0's is free) and stage 0's W (2) to go: 4p + 2m - 1, beside the 6m + p - 1 of
    p - 1 start-up forwards and 6m units of work a rank. (Above p / 2 it is over both, 8 units at p = 16, m = 12:
    there no V table is shorter, test_zb_v_below_p_takes_the_shortest_step_of_any_v_table.)
    It is shorter than ZB-H1 and 1F1B over the same model (two chunks a stage: their step doubled) and
    holds no more chunk activations than they do (2m, every micro-batch's two chunks)."""
    from omnitron.core.parallel.pipeline.vshape import schedule_zb_v

    for pp in range(2, 9):
        for m in range(1, pp):
            tl = simulate(schedule_zb_v(pp, m), stage_cost=zb_stage_cost)
            bound = max(6 * m + pp - 1, 4 * pp + 2 * m - 1)
            assert tl.makespan >= bound and (tl.makespan == bound or 2 * m > pp), (pp, m, tl.makespan)
            assert max(tl.peak_inflight.values()) <= 2 * m, (pp, m)
            for name in ("zb-h1", "1f1b"):
                other = simulate(build_schedule(name, pp, 1, m), stage_cost=zb_stage_cost)
                assert tl.makespan < 2 * other.makespan, (name, pp, m)
                assert max(tl.peak_inflight.values()) <= 2 * max(other.peak_inflight.values()), (name, pp, m)


def test_zb_v_below_p_takes_the_shortest_step_of_any_v_table():
    """At m < p zb-v's step was documented as "a few units over" max(6m + p - 1, 4p + 2m - 1) above p / 2 (8 at
    p = 16, m = 12), an open question whether a better order existed. The reference: the shortest step any V table
    can take on this ideal clock, proven by an exact solver (CP-SAT) over a relaxation of the legal tables (no
    memory cap, no micro-batch or p2p order: ``zbv_optimum/make_fixtures.py``), for every m < p up to p = 16. zb-v's
    list schedule reaches it in every case: no better legal order exists. (The optimum there is 4m + 3p - 1 above
    p / 2; the fixtures are the solver's, not this formula.)"""
    import json

    from omnitron.core.parallel.pipeline.vshape import schedule_zb_v

    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zbv_optimum", "fixtures.json")
    with open(here) as f:
        cases = json.load(f)["cases"]
    assert {(c["pp"], c["microbatches"]) for c in cases} == {(p, m) for p in range(2, 17) for m in range(1, p)}
    for c in cases:
        pp, m = c["pp"], c["microbatches"]
        span = simulate(schedule_zb_v(pp, m), stage_cost=zb_stage_cost).makespan
        assert span == c["optimum"], (pp, m, span, c["optimum"])


def test_simulator_catches_broken_tables():
    good = schedule_1f1b(2, 2)
    # rank 1 asks for micro-batch 1's backward before forwarding it
    bad = Schedule("bad", 2, 1, 2, {0: good.tables[0], 1: tuple(map(Action.parse, ["0F0", "0B1", "0F1", "0B0"]))})
    with pytest.raises(ScheduleError, match="before the work"):
        simulate(bad)
    missing = Schedule("bad", 2, 1, 2, {0: good.tables[0], 1: good.tables[1][:-1]})
    with pytest.raises(ScheduleError, match="appears 0 times"):
        simulate(missing)
    # rank 0 runs all backwards before its second forward: rank 1 waits for 0F1 forever
    dead = Schedule("dead", 2, 1, 2, {0: tuple(map(Action.parse, ["0F0", "0B0", "0B1", "0F1"])),
                                      1: good.tables[1]})
    with pytest.raises(ScheduleError):
        simulate(dead)
    cyc = Schedule("cyc", 2, 1, 1, {0: tuple(map(Action.parse, ["0B0", "0F0"])), 1: good.tables[1][:2]})
    with pytest.raises(ScheduleError):
        simulate(cyc)


def _reference_spans(s, dur, hop):
    """Each action's (start, end) by recursion over the dependency graph, written from ``simulate``'s contract: a
    step (an action, or a combined pair: both in, both out at its end) starts when its rank's previous step has ended
    and every output it needs has arrived (F: the previous stage's F; B: the next stage's B, the last stage its own F;
    W: its own B), a transfer ``hop`` after that output's end when it comes from another stage."""
    import functools

    at = {(a.kind, s.stage(r, a.chunk), a.microbatch): (r, i) for r, t in s.tables.items() for i, a in enumerate(t)}
    last = s.num_stages - 1

    def first(r, i):  # the index starting the step that holds action i
        return i - 1 if i and s.combined and s.paired(r, i - 1) else i

    def step(r, i):
        return [i, i + 1] if s.combined and s.paired(r, i) else [i]

    @functools.lru_cache(maxsize=None)
    def ready(r, i):  # step i's start
        t = out(r, i - 1) if i else 0.0
        for j in step(r, i):
            a = s.tables[r][j]
            k = s.stage(r, a.chunk)
            need = {"F": ("F", k - 1) if k else None, "B": ("B", k + 1) if k < last else ("F", k),
                    "W": ("B", k)}[a.kind]
            if need:
                t = max(t, out(*at[(*need, a.microbatch)]) + (hop[(need[1], need[0])] if need[1] != k else 0.0))
        return t

    def out(r, i):  # when action i's output exists (its step's end)
        i0 = first(r, i)
        t = ready(r, i0)
        for j in step(r, i0):
            a = s.tables[r][j]
            t += dur[(s.stage(r, a.chunk), "BW" if a.kind == "B" and (a.chunk, a.microbatch) not in
                      s.split_backward(r) else a.kind)]
        return t

    spans = {}
    for r, t in s.tables.items():
        for i in range(len(t)):
            if first(r, i) == i:
                begin = ready(r, i)
                for j in step(r, i):
                    a = t[j]
                    end = begin + dur[(s.stage(r, a.chunk), "BW" if a.kind == "B" and (a.chunk, a.microbatch)
                                       not in s.split_backward(r) else a.kind)]
                    spans[(r, j)] = (begin, end)
                    begin = end
    return spans


@pytest.mark.parametrize("name,pp,vp,m,combined", [
    ("1f1b", 4, 1, 6, False), ("zb-h1", 3, 1, 5, False), ("interleaved", 4, 2, 8, False),
    ("interleaved", 2, 3, 4, False), ("zb-v", 4, 2, 5, False), ("dualpipe-v", 3, 2, 7, False),
    ("dualpipe-v", 4, 2, 8, True)])
def test_simulated_clock_is_the_longest_path(name, pp, vp, m, combined):
    """The simulator's spans equal a longest-path recursion over the dependencies on fresh random durations and
    transfers: exactly (the same maxima and the same sums in the same order), and again after a table is replaced
    (the simulator keeps a compiled form of each schedule: a stale one would replay the old table)."""
    import dataclasses
    import random

    rng = random.Random()
    s = build_schedule(name, pp, vp, m)
    s = dataclasses.replace(s, combined=combined)
    for trial in range(2):
        dur = {(k, kind): rng.uniform(0.1, 3.0) for k in range(s.num_stages) for kind in ("F", "B", "W", "BW")}
        hop = {(k, kind): rng.uniform(0.0, 1.0) for k in range(s.num_stages) for kind in "FB"}
        tl = simulate(s, stage_cost=lambda k, kind: dur[(k, kind)], transfer=lambda k, kind: hop[(k, kind)])
        got = {(r, i): (b, e) for r, spans in tl.spans.items() for i, (b, e, _) in enumerate(spans)}
        assert all([a for _, _, a in tl.spans[r]] == list(s.tables[r]) for r in range(pp))
        assert got == _reference_spans(s, dur, hop)
        if trial == 0 and not s.pairs:  # swap the last rank's two last actions where that keeps the table valid
            t = s.tables[pp - 1]
            if t[-1].kind == t[-2].kind == "W":
                s.tables[pp - 1] = t[:-2] + (t[-1], t[-2])


def test_printable_forms_and_grid():
    assert str(Action(1, "B", 3)) == "1B3" and Action.parse("2F10") == Action(2, "F", 10)
    s = build_schedule("1f1b", 4, 1, 4)
    grid = s.format()
    assert "0F3" in grid and grid.splitlines()[1].split() == ["step", "r0", "r1", "r2", "r3"]
    assert [str(a) for a in s.tables[3][:4]] == ["0F0", "0B0", "0F1", "0B1"]
    assert [str(a) for a in s.tables[0][:4]] == ["0F0", "0F1", "0F2", "0F3"]


def _channel_order(batches: dict[int, list[list]]) -> None:
    """Per (sender, receiver), the receives are posted in the order of the sends: matching is first in, first out
    per peer (no tags), so a receive posted out of order takes another message's tensor."""
    posted = {(kind, r, peer): [] for r in batches for b in batches[r] for kind, peer, _ in b}
    for r in batches:
        for b in batches[r]:
            for kind, peer, msg in b:
                posted[(kind, r, peer)].append(msg)
    for (kind, r, peer), msgs in posted.items():
        if kind == "send":
            assert posted[("recv", peer, r)] == msgs, f"rank {peer} receives from rank {r} out of its send order"


def _nccl_order_run(batches: dict[int, list[list]]) -> None:
    """Execute per-rank p2p batches under NCCL's rules, without processes: a rank's batches run one
    after another; an op completes only while its counterpart is in the peer's current batch; a
    batch ends when all its ops have. Raises AssertionError on deadlock (no progress) or on a channel whose
    receives are not in its sends' order."""
    _channel_order(batches)
    pos = {r: 0 for r in batches}
    done = {r: set() for r in batches}  # indices of completed ops of the current batch

    def current(r):
        return batches[r][pos[r]] if pos[r] < len(batches[r]) else []

    while any(pos[r] < len(batches[r]) for r in batches):
        progressed = False
        for r in batches:
            for i, (kind, peer, msg) in enumerate(current(r)):
                want = ("recv" if kind == "send" else "send", r, msg)
                if i not in done[r] and want in current(peer):
                    done[r].add(i)
                    done[peer].add(current(peer).index(want))
                    progressed = True
        for r in batches:
            if pos[r] < len(batches[r]) and len(done[r]) == len(current(r)):
                pos[r], done[r] = pos[r] + 1, set()
                progressed = True
        assert progressed, f"deadlock under NCCL order at batches {pos}: {[current(r) for r in batches]}"


@pytest.mark.parametrize("name,pp,vp,m", CASES)
@pytest.mark.parametrize("forward_only", [False, True])
def test_exchange_plan_completes_under_nccl_order(name, pp, vp, m, forward_only):
    s = build_schedule(name, pp, vp, m)
    if forward_only:
        s = s.forwards_only()
    plan = plan_exchanges(s)
    for r, table in s.tables.items():
        assert len(plan[r]) == len(table) + 1
        ops = [(i, op) for i, batch in enumerate(plan[r]) for op in batch]
        for i, a in enumerate(table):  # every input arrives no later than the batch before its action
            k = s.stage(r, a.chunk)
            need = ("act", k, a.microbatch) if a.kind == "F" and k > 0 else (
                ("grad", k, a.microbatch) if a.kind == "B" and k < s.num_stages - 1 else None)
            producer = None if need is None else need[1] + (-1 if need[0] == "act" else 1)
            if need is not None and s.place(producer)[0] != r:  # a message within the rank is no transfer
                got = [j for j, (kind, _, msg) in ops if kind == "recv" and msg == need]
                assert len(got) == 1 and got[0] <= i, (r, a, got)
    sends = sorted((r, p, msg) for r in plan for b in plan[r] for kind, p, msg in b if kind == "send")
    recvs = sorted((p, r, msg) for r in plan for b in plan[r] for kind, p, msg in b if kind == "recv")
    turns = 1 if s.style == "v" else 0  # the V's turn (stage p-1 to p) stays on rank p-1
    assert sends == recvs and len(sends) == m * (s.num_stages - 1 - turns) * (1 if forward_only else 2)
    _nccl_order_run(plan)


def _batched_makespan(s: Schedule, plan: dict[int, list[list]]) -> float:
    """The step's length when each rank posts exchange batch i's sends on reaching it and starts action i once
    the receive it consumes has been posted by its sender (the runtime's rule: a receive posted early, as a
    pair's backward's, is waited only before its action), on ``zb_stage_cost``."""
    split = {r: s.split_backward(r) for r in s.tables}
    received = {r: {msg for b in plan[r] for kind, _, msg in b if kind == "recv"} for r in plan}
    posted: dict = {}
    pos, clock = {r: 0 for r in s.tables}, {r: 0.0 for r in s.tables}
    while any(pos[r] <= len(s.tables[r]) for r in s.tables):
        progressed = False
        for r, table in s.tables.items():
            while pos[r] <= len(table):
                batch = plan[r][pos[r]]
                for kind, _, msg in batch:
                    if kind == "send" and msg not in posted:
                        posted[msg], progressed = clock[r], True
                need = input_message(s, r, table[pos[r]]) if pos[r] < len(table) else None
                recvs = [need] if need in received[r] else []
                if any(msg not in posted for msg in recvs):
                    break
                start = max([clock[r]] + [posted[msg] for msg in recvs])
                if pos[r] < len(table):
                    a = table[pos[r]]
                    unsplit = a.kind == "B" and (a.chunk, a.microbatch) not in split[r]
                    start += zb_stage_cost(s.stage(r, a.chunk), "BW" if unsplit else a.kind)
                clock[r], pos[r], progressed = start, pos[r] + 1, True
        assert progressed, f"exchange plan deadlocks at {pos}"
    return max(clock.values())


@pytest.mark.parametrize("name,pp,vp,m", [c for c in CASES if c[3] >= c[1]])
def test_exchange_plan_adds_no_wait(name, pp, vp, m):
    """Batching the transfers between actions delays no action past the ideal clock (an exchange waits only for
    what has been sent by then)."""
    s = build_schedule(name, pp, vp, m)
    assert _batched_makespan(s, plan_exchanges(s)) == simulate(s, stage_cost=zb_stage_cost).makespan


@pytest.mark.parametrize("name,pp,vp,m", [c for c in CASES if c[3] >= c[1]])
def test_exchange_plan_under_nccl_order_stays_near_the_ideal_clock(name, pp, vp, m):
    """With a rank's batches completing in the order posted (NCCL), the step is the ideal clock's for the
    one-chunk and interleaved schedules, and at most one unit longer for the V ones (DualPipeV: a forward's send
    can queue behind its pair's early receive; ZB-V at p = 3, m = 4). Receives posted at the producer's end
    instead (the plan before 2026-12-03) cost DualPipeV up to 27 units (p = 8, m = 32: 226 of 199)."""
    s = build_schedule(name, pp, vp, m)
    ideal = simulate(s, stage_cost=zb_stage_cost).makespan
    assert ideal <= nccl_order_makespan(s) <= ideal + (1 if s.style == "v" else 0)


def test_nccl_order_checker_catches_receive_posted_before_send():
    """The pattern p2p.py used to have (a receive pre-posted alone, then the send) deadlocks."""
    act, grad = ("act", 1, 0), ("grad", 0, 0)
    unfixed = {0: [[("recv", 1, grad)], [("send", 1, act)]], 1: [[("recv", 0, act)], [("send", 0, grad)]]}
    with pytest.raises(AssertionError, match="deadlock under NCCL order"):
        _nccl_order_run(unfixed)
    _nccl_order_run({0: [[("send", 1, act)], [("recv", 1, grad)]], 1: [[("recv", 0, act)], [("send", 0, grad)]]})
    act2 = ("act", 1, 1)  # two messages on one channel, received in the other order: gloo swaps their tensors
    with pytest.raises(AssertionError, match="out of its send order"):
        _nccl_order_run({0: [[("send", 1, act), ("send", 1, act2)]], 1: [[("recv", 0, act2), ("recv", 0, act)]]})


def test_schedule_errors_name_the_fix():
    with pytest.raises(ConfigError, match="multiple of --pipeline-model-parallel-size"):
        build_schedule("interleaved", 4, 2, 6)
    with pytest.raises(ConfigError, match="unknown"):
        build_schedule("gpipe2", 2, 1, 4)
    with pytest.raises(ConfigError, match="interleaved"):
        build_schedule("1f1b", 2, 2, 4)
    with pytest.raises(ConfigError, match="micro-batches"):
        build_schedule("1f1b", 2, 1, 0)
    for name, pp, vp, m, match in [("zb-v", 4, 1, 8, "two model chunks per rank"),
                                   ("dualpipe-v", 2, 3, 8, "two model chunks per rank"),
                                   ("dualpipe-v", 4, 2, 4, "at least 2 x pipeline size = 8 micro-batches")]:
        with pytest.raises(ConfigError, match=match):
            build_schedule(name, pp, vp, m)
    assert build_schedule(None, 1, 1, 2).name == "none"
    assert build_schedule(None, 2, 2, 2).name == "interleaved"


def test_layer_ranges_even_uneven_and_virtual():
    assert pipeline_layer_ranges(8, 1) == {(0, 0): (0, 8)}
    assert pipeline_layer_ranges(8, 4) == {(r, 0): (2 * r, 2) for r in range(4)}
    # virtual stage c*pp+r follows c*pp+r-1
    assert pipeline_layer_ranges(8, 2, 2) == {(0, 0): (0, 2), (1, 0): (2, 2), (0, 1): (4, 2), (1, 1): (6, 2)}
    assert pipeline_layer_ranges(10, 4, first=1, last=3) == {(0, 0): (0, 1), (1, 0): (1, 3), (2, 0): (4, 3),
                                                            (3, 0): (7, 3)}
    assert pipeline_layer_ranges(6, 3, first=0) == {(0, 0): (0, 0), (1, 0): (0, 3), (2, 0): (3, 3)}
    assert pipeline_layer_ranges(5, 2, first=2, last=3) == {(0, 0): (0, 2), (1, 0): (2, 3)}
    # V: rank r holds stages r and 2p-1-r
    assert pipeline_layer_ranges(8, 2, 2, style="v") == {(0, 0): (0, 2), (1, 0): (2, 2), (1, 1): (4, 2),
                                                         (0, 1): (6, 2)}
    for kw in [dict(num_layers=14, pp=4, vp=2, first=2, last=4)]:
        rng = pipeline_layer_ranges(**kw)
        assert sum(n for _, n in rng.values()) == 14
        assert sorted(rng.values()) == sorted(rng.values(), key=lambda x: x[0])


def test_layer_ranges_accounting_for_embedding_and_loss():
    """--account-for-embedding/loss-in-pipeline-split, hand-worked: N = layers + slots splits over every virtual
    stage, the first (last) virtual stage builds one layer fewer."""
    # 6 layers pp2 vpp2, both: N = 8, two slots per virtual stage (stage order (0,0) (1,0) (0,1) (1,1))
    assert pipeline_layer_ranges(6, 2, 2, embedding=True, loss=True) == {(0, 0): (0, 1), (1, 0): (1, 2),
                                                                         (0, 1): (3, 2), (1, 1): (5, 1)}
    # Llama 3 405B: 126 layers at pp16 vpp8 -> 128 slots, one per virtual stage: the two ends hold no layer
    big = pipeline_layer_ranges(126, 16, 8, embedding=True, loss=True)
    assert big[(0, 0)] == (0, 0) and big[(15, 7)] == (126, 0)
    assert all(n == 1 for k, (_, n) in big.items() if k not in ((0, 0), (15, 7)))
    flat = pipeline_layer_ranges(126, 16, embedding=True, loss=True)  # vp 1: 7, 8 x 14, 7
    assert flat[(0, 0)] == (0, 7) and flat[(1, 0)] == (7, 8) and flat[(15, 0)] == (119, 7)
    assert pipeline_layer_ranges(7, 2, embedding=True) == {(0, 0): (0, 3), (1, 0): (3, 4)}  # embedding only
    # loss only, 7 layers pp4 vpp2: one slot per virtual stage, the last one holds the head alone
    assert pipeline_layer_ranges(7, 4, 2, loss=True) == {(0, 0): (0, 1), (1, 0): (1, 1), (2, 0): (2, 1),
                                                         (3, 0): (3, 1), (0, 1): (4, 1), (1, 1): (5, 1),
                                                         (2, 1): (6, 1), (3, 1): (7, 0)}
    # pp 1: nothing to balance, every layer on the one stage (Megatron: N - 2 = num_layers)
    assert pipeline_layer_ranges(5, 1, embedding=True, loss=True) == {(0, 0): (0, 5)}
    # V: rank 0 holds stage 0 (the embedding) and stage 2 pp - 1 (the loss)
    assert pipeline_layer_ranges(6, 2, 2, style="v", embedding=True, loss=True) == {
        (0, 0): (0, 1), (1, 0): (1, 2), (1, 1): (3, 2), (0, 1): (5, 1)}


def _megatron_layers(num_layers, pp, vp, r, c, embedding, loss):
    """Megatron's own arithmetic (get_num_layers_to_build, get_transformer_layer_offset), written out
    independently: (offset, count) of chunk c on pipeline rank r."""
    n = num_layers + embedding + loss
    per_chunk = n // pp // vp
    offset = c * (n // vp) + r * per_chunk - (embedding and (r, c) != (0, 0))
    count = per_chunk - (embedding and (r, c) == (0, 0)) - (loss and (r, c) == (pp - 1, vp - 1))
    return offset, count


@pytest.mark.parametrize("embedding,loss", [(True, False), (False, True), (True, True)])
def test_layer_ranges_accounting_matches_megatron(embedding, loss):
    for pp in (1, 2, 3, 4, 8, 16):
        for vp in (1, 2, 3, 4, 8):
            if pp == 1 and vp > 1:
                continue
            for layers in range(1, 3 * pp * vp + 1):
                if (layers + embedding + loss) % (pp * vp):
                    continue
                want = {(r, c): _megatron_layers(layers, pp, vp, r, c, embedding, loss)
                        for r in range(pp) for c in range(vp)}
                assert pipeline_layer_ranges(layers, pp, vp, embedding=embedding, loss=loss) == want


@pytest.mark.parametrize("kw,match", [
    (dict(num_layers=6, pp=4, embedding=True), "divide evenly over 4 pipeline stages"),
    (dict(num_layers=6, pp=2, vp=3, embedding=True, loss=True), "do not split over 3 virtual stages"),
    (dict(num_layers=6, pp=2, first=2, embedding=True), "one or the other"),
    (dict(num_layers=6, pp=2, last=3, loss=True), "one or the other"),
    (dict(num_layers=6, pp=2, vp=3, style="v", loss=True), "two chunks"),
])
def test_layer_range_accounting_errors(kw, match):
    with pytest.raises(ConfigError, match=match):
        pipeline_layer_ranges(**kw)


def test_virtual_pipeline_size_flags():
    """--num-layers-per-virtual-pipeline-stage counts the embedding / loss slots; --num-virtual-stages-per-
    pipeline-rank gives the chunk count directly and is the one form uneven first/last stages take."""
    from omnitron.core.parallel.pipeline.layout import virtual_pipeline_size as vps

    assert vps(126, 16, 1, None, embedding=True, loss=True) == 8
    assert vps(126, 16, 2, None, embedding=True, loss=True) == 4
    assert vps(8, 2, 2, None) == 2 and vps(8, 2, None, None) is None
    assert vps(126, 16, None, 8, 7, 7) == 8 and vps(8, 2, None, 4) == 4
    for args, kw, match in [((126, 16, 4, None, 7, 7), {}, "--num-virtual-stages-per-pipeline-rank instead"),
                            ((8, 2, 2, 2), {}, "give one of them"),
                            ((8, 2, None, 0), {}, "must be >= 1"),
                            ((126, 16, 2, None), {}, "not divisible"),
                            ((126, 16, 3, None), dict(embedding=True, loss=True), r"\+ 2 .* not divisible")]:
        with pytest.raises(ConfigError, match=match):
            vps(*args, **kw)


_CLI = ["--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "1",
        "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]


def _cli(layers: int, pp: int, *flags: str):
    from omnitron.core.training.arguments import parse_settings

    return parse_settings(_CLI + ["--num-layers", str(layers), "--pipeline-model-parallel-size", str(pp),
                                  "--global-batch-size", str(2 * pp), *flags], pp)


def test_account_and_virtual_stage_flags_from_the_command_line():
    """Megatron's flag names reach the layout; the silent first/last + layers-per-chunk case is refused."""
    both = ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
    p = _cli(126, 16, *both, "--num-layers-per-virtual-pipeline-stage", "1").parallel
    assert p.virtual_pipeline_model_parallel_size == 8
    assert p.account_for_embedding_in_pipeline_split and p.account_for_loss_in_pipeline_split
    assert _cli(126, 16, "--decoder-first-pipeline-num-layers", "6", "--decoder-last-pipeline-num-layers", "8",
                "--num-virtual-stages-per-pipeline-rank", "2").parallel.virtual_pipeline_model_parallel_size == 2
    assert _cli(8, 2, "--num-virtual-stages-per-pipeline-rank", "2").parallel.virtual_pipeline_model_parallel_size == 2
    assert _cli(6, 1, *both).parallel.pipeline_model_parallel_size == 1  # pp 1: nothing to balance, accepted
    for flags, match in [
        (["--decoder-first-pipeline-num-layers", "7", "--decoder-last-pipeline-num-layers", "7",
          "--num-layers-per-virtual-pipeline-stage", "4"], "--num-virtual-stages-per-pipeline-rank instead"),
        (["--decoder-first-pipeline-num-layers", "7", "--decoder-last-pipeline-num-layers", "7",
          "--num-virtual-stages-per-pipeline-rank", "8"], "rank 0 holds 7 layers, which do not split over 8"),
        (["--decoder-first-pipeline-num-layers", "7", *both], "one or the other"),
        (["--num-layers-per-virtual-pipeline-stage", "1", "--num-virtual-stages-per-pipeline-rank", "8"],
         "give one of them"),
        (["--account-for-embedding-in-pipeline-split"], r"\+ 1 .* = 127 must divide evenly over 16"),
        ([*both, "--num-virtual-stages-per-pipeline-rank", "3"], "do not split over 3 virtual stages")]:
        with pytest.raises(ConfigError, match=match) as info:
            _cli(126, 16, *flags)
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="a pipeline chunk holds no layer"):  # --cpu-offloading runs per chunk
        _cli(6, 2, *both, "--num-virtual-stages-per-pipeline-rank", "4", "--cpu-offloading-num-layers", "1")


@pytest.mark.parametrize("kw,match", [
    (dict(num_layers=7, pp=2), "divide evenly"),
    (dict(num_layers=8, pp=2, vp=3), "virtual stages"),
    (dict(num_layers=8, pp=2, first=5, last=4), "exceed --num-layers"),
    (dict(num_layers=8, pp=2, first=3, last=3), "must hold all"),
    (dict(num_layers=8, pp=1, first=3), "pipeline-model-parallel-size > 1"),
    (dict(num_layers=9, pp=4, first=1), "layers left after"),
    (dict(num_layers=8, pp=2, vp=2, first=2, style="v"), "V-shaped"),
    (dict(num_layers=12, pp=2, vp=3, style="v"), "two chunks"),
])
def test_layer_range_errors(kw, match):
    with pytest.raises(ConfigError, match=match):
        pipeline_layer_ranges(**kw)


GROUPED = [(p, v, m, n) for p in (2, 3, 4, 8) for v in (2, 3) for n in (p + 1, 2 * p) for m in range(n, 3 * p + 2)
           if m % n == 0 or m % n >= p]


@pytest.mark.parametrize("pp,vp,m,n", GROUPED)
def test_interleaved_in_groups_is_complete_and_deadlock_free(pp, vp, m, n):
    """--microbatch-group-size-per-virtual-pipeline-stage N: every action once, no deadlock on the simulated clock
    (the order itself is Megatron's: test_megatron_schedule.py), and rank 0 warms up (vp - 1) N + 2 (pp - 1)
    forwards (Megatron's count) before its first backward."""
    s = build_schedule("interleaved", pp, vp, m, n)
    simulate(s)
    first_b = next(i for i, a in enumerate(s.tables[0]) if a.kind == "B")
    warmup = min((vp - 1) * n + 2 * (pp - 1), m * vp)
    assert first_b == (warmup if warmup == m * vp else warmup + 1)  # in the steady state one F precedes the B
