"""Planted stream and collective bugs: each is caught on sim with a message naming the cause, and each
passes silently on plain cpu/gloo (so the simulator, not the program, is what catches it).

The cases are the bugs a GPU cluster shows on day one and a CPU never does: a collective's result read
before ``wait()``, a tensor used on a side stream freed without ``record_stream``, a host read of a
``non_blocking`` device-to-host copy before synchronizing, two groups' collectives issued in opposite
orders on two ranks, and a background thread's collectives racing the main thread's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim

pytestmark = [requires_sim(), pytest.mark.multiprocess, pytest.mark.planted]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEADLOCK_S = 3  # OMNITRON_SIM_DEADLOCK_S for these runs: a deadlock is reported within ~3 s
JOIN_S = 4.0  # how long a case waits for its other thread once one has failed
ENV = {"OMNITRON_SIM_DEADLOCK_S": str(DEADLOCK_S), "OMNITRON_STRICT_COLLECTIVES": "0"}
# Strict mode is off: its fingerprint exchange is itself a collective per group, so opposite orders would
# block there first (on cpu too); the point here is what the device model catches on its own.


def _exit_soon(after_s: float = JOIN_S + 6.0) -> None:
    """Cases that leave a collective stuck in gloo (as a deadlocked NCCL communicator is) mark the device wedged:
    run_distributed's closing barrier then waits on the rendezvous store for the slowest peer (a collective barrier
    would queue behind the stuck collective: one communicator kernel a device, as NCCL), and the worker ends its
    process as soon as its result is written (destroying the stuck group could wait for gloo's own timeout). A
    peer left inside a gloo collective never reaches that barrier, and only this process's end (its connections
    closing) frees it: so the process also ends ``after_s`` after returning, result or not (the default leaves a
    slow peer JOIN_S and more to reach the barrier, so that both results are written)."""
    from omnitron.testing.distributed import device_wedged

    device_wedged()
    timer = threading.Timer(after_s, os._exit, (0,))
    timer.daemon = True  # a process that exits normally does not wait for it
    timer.start()


def _outcome(fn) -> str:
    """'' when ``fn`` runs silently, else the error's message (NCCL's argument checks raise ValueError)."""
    try:
        fn()
        return ""
    except (RuntimeError, ValueError) as err:
        return str(err)


def _timed_outcome(fn) -> tuple[str, float]:
    """``_outcome(fn)`` and the seconds it took; a case that failed ends its process soon (``_exit_soon``)."""
    start = time.perf_counter()
    message = _outcome(fn)
    if message:
        _exit_soon()
    return message, time.perf_counter() - start


def read_before_wait() -> str:
    from omnitron.backends import get_backend

    be = get_backend()
    x = torch.full((64,), float(torch.distributed.get_rank() + 1), device=be.device())

    def bug():
        work = be.collectives.all_reduce(x, async_op=True)
        try:
            (x * 2).sum()  # reads the all-reduce's output before wait()
        finally:
            work.wait()
    return _outcome(bug)


def freed_without_record_stream() -> str:
    from omnitron.backends import get_backend

    be = get_backend()

    def bug():
        x = torch.randn(4096, device=be.device())
        side = be.Stream()
        side.wait_stream(be.current_stream())
        with be.stream(side):
            y = x * 2  # x is read on the side stream...
        del x  # ...and freed without x.record_stream(side): its block is free for the main stream at once
        torch.ones(4, device=be.device()).add_(1)  # the next device call reports it
        be.current_stream().wait_stream(side)
        return y
    return _outcome(bug)


def early_host_read() -> dict:
    from omnitron.backends import get_backend

    be = get_backend()
    x = torch.arange(1024, dtype=torch.float32, device=be.device())
    host = x.to("cpu", non_blocking=True)
    early = host.clone()  # a host read before synchronizing
    be.synchronize()
    return {"early_nan": bool(early.isnan().all()), "late_right": torch.equal(host, torch.arange(1024.0))}


def opposite_orders() -> str:
    import torch.distributed as dist

    from omnitron.backends import get_backend

    be = get_backend()
    rank = dist.get_rank()
    g1, g2 = dist.new_group([0, 1]), dist.new_group([0, 1])
    a, b = torch.ones(8, device=be.device()), torch.ones(8, device=be.device())
    order = [(a, g1), (b, g2)] if rank == 0 else [(b, g2), (a, g1)]

    def bug():
        works = [dist.all_reduce(t, group=g, async_op=True) for t, g in order]
        for w in works:
            w.wait()
    message, took = _timed_outcome(bug)
    return f"{message} [{took:.1f} s]" if message else ""


def one_queue_behind() -> str:
    """Rank 0 issues an all-reduce on g1, then one on g2, and waits on both; rank 1 waits on g2's before it issues
    g1's. NCCL: rank 0's g2 all-reduce runs behind its g1 one, which waits for rank 1, which waits in g2's: both
    hang. Only rank 0's queue holds two collectives (the bound's report); rank 1 sits in gloo on g2 (no wait()
    cycle: rank 0 issued g2's all-reduce)."""
    import torch.distributed as dist

    from omnitron.backends import get_backend

    be = get_backend()
    g1, g2 = dist.new_group([0, 1]), dist.new_group([0, 1])
    a, b = torch.ones(8, device=be.device()), torch.ones(8, device=be.device())

    def bug():
        if dist.get_rank() == 0:
            for w in [dist.all_reduce(a, group=g1, async_op=True), dist.all_reduce(b, group=g2, async_op=True)]:
                w.wait()
        else:
            dist.all_reduce(b, group=g2)
            dist.all_reduce(a, group=g1)
    message, took = _timed_outcome(bug)
    return f"{message} [{took:.1f} s]" if message else ""


def thread_race(out: str = "") -> str:
    import torch.distributed as dist

    from omnitron.backends import get_backend

    be = get_backend()
    main_group, save_group = dist.new_group([0, 1]), dist.new_group([0, 1])
    errors, stop = [], threading.Event()

    def loop(group):
        x = torch.ones(256, device=be.device())
        for _ in range(200):
            if stop.is_set():
                return
            try:
                dist.all_reduce(x, group=group)
            except RuntimeError as err:
                errors.append(str(err))
                stop.set()
                return

    background = threading.Thread(target=loop, args=(save_group,), name="background-save", daemon=True)
    background.start()
    loop(main_group)
    if out and errors:  # a rank whose peer is left in a collective may not get to return it
        with open(f"{out}/rank{dist.get_rank()}.txt", "w") as f:
            f.write(errors[0])
    background.join(timeout=JOIN_S)
    if errors:  # the test reads the files, not the results: no need to wait long for a peer left in a collective
        _exit_soon(1.0)
    return errors[0] if errors else ""


@pytest.mark.parametrize("backend", ["sim", "cpu", "musa-double"])
def test_result_read_before_wait(backend):
    """Also on the MUSA double, whose reports come from the same C++: they named "(unknown site)" while only
    loading the extension as ``sim`` installed the call-site hook."""
    from omnitron.testing.musa_double import TARGET

    env = {**ENV, "OMNITRON_EXTRA_BACKENDS": TARGET} if backend == "musa-double" else ENV
    messages = run_distributed(read_before_wait, 2, backend=backend, env=env, timeout_s=60)
    for m in messages:
        if backend == "cpu":
            assert m == "", m
        else:
            assert "touched the output of all_reduce" in m and "before its work.wait()" in m, m
            assert "test_sim_planted.py:" in m and "thread MainThread" in m, m  # the call site and the thread


@pytest.mark.parametrize("backend", ["sim", "cpu", "musa-double"])
def test_side_stream_tensor_freed_without_record_stream(backend):
    """Also on the MUSA double: its streams are the sim device's (they were no-ops, and the bug ran silently)."""
    from omnitron.testing.musa_double import TARGET

    env = {**ENV, "OMNITRON_EXTRA_BACKENDS": TARGET} if backend == "musa-double" else ENV
    [m] = run_distributed(freed_without_record_stream, 1, backend=backend, env=env, timeout_s=60)
    if backend == "cpu":
        assert m == "", m
    else:
        assert "was freed while stream" in m and "record_stream" in m, m


EARLY_READ = """
import torch
from omnitron.backends import get_backend
be = get_backend("{backend}")
x = torch.arange(4096, dtype=torch.float32, device=be.device())
host = x.to("cpu", non_blocking=True)
early = host.clone()  # a host read before synchronizing
be.synchronize()
print("silent", torch.equal(host, torch.arange(4096.0)))
"""


@pytest.mark.parametrize("backend", ["sim", "cpu"])
def test_host_read_of_non_blocking_copy_before_synchronize(backend):
    """sim guards the destination's pages until the copy lands: the read ends the process with the cause."""
    proc = subprocess.run([sys.executable, "-c", EARLY_READ.format(backend=backend)], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    if backend == "cpu":
        assert proc.returncode == 0 and "silent True" in proc.stdout, proc.stderr[-2000:]
    else:
        assert proc.returncode != 0, proc.stdout
        assert "non_blocking device-to-host copy" in proc.stderr and "before it completed" in proc.stderr, proc.stderr
        assert "<string>" in proc.stderr  # the call site


@pytest.mark.parametrize("backend", ["sim", "cpu"])
def test_unguarded_early_read_shows_garbage(backend):
    """With the guard pages off (or on a page the copy only partly covers) the early read is NaN on sim."""
    env = {**ENV, "OMNITRON_SIM_GUARD_PAGES": "0"}
    [r] = run_distributed(early_host_read, 1, backend=backend, env=env, timeout_s=60)
    # sim: the pinned destination holds NaN until the copy lands; cpu: the "copy" is the tensor itself
    assert r == {"early_nan": backend == "sim", "late_right": True}, r


@pytest.mark.parametrize("backend", ["sim", "cpu"])
def test_opposite_collective_orders_deadlock(backend):
    messages = run_distributed(opposite_orders, 2, backend=backend, env=ENV, timeout_s=60)
    for rank, m in enumerate(messages):
        if backend == "cpu":
            assert m == "", m  # gloo runs the two groups independently: no deadlock to see
            continue
        assert "collective deadlock" in m and m.count("all_reduce on group") == 2, m
        assert m.count("test_sim_planted.py") == 2, m  # both call sites
        seconds = float(m.rsplit("[", 1)[1].split()[0])
        assert DEADLOCK_S <= seconds <= 30, m


@pytest.mark.parametrize("backend", ["sim", "cpu"])
def test_the_bounds_report_reaches_a_peer_stuck_in_gloo(backend):
    """Rank 0's bound report is told to the members of both groups: rank 1, whose queue holds one collective (no
    report of its own), raises it from its blocked wait() at its next poll (SearchPace: at most kMost = 1 s), not at
    gloo's timeout (the run's 60 s timeout here)."""
    messages = run_distributed(one_queue_behind, 2, backend=backend, env=ENV, timeout_s=60)
    for m in messages:
        if backend == "cpu":
            assert m == "", m  # gloo runs the two groups independently
            continue
        assert "\n" not in m and m.startswith("sim: collective deadlock on sim:") and " waits behind it " in m, m
        assert m.count("test_sim_planted.py") == 2, m  # rank 0's two call sites, on both ranks
        seconds = float(m.rsplit("[", 1)[1].split()[0])
        assert DEADLOCK_S <= seconds <= DEADLOCK_S + 10, m  # 10 s: scheduler noise on a loaded CI, as FAST_S


@pytest.mark.parametrize("backend", ["sim", "cpu"])
def test_background_thread_collectives_race_main(backend, tmp_path):
    if backend == "cpu":
        assert run_distributed(thread_race, 2, backend=backend, env=ENV, timeout_s=90) == ["", ""]
        return
    try:  # the rank that catches it stops issuing: its peer may be left in a collective, and the run fail
        run_distributed(thread_race, 2, str(tmp_path), backend=backend, env=ENV, timeout_s=40)
    except RuntimeError:
        pass
    messages = [p.read_text() for p in sorted(tmp_path.glob("rank*.txt"))]
    assert any("two threads at once" in m or "collective deadlock" in m for m in messages), messages
    caught = next(m for m in messages if m)
    assert "background-save" in caught and "MainThread" in caught, caught


def p2p_between_collectives() -> str:
    """A send issued between two collectives of its group on rank 0, its receive after both on rank 1: NCCL
    runs the group's operations in issue order, so rank 0's second all-reduce waits behind the send, which waits
    for rank 1's receive, which waits behind rank 1's second all-reduce."""
    import torch.distributed as dist

    from omnitron.backends import get_backend

    be = get_backend()
    rank, group = dist.get_rank(), dist.new_group([0, 1])
    a, b, c = (torch.ones(4, device=be.device()) for _ in range(3))
    x = torch.arange(6.0, device=be.device())

    def bug():
        dist.all_reduce(a, group=group)
        if rank == 0:
            send = dist.isend(x, 1, group=group)
            dist.all_reduce(b, group=group)
            send.wait()
        else:
            dist.all_reduce(b, group=group)
            dist.irecv(x, 0, group=group).wait()
    message = _outcome(bug)
    if not message:  # rank 0's report comes with its next operation on the group (its communicator is aborted)
        message = _outcome(lambda: dist.all_reduce(c, group=group))
    if message:
        _exit_soon()
    return message


@pytest.mark.parametrize("backend", ["sim", "cpu"])
def test_send_between_collectives_received_after_them_deadlocks(backend):
    messages = run_distributed(p2p_between_collectives, 2, backend=backend, env=ENV, timeout_s=60)
    for m in messages:
        if backend == "cpu":
            assert m == "", m  # gloo's send does not wait behind the group's collectives
            continue
        assert "\n" not in m and "point-to-point deadlock" in m, m
        assert "rank 0 (of the group) issued send" in m and "after 1 of the group's collectives" in m, m
        assert "rank 1 issued recv" in m and "after 2 of the group's collectives" in m, m
        assert m.count("test_sim_planted.py") >= 2, m  # both call sites



def test_the_gpu_scripts_ground_truth_runs_on_sim(tmp_path):
    """benchmarks/planted_ground_truth.py (step "planted" of scripts/device_bench.sh and device_check.sh) runs its
    one-process cases: sim catches each, naming the cause (the two-rank ones are the tests above)."""
    out = tmp_path / "planted.jsonl"
    cases = "freed_without_record_stream,early_host_read,cross_stream_read"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "planted_ground_truth.py"), "--backend",
                           "sim", "--tries", "1", "--cases", cases, "--out", str(out)],
                          capture_output=True, text=True, timeout=180, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    rows = {r["case"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == set(cases.split(",")) and all(r["caught"] for r in rows.values()), rows
    assert "record_stream" in rows["freed_without_record_stream"]["effect"], rows
    assert "race" in rows["cross_stream_read"]["effect"], rows


def strided_collectives(p2p: bool) -> dict:
    """Collectives given strided views (NCCL refuses them before any work, gloo takes them), and with ``p2p``
    point-to-point given a transposed tensor (NCCL moves its bytes in memory order) and a tensor with gaps."""
    import torch.distributed as dist

    from omnitron.backends import get_backend

    be, rank = get_backend(), dist.get_rank()
    d = be.device()
    grid = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank)).to(d)
    out = torch.zeros(16, device=d)
    cases = {
        "all_reduce": lambda: dist.all_reduce(grid.t()),
        "broadcast": lambda: dist.broadcast(grid[:, 0], 0),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out.new_zeros(6, 4), grid[:, :3].t()),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(out[::2], torch.ones(16, device=d)),
        "all_to_all_single": lambda: dist.all_to_all_single(out[:8], grid[:2, :4].t()),
    }
    result = {op: _outcome(call) for op, call in cases.items()}
    if not p2p:
        return result
    peer = 1 - rank
    sent = torch.randn(3, 5, generator=torch.Generator().manual_seed(7)).to(d)
    got = torch.zeros(5, 3, device=d)
    if rank == 0:
        dist.send(sent.t(), peer)  # dense, not contiguous: its bytes are ``sent``'s, row by row
    else:
        dist.recv(got, peer)
    result["transposed"] = got.cpu().double()
    result["gaps"] = _outcome(lambda: dist.send(grid[:, 0], peer) if rank == 0 else dist.recv(grid[:, 1], peer))
    return result


@pytest.mark.parametrize("backend", ["sim", "cpu"])
def test_strided_tensors_in_collectives(backend):
    """sim holds collectives to NCCL's layout rule (a single tensor contiguous, each listed one dense: "Tensors
    must be contiguous"), which gloo does not have, and moves a point-to-point tensor's bytes as NCCL does: a
    transposed send arrives in memory order (compared with plain torch's flat view of the sent values; exact,
    a copy), and one with gaps is refused (NCCL would move bytes that are not its elements)."""
    p2p = backend == "sim"  # gloo refuses a non-contiguous send ("input tensor has to be contiguous")
    results = run_distributed(strided_collectives, 2, p2p, backend=backend, env=ENV, timeout_s=90)
    sent = torch.randn(3, 5, generator=torch.Generator().manual_seed(7)).double()
    for rank, r in enumerate(results):
        for op in ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"):
            if backend == "cpu":  # gloo takes the views, except all_to_all_single's
                assert ("contiguous" in r[op]) if op == "all_to_all_single" else r[op] == "", (op, r[op])
            else:
                assert r[op].startswith(f"sim: {op} was given a non-contiguous tensor"), (op, r[op])
                assert "Tensors must be contiguous" in r[op] and ".contiguous()" in r[op] and "\n" not in r[op], r[op]
        if rank == 1 and p2p:
            memory_order = sent.reshape(-1).view(5, 3)  # what a GPU receives
            assert torch.equal(r["transposed"], memory_order), r["transposed"]
        if p2p:
            assert "tensor with gaps" in r["gaps"] and ".contiguous()" in r["gaps"], r["gaps"]


# ---- a pair's unbatched point-to-point order (csrc/sim/pair_order.cpp) ---------------------------------------
PAIR_ENV = {**ENV, "OMNITRON_SIM_DEADLOCK_S": "30"}  # a report within FAST_S is the check's, not the bound's
FAST_S = 10.0  # the check reports at issue (+ the watchdog's 0.1 s poll): 10 s is scheduler noise on a loaded CI
PROGRAMS = {  # per case, each rank's operations with its peer in issue order ("b:" = in one batch_isend_irecv)
    "send_first_both": (["send", "recv"], ["send", "recv"]),
    "recv_first_both": (["recv", "send"], ["recv", "send"]),
    "blocking_send_first_both": (["send!", "recv!"], ["send!", "recv!"]),  # "!": dist.send / dist.recv
    "recv_first_on_one": (["recv", "send"], ["send", "recv"]),
    "blocking_recv_first_on_one": (["recv!", "send!"], ["send!", "recv!"]),
    "batched_send_first_both": (["b:send", "b:recv"], ["b:send", "b:recv"]),
    "two_sends_then_receive": (["send", "send", "recv"], ["recv", "recv", "send"]),
    "batched_send_unbatched_recv": (["b:send"], ["recv"]),  # never match on NCCL: two communicators
    "unbatched_send_batched_recv": (["send"], ["b:recv"]),
    # "@t": tag t. NCCL ignores tags: the k-th send pairs with the k-th receive, gloo pairs by tag
    "unbatched_tags_swapped": (["send@1", "send@0"], ["recv@0", "recv@1"]),
    "batched_tags_swapped": (["b:send@1", "b:send@0"], ["b:recv@0", "b:recv@1"]),
    "batched_tags_in_order": (["b:send@1", "b:send@0", "b:recv@2"], ["b:recv@1", "b:send@2", "b:recv@0"]),
    "batched_sizes_differ": (["b:send=96"], ["b:recv"]),  # "=n": n elements (else 64); gloo ends rank 1's process
    "unbatched_send_larger": (["send=96"], ["recv"]),  # gloo: rank 1 aborts ("Received data size doesn't match")
    "unbatched_send_smaller": (["send=32"], ["recv"]),  # gloo: fills the receive's first 32, silently
}


def pair_program(case: str) -> dict:
    """Run rank ``dist.get_rank()``'s side of ``PROGRAMS[case]`` on fresh random tensors; returns the error ("" when
    none), the seconds until it, what this rank sent and what it received (on the host, in issue order)."""
    import torch.distributed as dist

    from omnitron.backends import get_backend

    be, rank = get_backend(), dist.get_rank()
    ops = PROGRAMS[case][rank]
    size = [int(op.partition("=")[2] or 64) for op in ops]
    sent = [torch.randn(n, dtype=torch.float64) for op, n in zip(ops, size) if "send" in op]
    got = [torch.zeros(n, dtype=torch.float64, device=be.device()) for op, n in zip(ops, size) if "recv" in op]
    out, into = iter(t.to(be.device()) for t in sent), iter(got)

    def program():
        works, batch = [], []
        for op in ops:
            kind, _, tag = op.removeprefix("b:").partition("=")[0].rstrip("!").partition("@")
            tensor, tag = next(out) if kind == "send" else next(into), int(tag or 0)
            if op.startswith("b:"):
                batch.append(dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, 1 - rank, tag=tag))
            elif op.endswith("!"):
                (dist.send if kind == "send" else dist.recv)(tensor, 1 - rank, tag=tag)
            else:
                works.append((dist.isend if kind == "send" else dist.irecv)(tensor, 1 - rank, tag=tag))
        works += dist.batch_isend_irecv(batch) if batch else []
        for w in works:
            w.wait()
        dist.all_reduce(torch.zeros(1, device=be.device()))  # a rank whose peer found a deadlock fails here
    message, took = _timed_outcome(program)
    received = [] if message else [t.cpu() for t in got]  # a failed receive's output is still in flight
    return {"error": message, "s": took, "sent": sent, "got": received}


@pytest.mark.parametrize("case", ["send_first_both", "recv_first_both", "blocking_send_first_both"])
def test_unbatched_pair_deadlock_is_reported_fast(case):
    """Both ranks' first unbatched operation with the other is a send (or both a receive): NCCL runs a pair's
    unbatched operations one at a time in issue order, each waiting for the peer's matching one, so both wait
    forever (gloo buffers them and completes). Both ranks fail at once with one line naming both operations."""
    kind = "recv" if case.startswith("recv") else "send"
    for r in run_distributed(pair_program, 2, case, backend="sim", env=PAIR_ENV, timeout_s=90):
        m = r["error"]
        assert "\n" not in m and "sim: point-to-point deadlock" in m, m
        assert m.count(f"issued {kind} shape=[64] dtype=Double") == 2, m
        assert "rank 0" in m and "rank 1" in m and m.count("test_sim_planted.py") == 2, m  # both call sites
        assert "batch_isend_irecv" in m and r["s"] < FAST_S, (r["s"], m)


@pytest.mark.parametrize("case", ["batched_send_unbatched_recv", "unbatched_send_batched_recv"])
def test_batched_send_with_unbatched_receive_is_reported(case):
    """A send inside a batch received outside one (or the reverse): ProcessGroupNCCL runs the batch on the group's
    communicator and the lone operation on the pair's (torch's default, lazy initialization; omnitron passes no
    ``device_id``), so they never match. Both ranks fail with one line naming both operations."""
    for r in run_distributed(pair_program, 2, case, backend="sim", env=PAIR_ENV, timeout_s=90):
        m = r["error"]
        assert "\n" not in m and "sim: point-to-point deadlock" in m, m
        assert "inside a batch_isend_irecv" in m and "outside a batch" in m and "batch both or neither" in m, m
        assert m.count("test_sim_planted.py") == 2 and r["s"] < FAST_S, (r["s"], m)


@pytest.mark.parametrize("case", ["send_first_both", "recv_first_both", "batched_send_unbatched_recv",
                                  "unbatched_send_batched_recv"])
def test_unbatched_pair_deadlock_passes_on_gloo(case):
    """The planted programs above complete on cpu/gloo: the simulator, not the program, catches them."""
    results = run_distributed(pair_program, 2, case, backend="cpu", env=PAIR_ENV, timeout_s=90)
    assert [r["error"] for r in results] == ["", ""], results


@pytest.mark.parametrize("case", ["unbatched_tags_swapped", "batched_tags_swapped"])
def test_tags_that_pair_otherwise_on_nccl_are_reported(case):
    """Rank 0 sends two tensors to rank 1 with tags 1 then 0, rank 1 receives tags 0 then 1: gloo pairs by tag
    (twin below), NCCL ignores tags and pairs first with first, so each receive would get the other tensor. Both
    ranks fail at once, before the second of the first pair is launched, with one line naming both operations,
    the peer and both call sites."""
    batched = case.startswith("batched")
    for r in run_distributed(pair_program, 2, case, backend="sim", env=PAIR_ENV, timeout_s=90):
        m = r["error"]
        assert "\n" not in m and "sim: point-to-point tag mismatch" in m and "NCCL ignores tags" in m, m
        assert "send shape=[64] dtype=Double to rank 1 tag=1" in m, m
        assert "recv shape=[64] dtype=Double from rank 0 tag=0" in m, m
        assert ("batched send #1 to rank 1" in m) if batched else ("unbatched operation #1" in m), m
        assert m.count("test_sim_planted.py") == 2 and r["s"] < FAST_S, (r["s"], m)


@pytest.mark.parametrize("case,sent", [("batched_sizes_differ", 96), ("unbatched_send_larger", 96),
                                       ("unbatched_send_smaller", 32)])
def test_sizes_that_differ_are_reported(case, sent):
    """Rank 0 sends 96 (or 32) elements where rank 1 receives 64, in a batch or not: NCCL's ncclSend/ncclRecv need
    the same count and datatype; gloo, given the larger send first, ends rank 1's process (an abort, no report), and
    fills the front of a larger receive silently (twin below). Both ranks fail at once, before the second of the
    two is launched, with one line naming both operations and call sites."""
    batched = case.startswith("batched")
    for r in run_distributed(pair_program, 2, case, backend="sim", env=PAIR_ENV, timeout_s=90):
        m = r["error"]
        assert "\n" not in m and "sim: point-to-point size mismatch" in m and "same count and datatype" in m, m
        assert f"send shape=[{sent}] dtype=Double to rank 1" in m and "recv shape=[64] dtype=Double from rank 0" in m
        assert ("batched send #1 to rank 1" in m) if batched else ("unbatched operation #1" in m), m
        assert m.count("test_sim_planted.py") == 2 and r["s"] < FAST_S, (r["s"], m)


def test_smaller_unbatched_send_fills_part_of_the_receive_on_gloo():
    """The twin on cpu/gloo: the program completes, and rank 1's receive holds rank 0's 32 elements then its own
    zeros (exact: a copy), a result NCCL does not promise."""
    r0, r1 = run_distributed(pair_program, 2, "unbatched_send_smaller", backend="cpu", env=PAIR_ENV, timeout_s=90)
    assert r0["error"] == r1["error"] == "", (r0, r1)
    assert torch.equal(r1["got"][0][:32], r0["sent"][0]) and not r1["got"][0][32:].any()


@pytest.mark.parametrize("case", ["unbatched_tags_swapped", "batched_tags_swapped"])
def test_swapped_tags_cross_on_gloo(case):
    """The twin on cpu/gloo: the program runs, and each receive gets the send of its tag, the one NCCL would not
    give it (rank 1's first receive holds rank 0's second tensor: exact, a copy)."""
    r0, r1 = run_distributed(pair_program, 2, case, backend="cpu", env=PAIR_ENV, timeout_s=90)
    assert r0["error"] == r1["error"] == "", (r0, r1)
    assert torch.equal(r1["got"][0], r0["sent"][1]) and torch.equal(r1["got"][1], r0["sent"][0])


@pytest.mark.parametrize("case", ["recv_first_on_one", "blocking_recv_first_on_one", "batched_send_first_both",
                                  "two_sends_then_receive", "batched_tags_in_order"])
def test_matched_pair_orders_run(case):
    """Orders NCCL completes: each place of the pair's unbatched order a send on one rank and a receive on the
    other, or send and receive in one batch. Each receive gets what the peer sent there (exact: a copy)."""
    results = run_distributed(pair_program, 2, case, backend="sim", env=PAIR_ENV, timeout_s=90)
    for rank, r in enumerate(results):
        assert r["error"] == "", r["error"]
        assert len(r["got"]) == len(results[1 - rank]["sent"]) > 0
        for got, sent in zip(r["got"], results[1 - rank]["sent"]):
            assert torch.equal(got, sent)


def ring_to_other_peers() -> dict:
    """Unbatched send to the next rank, then receive from the previous one, waited after both are issued: each
    pair sees one send and one receive (NCCL runs pairs on their own communicators, in torch's default lazy
    initialization)."""
    import torch.distributed as dist

    from omnitron.backends import get_backend

    be, rank, n = get_backend(), dist.get_rank(), dist.get_world_size()
    sent, got = torch.randn(16, dtype=torch.float64), torch.zeros(16, dtype=torch.float64, device=be.device())
    works = [dist.isend(sent.to(be.device()), (rank + 1) % n), dist.irecv(got, (rank - 1) % n)]
    message = _outcome(lambda: [w.wait() for w in works])
    return {"error": message, "sent": sent, "got": got.cpu()}


def test_unbatched_sends_to_different_peers_run():
    results = run_distributed(ring_to_other_peers, 3, backend="sim", env=PAIR_ENV, timeout_s=90)
    for rank, r in enumerate(results):
        assert r["error"] == "" and torch.equal(r["got"], results[(rank - 1) % 3]["sent"]), r


def even_odd_ring() -> dict:
    """Megatron's unbatched exchange with both neighbours (megatron/core/pipeline_parallel/p2p_communication.py
    ``_p2p_ops`` at d98e8a6, transcribed for more than two ranks): even ranks send to the next, receive from the
    previous, send to the previous, receive from the next; odd ranks receive from the previous, send to the next,
    receive from the next, send to the previous. Each pair sees a send against a receive at every place."""
    import torch.distributed as dist

    from omnitron.backends import get_backend

    be, rank, n = get_backend(), dist.get_rank(), dist.get_world_size()
    prev, nxt = (rank - 1) % n, (rank + 1) % n
    sent = {"next": torch.randn(8, dtype=torch.float64), "prev": torch.randn(8, dtype=torch.float64)}
    got = {side: torch.zeros(8, dtype=torch.float64, device=be.device()) for side in ("prev", "next")}
    ops = {"send_next": (dist.isend, sent["next"].to(be.device()), nxt), "recv_prev": (dist.irecv, got["prev"], prev),
           "send_prev": (dist.isend, sent["prev"].to(be.device()), prev), "recv_next": (dist.irecv, got["next"], nxt)}
    order = ["send_next", "recv_prev", "send_prev", "recv_next"] if rank % 2 == 0 else \
        ["recv_prev", "send_next", "recv_next", "send_prev"]
    works = [ops[name][0](ops[name][1], ops[name][2]) for name in order]
    message = _outcome(lambda: [w.wait() for w in works])
    return {"error": message, "sent": sent, "got": {side: t.cpu() for side, t in got.items()}}


def test_megatrons_even_odd_unbatched_ring_runs():
    n = 4
    results = run_distributed(even_odd_ring, n, backend="sim", env=PAIR_ENV, timeout_s=120)
    for rank, r in enumerate(results):
        assert r["error"] == "", r["error"]
        assert torch.equal(r["got"]["prev"], results[(rank - 1) % n]["sent"]["next"])
        assert torch.equal(r["got"]["next"], results[(rank + 1) % n]["sent"]["prev"])
