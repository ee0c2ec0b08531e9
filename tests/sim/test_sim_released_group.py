"""A member that released a group (destroy_process_group) before issuing the collective a peer waits on
(csrc/sim/collective_wait.cpp, publish_released): NCCL hangs there, and so did sim until gloo noticed the process
gone. The release publishes how many of the group's collectives the member issued; the peer's blocked wait()
reports it at its next search, naming the member, the count and the collective waited on."""
from __future__ import annotations

import pytest

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim

pytestmark = [requires_sim(), pytest.mark.multiprocess, pytest.mark.planted]
ENV = {"OMNITRON_SIM_DEADLOCK_S": "30", "OMNITRON_STRICT_COLLECTIVES": "1"}  # the check's report, not the bound's
FAST_S = 10.0  # a search a poll (at most 1 s, SearchPace) after the wait blocks: the rest is scheduler noise
# rank 1 keeps its process (and gloo's connections) this long after releasing the group: past FAST_S's typical
# report (about a second), below the 10 s after which rank 0's _exit_soon ends it before both ranks reported
HOLD_S = 5.0


def released_then_waited() -> dict:
    """Both ranks all-reduce once on a new group; rank 1 destroys it, rank 0 all-reduces on it again. Rank 0: its
    error's first line and the seconds it took; rank 1: ""."""
    import time

    import torch
    import torch.distributed as dist

    from omnitron.backends import get_backend

    from tests.sim.test_sim_group_order import _exit_soon

    dev, me = get_backend().device(), dist.get_rank()
    g = dist.new_group([0, 1])
    t = torch.ones(8, device=dev)
    dist.all_reduce(t, group=g)
    if me == 1:
        dist.destroy_process_group(g)
        time.sleep(HOLD_S)  # g stays referenced: gloo's connections stay open, as a live NCCL peer's would
        _exit_soon()
        return {"error": "", "s": 0.0}
    start = time.monotonic()
    try:
        dist.all_reduce(t, group=g)
        return {"error": "", "s": time.monotonic() - start}
    except RuntimeError as err:
        _exit_soon()
        return {"error": str(err).splitlines()[0], "s": time.monotonic() - start}


def test_a_wait_on_a_group_a_member_released_fails_fast():
    r0, r1 = run_distributed(released_then_waited, 2, backend="sim", env=ENV, timeout_s=90)
    m = r0["error"]
    assert m.startswith("sim: collective deadlock on group '") and "rank 1 (rank 1 of the group) released" in m, m
    assert "after issuing 1 of its collectives" in m and "(collective #2 of the group)" in m, m
    assert "test_sim_released_group.py" in m, m  # the call site of the all-reduce waited on
    assert r0["s"] < FAST_S and r1["error"] == "", (r0, r1)
