"""The order of a communicator's point-to-point groups (csrc/sim/group_order.cpp), against an independent model.

NCCL runs a communicator's ``batch_isend_irecv`` groups one after another, each until every operation in it met
its partner (the k-th send to a rank pairs with that rank's k-th receive); gloo runs each operation on its own,
so a program whose groups wait for each other completes there and hangs on the GPU. The reference here is the
replay model omnitron.testing.nccl_groups (pure Python, written before the C++ check): random
two-rank programs that it completes must run on sim with every receive getting what the peer sent, and one it
finds stuck must fail both ranks fast, naming both batches and their call sites.
"""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from omnitron.testing.distributed import run_distributed
from omnitron.testing.nccl_groups import replay
from omnitron.testing.sim import requires_sim

pytestmark = [requires_sim(), pytest.mark.multiprocess, pytest.mark.planted]
ENV = {"OMNITRON_SIM_DEADLOCK_S": "30", "OMNITRON_STRICT_COLLECTIVES": "0"}  # the check's report, not the bound's
FAST_S = 10.0  # reported when the later batch is issued (+ the watchdog's 0.1 s poll): the rest is scheduler noise


def _random_program(gen: torch.Generator) -> list:
    """Two ranks' batches: rank 0 sends ``n01`` messages to rank 1 and receives ``n10``, in a random interleaving
    cut into batches at random points, and rank 1 the reverse; ``[rank][batch] = [(kind, k)]`` (k-th message of
    its direction)."""
    n01, n10 = (int(torch.randint(0, 4, (1,), generator=gen)) for _ in range(2))
    program = []
    for me in (0, 1):
        ops = [("send", k) for k in range((n01, n10)[me])] + [("recv", k) for k in range((n10, n01)[me])]
        sends, recvs = [o for o in ops if o[0] == "send"], [o for o in ops if o[0] == "recv"]
        order = [int(b) for b in torch.randperm(len(ops), generator=gen) < len(sends)]  # 1: the next send
        seq = [(sends if pick else recvs).pop(0) for pick in order]
        cuts = torch.rand(len(seq), generator=gen) < 0.5
        batches = [[]]
        for i, op in enumerate(seq):
            if i and cuts[i]:
                batches.append([])
            batches[-1].append(op)
        program.append([b for b in batches if b])
    return program


def _log(program: list) -> list:
    """The model's input: ``[rank][batch] = [(kind, peer, tag)]``."""
    return [[[(kind, 1 - me, 0) for kind, _ in batch] for batch in batches] for me, batches in enumerate(program)]


def _programs(seed: int, want_stuck: bool, count: int) -> list:
    """``count`` random programs the model completes (or finds stuck, ``want_stuck``), drawn from ``seed``."""
    gen, out = torch.Generator().manual_seed(seed), []
    while len(out) < count:
        program = _random_program(gen)
        if any(program) and (replay(_log(program)) is not None) == want_stuck:
            out.append(program)
    return out


def _payload(seed: int, index: int, src: int, k: int) -> torch.Tensor:
    """The k-th message from rank ``src`` in program ``index``: its size and values follow from the four."""
    gen = torch.Generator().manual_seed(seed * 1009 + index * 101 + src * 13 + k)
    return torch.randn(int(torch.randint(1, 40, (1,), generator=gen)), generator=gen, dtype=torch.float64)


def run_programs(programs: list, seed: int) -> dict:
    """Run this rank's side of each program in turn (all its batches issued, then every work waited), then one
    exchange with the peer, which a rank fails at the latest when its peer found a deadlock.
    Returns the count of receives that got something other than the sender's message, the error and its seconds."""
    import torch.distributed as dist

    from omnitron.backends import get_backend

    dev, me = get_backend().device(), dist.get_rank()
    wrong, start = 0, time.perf_counter()
    try:
        for index, program in enumerate(programs):
            held, works = [], []
            for batch in program[me]:
                ops = []
                for kind, k in batch:
                    want = _payload(seed, index, me if kind == "send" else 1 - me, k)
                    t = want.to(dev) if kind == "send" else torch.empty_like(want, device=dev)
                    held.append((kind, t, want))
                    ops.append(dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, 1 - me))
                works += dist.batch_isend_irecv(ops)
            for w in works:
                w.wait()
            wrong += sum(not torch.equal(t.cpu(), want) for kind, t, want in held if kind == "recv")
        last = torch.zeros(1, device=dev)  # one exchange more: a rank whose peer found a deadlock fails here
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, last + me, 1 - me),
                                         dist.P2POp(dist.irecv, last, 1 - me)]):
            w.wait()
        return {"wrong": wrong, "error": "", "s": 0.0}
    except RuntimeError as err:
        error = str(err)
    _exit_soon()
    return {"wrong": wrong, "error": error, "s": time.perf_counter() - start}


def _exit_soon() -> None:
    """A failed case's process ends some seconds after returning (its result written): the peer's side of the
    broken communicator may still be in gloo, whose own timeout would otherwise hold the exit."""
    from omnitron.testing.distributed import device_wedged

    device_wedged()
    timer = threading.Timer(10.0, os._exit, (0,))
    timer.daemon = True
    timer.start()


def test_model_check():
    """The programs drawn are what the model says (hand-derived): both ranks posting a send-only batch before
    the batch with the receive is stuck; one batch with two receives against two one-send batches is not."""
    assert replay(_log([[[("send", 0)], [("recv", 0)]], [[("send", 0)], [("recv", 0)]]])) is not None
    assert replay(_log([[[("send", 0)], [("send", 1)]], [[("recv", 0), ("recv", 1)]]])) is None


def test_programs_the_model_completes_run_and_deliver():
    """Random programs NCCL completes at any payload size (the model's verdict): no report, and each receive gets
    exactly the peer's message (a copy: exact)."""
    seed = int(torch.randint(0, 2**31, (1,)))
    programs = _programs(seed, want_stuck=False, count=12)
    results = run_distributed(run_programs, 2, programs, seed, backend="sim", env=ENV, timeout_s=120)
    for r in results:
        assert r["error"] == "" and r["wrong"] == 0, (seed, r)


@pytest.mark.parametrize("drawn", [False, True])
def test_stuck_groups_fail_both_ranks_fast(drawn):
    """The brief's case (each rank's send-only batch before the batch with its receive) and a random program the
    model finds stuck, after legal ones: both ranks fail within FAST_S with one line naming both ranks' batches
    and both call sites (gloo alone completes such a program: tests/sim's cpu twin below)."""
    seed = int(torch.randint(0, 2**31, (1,)))
    stuck = _programs(seed, True, 1) if drawn else [[[[("send", 0)], [("recv", 0)]], [[("send", 0)], [("recv", 0)]]]]
    programs = _programs(seed + 1, False, 3) + stuck
    for r in run_distributed(run_programs, 2, programs, seed, backend="sim", env=ENV, timeout_s=120):
        m = r["error"]
        assert "\n" not in m and "sim: point-to-point group deadlock" in m, (seed, m)
        assert "rank 0's batch #" in m and "rank 1's batch #" in m, m
        assert m.count("test_sim_group_order.py") == 2 and r["s"] < FAST_S, (r["s"], m)
        assert r["wrong"] == 0, r


def test_stuck_groups_complete_on_gloo():
    """The brief's stuck program completes on cpu/gloo, which runs each operation on its own: the simulator, not
    the program, catches it."""
    seed = int(torch.randint(0, 2**31, (1,)))
    stuck = [[[[("send", 0)], [("recv", 0)]], [[("send", 0)], [("recv", 0)]]]]
    for r in run_distributed(run_programs, 2, stuck, seed, backend="cpu", env=ENV, timeout_s=120):
        assert r == {"wrong": 0, "error": "", "s": 0.0}, r
