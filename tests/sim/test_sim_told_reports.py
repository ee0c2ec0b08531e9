"""A deadlock report one rank finds and tells the other members of the stuck groups (csrc/sim/collective_wait.cpp)
names the group and the collective stuck there: a told rank raises it from a wait on that collective or a later one
of that group, where NCCL hangs, and never from a wait on another group, which completes on NCCL.

Ranks 0 and 1 close a wait() cycle on groups A = [0, 1, 2] and B = [0, 1] (rank 0 waits on A's all-reduce, which
rank 1 issues only after its wait on B's, which rank 0 issues only after its own wait). Rank 0 finds it and tells
ranks 1 and 2. Rank 2 has issued nothing on A: it first all-reduces on C = [2, 3] with rank 3, who is SLOW_S late
(a legal wait that blocks past the 100 ms after which a blocked wait polls), then all-reduces on A, where it hangs
on NCCL. Before told reports named their collectives, rank 2's wait on C raised A's report.
"""
from __future__ import annotations

import pytest
import torch

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim
from tests.sim.test_sim_wait_cycle import _fresh_seed

pytestmark = [requires_sim(), pytest.mark.multiprocess, pytest.mark.planted]
ENV = {"OMNITRON_SIM_DEADLOCK_S": "30", "OMNITRON_STRICT_COLLECTIVES": "1"}  # the check's report, not the bound's
SLOW_S = 1.0
FOUND = "test/cycle_found"  # set by rank 0 once it raised the cycle's report (told before it raises)


def _inputs(seed: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s fresh float64 input."""
    return torch.randn(8, generator=torch.Generator().manual_seed(seed * 17 + rank), dtype=torch.float64)


def cycle_then_legal_wait(seed: int) -> dict:
    """The module's program. Per rank: the sum on C (ranks 2 and 3, else None) and "" or the error's first line."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from omnitron.backends import get_backend
    from tests.sim.test_sim_group_order import _exit_soon

    dev, me = get_backend().device(), dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    a, b, c = dist.new_group([0, 1, 2]), dist.new_group([0, 1]), dist.new_group([2, 3])
    t = _inputs(seed, me).to(dev)
    out = {"sum": None, "error": ""}
    try:
        if me == 0:
            try:
                dist.all_reduce(t, group=a, async_op=True).wait()
            finally:
                store.set(FOUND, "1")
        elif me == 1:
            dist.all_reduce(t, group=b, async_op=True).wait()
        else:
            store.wait([FOUND], timedelta(seconds=60))
            if me == 3:
                time.sleep(SLOW_S)
            dist.all_reduce(t, group=c)
            out["sum"] = t.cpu()
            if me == 2:
                dist.all_reduce(t, group=a)
    except RuntimeError as err:
        out["error"] = str(err).splitlines()[0]
    _exit_soon()  # ranks 0-2 hold broken communicators (gloo's side may wait for its timeout): no collective barrier
    return out


def test_a_told_report_is_raised_by_the_stuck_groups_wait_only():
    """Ranks 0, 1 and 2 fail with the cycle's report (rank 2 at its wait on A, after its wait on C completed);
    C's all-reduce on ranks 2 and 3 equals the float64 sum of their inputs computed here (two addends: one
    rounding, the same whatever the order; 1e-12 is slack only)."""
    seed = _fresh_seed()
    results = run_distributed(cycle_then_legal_wait, 4, seed, backend="sim", env=ENV, timeout_s=90)
    cycle = "sim: collective wait() cycle deadlock across groups through ranks 0, 1:"
    for r in (0, 1, 2):
        assert results[r]["error"].startswith(cycle), (r, results[r]["error"])
    assert results[3]["error"] == "", results[3]
    want = _inputs(seed, 2) + _inputs(seed, 3)
    for r in (2, 3):
        assert results[r]["sum"] is not None, (r, results[r])
        torch.testing.assert_close(results[r]["sum"], want, rtol=0, atol=1e-12)
