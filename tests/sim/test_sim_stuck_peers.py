"""A wait() blocked on an operation that a stuck member never issues (csrc/sim/stuck.cpp): raised within about a second
of the member's report, not at the timeout.

Told reports (test_sim_told_reports.py) reach the members of the stuck groups only: a rank waiting in a receive
whose sender sits in a deadlocked all-reduce on another group was told nothing, and waited for the whole bound
(OMNITRON_SIM_DEADLOCK_S) before gloo's own error. On NCCL it hangs behind the sender for good. Now a rank whose
device broke with a report publishes it in every group it is a member of, and a blocked wait (point-to-point, or a
collective the member never issued) raises it, naming the stuck rank and its report.

The program, 4 ranks: rank 2 destroys group A = [1, 2]; rank 1 all-reduces on A (NCCL hangs there: reported within
about a second, test_sim_released_group.py) before its send to rank 0; rank 0 waits in the receive from rank 1
(unbatched, or in a batch_isend_irecv) before its all-reduce on B = [0, 3]; rank 3 all-reduces on B. Each of ranks 1,
0 and 3 fails, naming the one before it, within FAST_S. A member that released the group before posting the
counterpart of a peer's blocked send or receive is reported the same way (it waited for the bound before too).
"""
from __future__ import annotations

import pytest

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim

pytestmark = [requires_sim(), pytest.mark.multiprocess, pytest.mark.planted]
ENV = {"OMNITRON_SIM_DEADLOCK_S": "30", "OMNITRON_STRICT_COLLECTIVES": "1"}  # the check's report, not the bound's
# a search a poll (at most 1 s, SearchPace) after each report is published: three links, the rest scheduler noise;
# far below the bound (30 s), which the waits hit before the fix
FAST_S = 10.0
_KEEP: list = []  # the groups, referenced until the process ends: gloo's connections stay open, as a live NCCL peer's


def stuck_chain(batched: bool) -> dict:
    """The module's program. Per rank: "" or its error's first line, and the seconds its last operation took."""
    import time

    import torch
    import torch.distributed as dist

    from omnitron.backends import get_backend

    from tests.sim.test_sim_group_order import _exit_soon

    dev, me = get_backend().device(), dist.get_rank()
    a, b = dist.new_group([1, 2]), dist.new_group([0, 3])
    _KEEP.extend([a, b])  # rank 2's A outlives this call: released, not closed (gloo would fail rank 1 first)
    t = torch.ones(8, device=dev)
    start = time.monotonic()
    try:
        if me == 2:
            dist.destroy_process_group(a)
        elif me == 1:
            dist.all_reduce(t, group=a)
            dist.send(t, 0)
        elif me == 0:
            if batched:
                [work] = dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, 1)])
                work.wait()
            else:
                dist.recv(t, 1)
            dist.all_reduce(t, group=b)
        else:
            dist.all_reduce(t, group=b)
        error = ""
    except RuntimeError as err:
        error = str(err).splitlines()[0]
    _exit_soon()  # every rank: ranks 0, 1 and 3 hold broken communicators (no collective barrier at the end)
    return {"error": error, "s": time.monotonic() - start}


@pytest.mark.parametrize("batched", [False, True], ids=["unbatched", "batched"])
def test_a_wait_on_a_stuck_peer_raises_its_report(batched):
    r0, r1, r2, r3 = run_distributed(stuck_chain, 4, batched, backend="sim", env=ENV, timeout_s=90)
    assert r2["error"] == "", r2
    released = "rank 2 (rank 1 of the group) released the group"
    m = r1["error"]
    assert m.startswith("sim: collective deadlock on group '") and released in m, m
    m = r0["error"]
    assert m.startswith("sim: point-to-point deadlock on group '"), m
    assert " (of the group) waits in wait() on recv " in m, m
    assert "for rank 1's matching operation, which rank 1 never issues: it is stuck" in m, m
    assert released in m and "all_reduce on group '" in m and "(collective #1 of the group)" in m, m  # rank 1's
    assert m.count("test_sim_stuck_peers.py") == 2, m  # the receive's call site and the all-reduce's
    m = r3["error"]
    assert m.startswith("sim: collective deadlock on group '") and "rank 3 waits in wait() on all_reduce" in m, m
    assert "for rank 0 (rank 0 of the group), which completed 0 of the group's collectives and runs no more" in m, m
    assert "which rank 1 never issues" in m and released in m, m  # rank 0's report, which holds rank 1's
    for r in (r0, r1, r3):
        assert r["s"] < FAST_S, (r0, r1, r3)


def released_before_its_send(batched: bool) -> dict:
    """Rank 1 destroys a new group [0, 1] (kept referenced: its connections stay open) without posting the send that
    rank 0 then waits for on it, unbatched or in a batch. Per rank: "" or the error's first line, and the seconds."""
    import time

    import torch
    import torch.distributed as dist

    from omnitron.backends import get_backend

    from tests.sim.test_sim_group_order import _exit_soon

    dev, me = get_backend().device(), dist.get_rank()
    g = dist.new_group([0, 1])
    _KEEP.append(g)
    t = torch.ones(8, device=dev)
    start = time.monotonic()
    error = ""
    if me == 1:
        dist.destroy_process_group(g)
    else:
        try:
            if batched:
                [work] = dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, 1, group=g)])
                work.wait()
            else:
                dist.recv(t, 1, group=g)
        except RuntimeError as err:
            error = str(err).splitlines()[0]
    _exit_soon()  # rank 0 holds a broken communicator
    return {"error": error, "s": time.monotonic() - start}


@pytest.mark.parametrize("batched", [False, True], ids=["unbatched", "batched"])
def test_a_wait_on_a_peer_that_released_the_group_fails_fast(batched):
    r0, r1 = run_distributed(released_before_its_send, 2, batched, backend="sim", env=ENV, timeout_s=90)
    m = r0["error"]
    assert m.startswith("sim: point-to-point deadlock on group '"), m
    assert "for rank 1's matching operation, which rank 1 never issues: it released the group" in m, m
    assert "test_sim_stuck_peers.py" in m, m  # the receive's call site
    assert r0["s"] < FAST_S and r1["error"] == "", (r0, r1)
