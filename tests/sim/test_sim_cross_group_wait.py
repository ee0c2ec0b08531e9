"""Cycles of wait() on collectives across groups (csrc/sim/collective_wait.cpp), against a model of NCCL.

Rank 0 waits on group A's all-reduce, which rank 1 issues only after its wait on group B's, which rank 0 issues
only after its own wait: NCCL hangs (each communicator runs its collectives in the order issued, once every member
issued them, and a host blocked in wait() issues nothing). On sim neither device queue ever held two collectives, so
the bound's report (comm_queue.cpp) never came and the job hung until the harness killed it. The reference is
:func:`model` (pure Python): random programs of all-reduces over two groups of three ranks that it completes must
run and sum exactly; a program it finds stuck, with a wait() cycle where sim stops, must fail every rank of the
cycle fast, on one line naming each rank's collective and call site. A stuck program that stops sim in its device
queues' order first (one drawn stuck program in about seven) gets the bound's report instead.
"""
from __future__ import annotations

import pytest
import torch

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim
from tests.sim.test_sim_wait_cycle import _fresh_seed

pytestmark = [requires_sim(), pytest.mark.multiprocess, pytest.mark.planted]
ENV = {"OMNITRON_SIM_DEADLOCK_S": "30", "OMNITRON_STRICT_COLLECTIVES": "1"}  # the check's report, not the bound's
FAST_S = 10.0  # found a few polls (0.05 s + 0.1 s each) after the last rank blocks: the rest is scheduler noise
GROUPS = ([0, 1, 2], [0, 1, 2])
BRIEF = [[(0, True), (1, True)], [(1, True), (0, True)], [(0, True), (1, True)]]
"""Ranks 0 and 2 wait on group 0's all-reduce before they issue group 1's; rank 1 the other way round."""
SEED_2089903283 = [[(1, False), (0, False), (0, True), (1, True), (1, False)],
                   [(1, True), (1, False), (0, False), (1, True), (0, False)],
                   [(1, True), (0, True), (0, True), (1, True), (1, False)]]
"""A wait() cycle through ranks 0 and 1 (rank 0 waits on group 0's #2, behind its #1, which rank 1 issued behind
its group-1 #2, which rank 0 has not issued) and rank 2 outside it, waiting on group 0's #1: issued by every member,
so the members' issued counts did not say that rank 1's device never runs it."""
SEED_616811642 = [[(1, False), (0, True), (1, False), (1, True), (0, False)],
                  [(0, False), (1, True), (1, True), (0, True), (1, True)],
                  [(0, False), (1, True), (0, True), (1, True), (1, True)]]
"""Stuck on NCCL in a wait() cycle, but sim stops first: rank 0's group-1 all-reduce #1 runs on its device ahead
of its group-0 #1, ranks 1 and 2 the other way round, and each waits for peers queued behind their own."""


def model(program: list, one_queue: bool) -> bool:
    """True when ``program`` (``[rank] = [(group, waited)]``, in issue order; the rest waited at the end)
    completes. The k-th collective of a group runs once every member issued its k-th and its (k-1)-th completed
    (the group's communicator runs them in order); a rank issues nothing while it waits on an incomplete one.
    ``one_queue``: also after every collective its rank issued before it (sim's device runs one at a time)."""
    issued, done = _final(program, one_queue)
    return all(len(issued[r]) == len(program[r]) for r in range(len(program))) and all(
        op in done for ops in issued for op in ops)


def _final(program: list, one_queue: bool) -> tuple:
    """:func:`model`'s state once nothing more runs: per rank the (group, k) issued, in order; the set done."""
    issued = [[] for _ in program]  # per rank: (group, k) in issue order
    done: set = set()

    def can_issue(r: int) -> bool:
        return len(issued[r]) < len(program[r]) and all(
            (g, k) in done for (g, k), (_, waited) in zip(issued[r], program[r]) if waited)

    def runs(g: int, k: int) -> bool:
        for m in GROUPS[g]:
            mine = issued[m]
            if (g, k) not in mine:
                return False
            if one_queue and any(op not in done for op in mine[:mine.index((g, k))]):
                return False
        return k == 1 or (g, k - 1) in done

    progress = True
    while progress:
        progress = False
        for r in range(len(program)):
            while can_issue(r):
                g = program[r][len(issued[r])][0]
                issued[r].append((g, sum(1 for x, _ in issued[r] if x == g) + 1))
                progress = True
        for ops in issued:
            for g, k in ops:
                if (g, k) not in done and runs(g, k):
                    done.add((g, k))
                    progress = True
    return issued, done


def wait_cycle(program: list) -> bool:
    """True when, where sim stops (one queue per device), ranks blocked in wait() form a cycle: each waits on a
    group's k-th collective that the next, itself blocked, has not issued. Otherwise sim is stuck only by its
    queue order (a collective waits behind another on some device), which the bound reports, not this check."""
    issued, done = _final(program, True)
    blocked = {}  # rank -> the (group, k) it waits on: a waited one not done, else the first (the end's waits)
    for r, ops in enumerate(issued):
        waited = [op for op, (_, w) in zip(ops, program[r]) if w and op not in done]
        rest = [op for op in ops if op not in done]
        if waited or rest:
            blocked[r] = (waited or rest)[0]
    edges = {r: {m for m in GROUPS[g] if m in blocked and sum(x == g for x, _ in issued[m]) < k}
             for r, (g, k) in blocked.items()}
    for start in edges:  # a path from start back to itself
        seen, todo = set(), list(edges[start])
        while todo:
            r = todo.pop()
            if r == start:
                return True
            if r not in seen:
                seen.add(r)
                todo.extend(edges[r])
    return False


def _random(gen: torch.Generator) -> list:
    """Each group 1..3 all-reduces; each rank issues them in a random interleaving, each waited with p 1/2."""
    counts = [int(torch.randint(1, 4, (1,), generator=gen)) for _ in GROUPS]
    program = []
    for _ in range(3):
        order = [g for g, n in enumerate(counts) for _ in range(n)]
        order = [order[int(i)] for i in torch.randperm(len(order), generator=gen)]
        program.append([(g, bool(torch.rand(1, generator=gen) < 0.5)) for g in order])
    return program


def _programs(seed: int, runs: bool, count: int) -> list:
    """Programs both models agree on (sim's one queue per device is NCCL's worst case; a program only it finds
    stuck is the bound's report, not this check's); stuck ones only where sim stops in a :func:`wait_cycle` (one
    drawn stuck program in about seven stops sim in its queue order first: SEED_616811642)."""
    gen, out = torch.Generator().manual_seed(seed), []
    while len(out) < count:
        program = _random(gen)
        if model(program, False) == runs and model(program, True) == runs and (runs or wait_cycle(program)):
            out.append(program)
    return out


def _value(seed: int, index: int, g: int, k: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1009 + index * 101 + g * 31 + k * 7 + rank)
    return torch.randint(-1000, 1000, (5,), generator=gen).to(torch.float64)  # integers: every sum order exact


def run_programs(programs: list, seed: int) -> dict:
    """This rank's side of each program in turn, then one all-reduce on the world; the count of sums that differ
    from the hand-computed ones, the error and its seconds."""
    import time

    import torch.distributed as dist

    from omnitron.backends import get_backend

    from tests.sim.test_sim_group_order import _exit_soon

    dev, me = get_backend().device(), dist.get_rank()
    groups = [dist.new_group(ranks) for ranks in GROUPS]
    wrong, start, error = 0, time.perf_counter(), ""
    try:
        for index, program in enumerate(programs):
            held, seen = [], {}
            for g, waited in program[me]:
                k = seen[g] = seen.get(g, 0) + 1
                t = _value(seed, index, g, k, me).to(dev)
                work = dist.all_reduce(t, group=groups[g], async_op=True)
                if waited:
                    work.wait()
                held.append((work, t, sum(_value(seed, index, g, k, r) for r in GROUPS[g])))
            for work, t, want in held:
                work.wait()
                wrong += not torch.equal(t.cpu(), want)
        dist.all_reduce(torch.zeros(1, device=dev))
    except RuntimeError as err:
        error = str(err)
        _exit_soon()
    return {"wrong": wrong, "error": error, "s": time.perf_counter() - start if error else 0.0}


def test_model_check():
    """Hand-derived: the brief's crossing is stuck; in the same order on every rank it runs; unwaited it runs on
    NCCL (each communicator is free to run its own) but not on one queue (sim's worst case, the bound's report)."""
    assert not model(BRIEF, False) and not model(BRIEF, True)
    assert model([BRIEF[0]] * 3, False) and model([BRIEF[0]] * 3, True)
    unwaited = [[(g, False) for g, _ in ops] for ops in BRIEF]
    assert model(unwaited, False) and not model(unwaited, True)
    assert wait_cycle(BRIEF) and not wait_cycle(unwaited)
    assert not model(SEED_616811642, False) and not model(SEED_616811642, True) and not wait_cycle(SEED_616811642)
    assert SEED_616811642 not in _programs(616811642, False, 1)  # the seed that drew it


def test_programs_the_model_completes_run_and_sum():
    """Random programs NCCL completes: no report (no false cycle) and every sum exact."""
    seed = _fresh_seed()
    got = run_distributed(run_programs, 3, _programs(seed, True, count=10), seed, backend="sim", env=ENV,
                          timeout_s=150)
    assert all(r["error"] == "" and r["wrong"] == 0 for r in got), (seed, got)


@pytest.mark.parametrize("drawn", [False, True])
def test_cross_group_wait_cycles_fail_fast(drawn):
    """The brief's crossing, or a random program the model finds stuck, after legal ones: every rank fails within
    FAST_S; the ranks of the cycle (every rank, with all groups over all ranks) name it on one line."""
    seed = _fresh_seed()
    programs = _programs(seed + 1, True, 2) + (_programs(seed, False, 1) if drawn else [BRIEF])
    for r in run_distributed(run_programs, 3, programs, seed, backend="sim", env=ENV, timeout_s=150):
        m = r["error"]
        assert "\n" not in m and "sim: collective wait() cycle deadlock across groups through ranks " in m, (seed, m)
        assert m.count(" waits in wait() on all_reduce on group '") >= 2, (seed, m)
        assert m.count("test_sim_cross_group_wait.py") == m.count(" waits in wait() on "), (seed, m)
        assert r["s"] < FAST_S and r["wrong"] == 0, (seed, r["s"], m)


def test_a_rank_waiting_behind_a_cycle_it_is_not_in_fails_fast():
    """SEED_2089903283: ranks 0 and 1 name their cycle; rank 2, waiting on a collective its stuck peers issued but
    will never run, names one of them as stuck (neither completed any of group 0's) with the cycle's report, within
    FAST_S (it waited for gloo's connection to close, and got that line, before)."""
    assert not model(SEED_2089903283, False) and wait_cycle(SEED_2089903283)
    got = run_distributed(run_programs, 3, [SEED_2089903283], 0, backend="sim", env=ENV, timeout_s=150)
    cycle = "sim: collective wait() cycle deadlock across groups through ranks 0, 1: "
    for r in got:
        assert "\n" not in r["error"] and cycle in r["error"] and r["s"] < FAST_S and r["wrong"] == 0, r
    m = got[2]["error"]
    assert m.startswith("sim: collective deadlock on group '") and " waits in wait() on all_reduce " in m, m
    assert any(f"(rank {i} of the group), which completed 0 of the group's collectives and runs no more: it is stuck"
               in m for i in (0, 1)), m  # either member of the cycle: neither ran group 0's #1
    assert not got[0]["error"].startswith("sim: collective deadlock on group '"), got[0]["error"]


def test_queue_order_stop_is_the_bounds_report():
    """SEED_616811642: sim stops in its queue order before any wait() cycle forms, so every rank (each one's queue
    holds two all-reduces) gets the deadlock bound's report, at the bound, and no cycle report (none is true)."""
    bound = 4.0
    env = {**ENV, "OMNITRON_SIM_DEADLOCK_S": str(int(bound))}
    for r in run_distributed(run_programs, 3, [SEED_616811642], 0, backend="sim", env=env, timeout_s=150):
        m = r["error"]
        assert m.startswith("sim: collective deadlock on sim:") and " waits behind it " in m, m
        assert bound <= r["s"] < bound + FAST_S and r["wrong"] == 0, (r["s"], m)  # not before the bound
