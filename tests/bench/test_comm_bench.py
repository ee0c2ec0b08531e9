"""``omnitron bench comm`` as nccl-tests measures: the bus-bandwidth factors equal the bytes a rank sends in the
ring algorithms (counted by a step-by-step simulation, not by the formula), the timed span holds only the calls
and one synchronization (recorded calls), groups split intra- and inter-node by ``LOCAL_WORLD_SIZE``, and two
cpu ranks each report their own placement."""
from __future__ import annotations

import random
import time

import pytest
import torch

from omnitron.bench import comm


def _ring_bytes_sent(op: str, n: int, total: float) -> float:
    """Bytes one rank sends in nccl's ring ``op`` over ``n`` ranks of a ``total``-byte ``S``, walking the ring
    step by step and averaging over the ranks: a reduce-scatter phase and an all-gather phase each take
    ``n - 1`` steps in which every rank forwards one ``S / n`` chunk to its successor; all-to-all sends each
    other rank its ``S / n`` slice; broadcast (pipelined from the root) and send/receive move ``S`` once."""
    chunk = total / n
    sent = [0.0] * n
    phases = {"reduce_scatter": 1, "all_gather": 1, "all_reduce": 2}.get(op, 0)
    for _ in range(phases):
        for _step in range(n - 1):
            for r in range(n):
                sent[r] += chunk
    if op == "all_to_all":
        for r in range(n):
            sent[r] += sum(chunk for peer in range(n) if peer != r)
    if op in ("broadcast", "sendrecv", "p2p"):
        sent = [total] * n  # every rank forwards the buffer once (the last of a broadcast chain: to no one)
    return sum(sent) / n if op != "broadcast" else max(sent)


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
                                "sendrecv", "p2p"])
def test_bus_factor_is_the_ring_bytes_per_byte(op):
    # busbw = algbw x factor is defined so that busbw is what each rank's link carries: bytes sent / S
    rng = random.Random()
    for n in [2, 3, 8] + [rng.randint(2, 64) for _ in range(5)]:
        total = float(rng.randint(1, 1 << 30))
        want = _ring_bytes_sent(op, n, total) / total
        assert comm.bus_factor(op, n) == pytest.approx(want, rel=1e-12), (op, n)


class _Recorder:
    """A fake backend and collectives recording every call, with a clock that records its reads."""

    def __init__(self):
        self.events = []
        self.collectives = self

    def synchronize(self):
        self.events.append("sync")

    def barrier(self, group=None):
        self.events.append("barrier")

    def clock(self):
        self.events.append("clock")
        return float(len(self.events))

    def call(self):
        self.events.append("op")


def test_timed_span_has_no_barrier_inside():
    rec = _Recorder()
    warmup, iters = random.randint(1, 4), random.randint(2, 9)
    comm.timed_s(rec.call, rec, rec, warmup, iters, clock=rec.clock)
    first, last = rec.events.index("clock"), len(rec.events) - 1 - rec.events[::-1].index("clock")
    inside = rec.events[first + 1:last]
    assert inside == ["op"] * iters + ["sync"]  # the calls back to back, one synchronization after the last
    assert rec.events[:first] == ["op"] * warmup + ["sync", "barrier"]  # warm-up, then the ranks aligned once


class _Groups:
    def __init__(self):
        self.made = []

    def new_group(self, ranks):
        self.made.append(tuple(ranks))
        return len(self.made)


@pytest.mark.parametrize("world,per_node", [(8, 4), (12, 3), (4, 4)])
def test_groups_split_intra_and_inter_node(world, per_node):
    g = _Groups()
    rank = random.randrange(world)
    mine = {x.kind: x for x in comm.groups(g, rank, world, per_node)}
    nodes = world // per_node
    assert mine["world"].ranks == tuple(range(world)) and mine["world"].nodes == nodes
    if nodes == 1:
        assert set(mine) == {"world"} and not g.made
        return
    node, local = divmod(rank, per_node)
    assert mine["intra"].ranks == tuple(node * per_node + i for i in range(per_node)) and mine["intra"].nodes == 1
    assert mine["inter"].ranks == tuple(n * per_node + local for n in range(nodes)) and mine["inter"].local == 1
    assert len(g.made) == nodes + per_node  # every rank creates every group, in one order


@pytest.mark.slow
def test_two_cpu_ranks_each_placed_and_timed():  # (the fast suite runs 2 cpu ranks in test_bench_suite.py)
    rows = comm.run("cpu", nproc=2, ops=["all_reduce", "sendrecv"], byte_sizes=[4096], rounds=3, budget_s=0.2,
                    warmup=1)
    assert {r["op"] for r in rows} == {"all_reduce", "sendrecv"}
    for r in rows:
        assert r["group"] == "world" and r["ranks"] == 2 and r["devices"] == ["cpu:0", "cpu:0"]  # one host device
        assert 1 <= r["iters"] <= 3 and r["ms"] > 0
        assert r["busbw_gbs"] == pytest.approx(r["bytes"] / (r["ms"] * 1e-3) / 1e9 * comm.bus_factor(r["op"], 2))


@pytest.mark.slow
def test_two_sim_ranks_each_on_their_own_device():
    """On sim (8 simulated devices) two spawned ranks allocate and time on sim:0 and sim:1, the devices their
    buffers were on as each rank reports them (57 s at load 14 on the 2-core EPYC, 2026-12-04: slow)."""
    rows = comm.run("sim", nproc=2, ops=["all_reduce"], byte_sizes=[4096], rounds=2, budget_s=0.2, warmup=1)
    assert rows and all(r["devices"] == ["sim:0", "sim:1"] for r in rows)


def test_placement_uses_local_rank(monkeypatch):
    class Dev:
        index = None

        def device_count(self):
            return 4

        def set_device(self, i):
            self.index = i

    d = Dev()
    monkeypatch.setenv("LOCAL_RANK", "6")
    assert comm.placement(d, 13) == 2 and d.index == 2  # LOCAL_RANK, modulo the devices seen
    monkeypatch.delenv("LOCAL_RANK")
    assert comm.placement(d, 3) == 3 and d.index == 3


class _ThreadWorld:
    """Ranks as threads of one process: a backend and collectives in lock step (the reductions a rank sees are
    computed from every rank's deposit), and point-to-point calls taking ``p2p_s`` each."""

    def __init__(self, world: int, p2p_s: float):
        import threading

        self.world, self.p2p_s, self.slots = world, p2p_s, [None] * world
        self.gate, self.local = threading.Barrier(world), threading.local()

    def view(self, rank: int):

        class Rank:
            collectives = self

            def current_device(self):
                return torch.device("cpu")

            def synchronize(self):
                pass

        self.local.rank = rank
        return Rank()

    def barrier(self, group=None):
        self.gate.wait()

    def world_size(self, group=None):
        return self.world

    def all_reduce(self, t, op=None, group=None):
        from omnitron.backends.collectives import ReduceOp

        self.slots[self.local.rank] = t.clone()
        self.gate.wait()
        stack = torch.stack(self.slots)
        self.gate.wait()
        t.copy_(stack.sum(0) if op == ReduceOp.SUM else stack.max(0).values)

    def send(self, x, peer):
        time.sleep(self.p2p_s)

    recv = send


def test_p2p_of_an_odd_group_averages_the_ranks_that_take_part():
    """Three ranks: 0 -> 1 is the pair and rank 2 sits out. Each pair call takes at least ``p2p_s`` (a sleep),
    so the time per call is at least that: the idle rank's near-zero time is not averaged in (it was: 2/3 of it,
    so the bandwidth read 1.5x high)."""
    import threading

    p2p_s, world = random.uniform(0.004, 0.008), 3
    fake, rows = _ThreadWorld(world, p2p_s), {}

    def rank(r):
        rows[r] = comm.measure(fake.view(r), r, world, ["p2p"], [1024], rounds=3, budget_s=1.0, warmup=1)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    (row,) = rows[0]
    assert rows[1] == rows[2] == rows[0] and row["ranks"] == 3
    assert row["ms"] >= p2p_s * 1e3  # the pair's own calls: time.sleep sleeps at least as long as asked
    assert row["algbw_gbs"] == pytest.approx(row["bytes"] / (row["ms"] * 1e-3) / 1e9, rel=1e-12)
