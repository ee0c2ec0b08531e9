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
POLL_S = 1.0  # a cycle is found a poll or two (0.1 s each) after its last batch: ample on a loaded machine


def _random_program(gen: torch.Generator, mismatch: bool = False) -> list:
    """Two ranks' batches: rank 0 sends ``n01`` messages to rank 1 and receives ``n10``, in a random interleaving
    cut into batches at random points, and rank 1 the reverse; ``[rank][batch] = [(kind, k, tag)]`` (k-th message
    of its direction, a random tag in 0..2 that both ends give it; ``mismatch``: one message's receive has another
    tag than its send, where there is a message)."""
    n01, n10 = (int(torch.randint(0, 4, (1,), generator=gen)) for _ in range(2))
    tags = [torch.randint(0, 3, (n,), generator=gen).tolist() for n in (n01, n10)]  # [direction][k]: the send's
    received = [list(t) for t in tags]  # the receive's
    if mismatch and n01 + n10:
        d = 0 if n10 == 0 or (n01 and torch.rand(1, generator=gen) < 0.5) else 1
        k = int(torch.randint(0, len(tags[d]), (1,), generator=gen))
        received[d][k] = (tags[d][k] + 1) % 3
    program = []
    for me in (0, 1):
        ops = ([("send", k, tags[me][k]) for k in range((n01, n10)[me])]
               + [("recv", k, received[1 - me][k]) for k in range((n10, n01)[me])])
        sends, recvs = [o for o in ops if o[0] == "send"], [o for o in ops if o[0] == "recv"]
        order = [int(b) for b in torch.randperm(len(ops), generator=gen) < len(sends)]  # 1: the next send
        program.append(_cut([(sends if pick else recvs).pop(0) for pick in order], gen))
    return program


def _cut(seq: list, gen: torch.Generator) -> list:
    """``seq`` cut into batches (each non-empty) before each operation with probability 1/2."""
    cuts, batches = torch.rand(len(seq), generator=gen) < 0.5, [[]]
    for i, op in enumerate(seq):
        if i and cuts[i]:
            batches.append([])
        batches[-1].append(op)
    return [b for b in batches if b]


def _log(program: list, tags: bool = True) -> list:
    """The model's input: ``[rank][batch] = [(kind, peer, tag)]`` (``tags=False``: every tag 0)."""
    return [[[(kind, 1 - me, tag if tags else 0) for kind, _, tag in batch] for batch in batches]
            for me, batches in enumerate(program)]


def _verdict(program: list) -> str:
    """What the model says of ``program``: "runs", "stuck" (its groups deadlock) or "tags" (they would run, but
    NCCL pairs a send with a receive of another tag)."""
    if replay(_log(program, tags=False)) is not None:
        return "stuck"
    return "runs" if replay(_log(program)) is None else "tags"


def _programs(seed: int, want: str, count: int) -> list:
    """``count`` random programs whose :func:`_verdict` is ``want``, drawn from ``seed``."""
    gen, out = torch.Generator().manual_seed(seed), []
    while len(out) < count:
        program = _random_program(gen, mismatch=want == "tags")
        if any(program) and _verdict(program) == want:
            out.append(program)
    return out


def _payload(seed: int, index: int, src: int, k: int) -> torch.Tensor:
    """The k-th message from rank ``src`` in program ``index``: its size and values follow from the four."""
    gen = torch.Generator().manual_seed(seed * 1009 + index * 101 + src * 13 + k)
    return torch.randn(int(torch.randint(1, 40, (1,), generator=gen)), generator=gen, dtype=torch.float64)


def run_programs(programs: list, seed: int, ring: bool = False) -> dict:
    """Run this rank's side of each program in turn (all its batches issued, then every work waited), then one
    exchange with the peer, which a rank fails at the latest when its peer found a deadlock (``ring``: three-rank
    programs, ``(kind, peer, k)`` with tag 0; then POLL_S and one all-reduce, which fails on a rank whose
    communicator a cycle report aborted). Returns the count of receives that got something other than the sender's
    message, the error and its seconds."""
    import torch.distributed as dist

    from omnitron.backends import get_backend

    dev, me = get_backend().device(), dist.get_rank()
    wrong, start = 0, time.perf_counter()
    try:
        for index, program in enumerate(programs):
            held, works = [], []
            for batch in program[me]:
                ops = []
                for op in batch:
                    kind, peer, k, tag = (*op, 0) if ring else (op[0], 1 - me, *op[1:])
                    src, dst = (me, peer) if kind == "send" else (peer, me)
                    want = _payload(seed, index, src * 8 + dst, k)
                    t = want.to(dev) if kind == "send" else torch.empty_like(want, device=dev)
                    held.append((kind, t, want))
                    ops.append(dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer, tag=tag))
                works += dist.batch_isend_irecv(ops)
            for w in works:
                w.wait()
            wrong += sum(not torch.equal(t.cpu(), want) for kind, t, want in held if kind == "recv")
        if ring:
            time.sleep(POLL_S)
            dist.all_reduce(torch.zeros(1, device=dev))
        else:
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
    the batch with the receive is stuck; one batch with two receives against two one-send batches is not, unless
    the receives' tags are the sends' swapped."""
    assert _verdict([[[("send", 0, 0)], [("recv", 0, 0)]], [[("send", 0, 0)], [("recv", 0, 0)]]]) == "stuck"
    assert _verdict([[[("send", 0, 1)], [("send", 1, 2)]], [[("recv", 0, 1), ("recv", 1, 2)]]]) == "runs"
    assert _verdict([[[("send", 0, 1)], [("send", 1, 2)]], [[("recv", 0, 2), ("recv", 1, 1)]]]) == "tags"


def test_programs_the_model_completes_run_and_deliver():
    """Random programs NCCL completes at any payload size (the model's verdict), tags agreeing: no report, and
    each receive gets exactly the peer's message (a copy: exact)."""
    seed = int(torch.randint(0, 2**31, (1,)))
    programs = _programs(seed, "runs", count=12)
    results = run_distributed(run_programs, 2, programs, seed, backend="sim", env=ENV, timeout_s=120)
    for r in results:
        assert r["error"] == "" and r["wrong"] == 0, (seed, r)


@pytest.mark.parametrize("drawn", [False, True])
def test_stuck_groups_fail_both_ranks_fast(drawn):
    """The brief's case (each rank's send-only batch before the batch with its receive) and a random program the
    model finds stuck, after legal ones: both ranks fail within FAST_S with one line naming both ranks' batches
    and both call sites (gloo alone completes such a program: tests/sim's cpu twin below)."""
    seed = int(torch.randint(0, 2**31, (1,)))
    brief = [[[("send", 0, 0)], [("recv", 0, 0)]], [[("send", 0, 0)], [("recv", 0, 0)]]]
    programs = _programs(seed + 1, "runs", 3) + (_programs(seed, "stuck", 1) if drawn else [brief])
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
    stuck = [[[[("send", 0, 0)], [("recv", 0, 0)]], [[("send", 0, 0)], [("recv", 0, 0)]]]]
    for r in run_distributed(run_programs, 2, stuck, seed, backend="cpu", env=ENV, timeout_s=120):
        assert r == {"wrong": 0, "error": "", "s": 0.0}, r


def test_tags_the_model_finds_paired_otherwise_fail_both_ranks_fast():
    """A random program the model completes but where NCCL pairs a send with a receive of another tag (the one
    message whose receive was given another tag), after legal ones: both ranks fail within FAST_S with one line
    naming the transfer the model names (sender, receiver, its place), both operations and both call sites."""
    import ast

    seed = int(torch.randint(0, 2**31, (1,)))
    [mismatch] = _programs(seed, "tags", 1)
    src, dst, k = ast.literal_eval(replay(_log(mismatch)).split(":")[0].removeprefix("transfer "))
    programs = _programs(seed + 1, "runs", 3) + [mismatch]
    k += sum(op[0] == "send" for p in programs[:-1] for batch in p[src] for op in batch)  # sim counts from the start
    for r in run_distributed(run_programs, 2, programs, seed, backend="sim", env=ENV, timeout_s=120):
        m = r["error"]
        assert "\n" not in m and "sim: point-to-point tag mismatch" in m, (seed, m)
        assert f"rank {src} (of the group) posted send " in m and f"batched send #{k + 1} to rank {dst}," in m, m
        assert f"batched receive #{k + 1} from rank {src}:" in m, m
        assert m.count("test_sim_group_order.py") == 2 and r["s"] < FAST_S, (r["s"], m)
        assert r["wrong"] == 0, r


# ---- cycles of batches through three ranks (csrc/sim/cycle.cpp) ----------------------------------------------
BRIEF_RING = [[[("send", (me + 1) % 3, 0)], [("recv", (me - 1) % 3, 0)]] for me in range(3)]
"""Each rank's send to the next rank in a batch of its own, before the batch with the receive from the previous:
every pair is in order (one send-only batch against one receive-only batch), the ring is not."""


def _random_ring(gen: torch.Generator, world: int = 3) -> list:
    """``[rank][batch] = [(kind, peer, k)]``: each ordered pair of ranks exchanges 0..2 messages (k-th of its
    channel), each rank posting its operations in a random order cut into batches at random points."""
    n = {(a, b): int(torch.randint(0, 3, (1,), generator=gen)) for a in range(world) for b in range(world) if a != b}
    program = []
    for me in range(world):
        ops = [("send", b) for (a, b), m in n.items() if a == me for _ in range(m)]
        ops += [("recv", a) for (a, b), m in n.items() if b == me for _ in range(m)]
        seq, count = [], {}
        for i in torch.randperm(len(ops), generator=gen).tolist():
            k = count[ops[i]] = count.get(ops[i], -1) + 1
            seq.append((*ops[i], k))
        program.append(_cut(seq, gen))
    return program


def _ring_log(program: list, pair: set | None = None) -> list:
    """The model's input (tags 0); ``pair``: only those two ranks' operations with each other."""
    keep = [[[(kind, peer, 0) for kind, peer, _ in b if pair is None or {me, peer} == pair] for b in batches]
            for me, batches in enumerate(program)]
    return [[b for b in batches if b] for batches in keep]


def _ring_verdict(program: list) -> str:
    """"runs", "pair" (two ranks' batches wait for each other: group_order.cpp's case) or "cycle" (every pair's
    batches run on their own; NCCL deadlocks on a cycle through three ranks)."""
    if replay(_ring_log(program)) is None:
        return "runs"
    pairs = [{a, b} for a in range(len(program)) for b in range(a + 1, len(program))]
    return "pair" if any(replay(_ring_log(program, p)) is not None for p in pairs) else "cycle"


def _rings(seed: int, want: str, count: int) -> list:
    gen, out = torch.Generator().manual_seed(seed), []
    while len(out) < count:
        program = _random_ring(gen)
        if any(program) and _ring_verdict(program) == want:
            out.append(program)
    return out


def test_model_ring_check():
    """Hand-derived: the brief's ring is a cycle; with rank 0 receiving first it runs (rank 0's receive meets rank
    2's send, then rank 0's send meets rank 1's receive); a crossed pair inside a ring is the pair check's."""
    assert _ring_verdict(BRIEF_RING) == "cycle"
    assert _ring_verdict([BRIEF_RING[0][::-1]] + BRIEF_RING[1:]) == "runs"
    crossed = [[[("send", 1, 0)], [("recv", 1, 0)]], [[("send", 0, 0)], [("recv", 0, 0)]], []]
    assert _ring_verdict(crossed) == "pair"


def test_ring_programs_the_model_completes_run_and_deliver():
    """Random three-rank programs NCCL completes (the model's verdict): no report from the replay of all ranks
    (no false cycle), and each receive gets exactly its sender's message."""
    seed = int(torch.randint(0, 2**31, (1,)))
    programs = _rings(seed, "runs", count=8)
    for r in run_distributed(run_programs, 3, programs, seed, True, backend="sim", env=ENV, timeout_s=150):
        assert r["error"] == "" and r["wrong"] == 0, (seed, r)


@pytest.mark.parametrize("drawn", [False, True])
def test_cycles_through_three_ranks_fail_every_rank(drawn):
    """The brief's ring and a random program the model finds stuck on a cycle through the three ranks (every
    pair's batches in order on their own), after legal ones: every rank fails within FAST_S (+ POLL_S) with one
    line naming the three batches each waits in, the three it waits for, and their call sites; gloo alone
    completes the ring (test below)."""
    seed = int(torch.randint(0, 2**31, (1,)))
    programs = _rings(seed + 1, "runs", 2) + (_rings(seed, "cycle", 1) if drawn else [BRIEF_RING])
    for r in run_distributed(run_programs, 3, programs, seed, True, backend="sim", env=ENV, timeout_s=150):
        m = r["error"]
        assert "\n" not in m and "sim: point-to-point cycle deadlock" in m and "through ranks 0, " in m, (seed, m)
        assert all(f"rank {i}'s batch #" in m for i in range(3)) and m.count(" waits for rank ") == 3, m
        assert m.count("test_sim_group_order.py") == 6 and r["s"] < FAST_S + POLL_S, (r["s"], m)
        assert r["wrong"] == 0, r


def test_a_cycle_fails_the_other_ranks_of_the_group():
    """Rank 3 exchanges with rank 0 (a legal batch) and then waits in an all-reduce while ranks 0..2 close the
    brief's ring: on NCCL rank 3 hangs too (its all-reduce needs the cycle's ranks), so it fails with the same
    report instead of waiting for gloo's timeout."""
    program = [[[("send", 3, 0)]] + BRIEF_RING[0], BRIEF_RING[1], BRIEF_RING[2], [[("recv", 0, 0)]]]
    assert _ring_verdict(program) == "cycle"
    seed = int(torch.randint(0, 2**31, (1,)))
    for r in run_distributed(run_programs, 4, [program], seed, True, backend="sim", env=ENV, timeout_s=150):
        m = r["error"]
        assert "\n" not in m and "sim: point-to-point cycle deadlock" in m and "through ranks 0, " in m, m
        assert "rank 3" not in m and r["s"] < FAST_S + POLL_S and r["wrong"] == 0, (r["s"], m)


def test_brief_ring_completes_on_gloo():
    seed = int(torch.randint(0, 2**31, (1,)))
    for r in run_distributed(run_programs, 3, [BRIEF_RING], seed, True, backend="cpu", env=ENV, timeout_s=120):
        assert r == {"wrong": 0, "error": "", "s": 0.0}, r


def ring_then_destroy() -> None:
    """The brief's ring (both batches posted, then waited: gloo completes them), then at once the end of the job:
    the process group destroyed within a watchdog poll of the last batch, before the watchdog's passes could run."""
    import torch.distributed as dist

    from omnitron.backends import get_backend

    dev, me = get_backend().device(), dist.get_rank()
    works = []
    for batch in BRIEF_RING[me]:
        works += dist.batch_isend_irecv([dist.P2POp(dist.isend if kind == "send" else dist.irecv,
                                                    torch.zeros(4, device=dev), peer) for kind, peer, _ in batch])
    for w in works:
        w.wait()
    dist.destroy_process_group()


def test_a_cycle_posted_just_before_the_end_fails_the_destroy():
    """Without the end-of-job check (the communicator's release replays until its batches completed or a cycle is
    found) the ring's ranks left destroy_process_group with no report, where NCCL hangs: every rank's destroy raises
    the cycle report instead."""
    with pytest.raises(RuntimeError) as err:
        run_distributed(ring_then_destroy, 3, backend="sim", env=ENV, timeout_s=150)
    m = str(err.value)
    for rank in range(3):
        assert f"rank {rank}: RuntimeError: sim: point-to-point cycle deadlock on group" in m, m
