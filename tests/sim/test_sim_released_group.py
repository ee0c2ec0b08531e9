"""A member that released a group (destroy_process_group) before issuing the collective a peer waits on
(csrc/sim/collective_wait.cpp, publish_released): NCCL hangs there, and so did sim until gloo noticed the process
gone. The release publishes how many of the group's collectives the member issued; the peer's blocked wait()
reports it at its next search, naming the member, the count and the collective waited on. A group made again
under its name (new_group(..., use_local_synchronization=True) names a group by its ranks) is another group: it
reads none of the destroyed one's records; and the last member to release a group deletes them."""
from __future__ import annotations

import pytest
import torch

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim
from tests.sim.test_sim_wait_cycle import _fresh_seed

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


SLOW_S = 1.0  # rank 1's pause before a collective: rank 0's wait blocks past 100 ms and searches the records
MADE = 3  # times the group is made under its one name (gloo alone hangs at the second or third: see the docstring)


def _inputs(seed: int, rank: int, made: int, k: int) -> torch.Tensor:
    """Rank ``rank``'s input to the ``k``-th all-reduce of the ``made``-th group: fresh, float64, one per call."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + made * 101 + k)
    return torch.randn(8, generator=g, dtype=torch.float64)


def made_again(seed: int) -> dict:
    """The group ``new_group([0, 1], use_local_synchronization=True)`` made MADE times, destroyed after each; the
    ``m``-th does ``m`` all-reduces, rank 1 pausing SLOW_S before the last of each group made again (its first
    destroyed after fewer collectives than rank 0 waits on). Per rank: the group names, the sums, "" or the error."""
    import time

    import torch.distributed as dist

    from omnitron.backends import get_backend

    dev, me = get_backend().device(), dist.get_rank()
    names, sums = [], []
    try:
        for made in range(1, MADE + 1):
            g = dist.new_group([0, 1], use_local_synchronization=True)
            names.append(g.group_name)
            for k in range(1, made + 1):
                if me == 1 and made > 1 and k == made:
                    time.sleep(SLOW_S)
                t = _inputs(seed, me, made, k).to(dev)
                dist.all_reduce(t, group=g)
                sums.append(t.cpu())
            dist.destroy_process_group(g)
    except RuntimeError as err:
        from tests.sim.test_sim_group_order import _exit_soon

        _exit_soon()
        return {"names": names, "sums": sums, "error": str(err).splitlines()[0]}
    return {"names": names, "sums": sums, "error": ""}


def test_a_group_made_again_under_its_name_reads_none_of_the_destroyed_ones_records():
    """A legal program: the name repeats (the premise), no rank reports anything, and every all-reduce equals the
    sum of both ranks' inputs in float64 computed here (two addends: exact up to one rounding, which the same two
    addends in the same order give identically; 1e-12 leaves room for gloo summing in another order). Before each
    incarnation had its own store, rank 0's wait read the destroyed group's release records ("released after
    issuing 1") and reported itself or rank 1 -- or gloo's rendezvous read the destroyed group's addresses and hung
    (plain gloo does: docs/backends.md)."""
    seed = _fresh_seed()
    r0, r1 = run_distributed(made_again, 2, seed, backend="sim", env=ENV, timeout_s=120)
    assert r0["error"] == "" and r1["error"] == "", (r0["error"], r1["error"])
    assert len(set(r0["names"])) == 1 and r0["names"] == r1["names"], (r0["names"], r1["names"])
    want = [_inputs(seed, 0, m, k) + _inputs(seed, 1, m, k) for m in range(1, MADE + 1) for k in range(1, m + 1)]
    for got in (r0["sums"], r1["sums"]):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def keys_left(rounds: int) -> dict:
    """Store keys added by ``rounds`` groups made, used (one all-reduce) and destroyed: on sim, and with gloo
    (``backend="gloo"``, host tensors) -- gloo's own rendezvous keys, which torch leaves, are in both."""
    import time

    import torch.distributed as dist

    from omnitron.backends import get_backend

    dev, me = get_backend().device(), dist.get_rank()
    store = dist.distributed_c10d._get_default_store()

    def cycle(backend, device, pause: float = 0.0) -> None:
        g = dist.new_group([0, 1], backend=backend)
        time.sleep(pause * me)  # rank 0's wait blocks: its record of a blocked wait exists before counting
        t = torch.ones(4, device=device)
        dist.all_reduce(t, group=g)
        time.sleep(pause * (1 - me))  # and rank 1's
        dist.all_reduce(t, group=g)
        dist.destroy_process_group(g)

    def count() -> int:  # between barriers: both ranks read the same count
        dist.barrier()
        n = store.num_keys()
        dist.barrier()
        return n

    cycle(None, dev, pause=0.5)  # the job-wide records (one per rank, the version counter) made once
    before = count()
    for _ in range(rounds):
        cycle(None, dev)
    after_sim = count()
    for _ in range(rounds):
        cycle("gloo", "cpu")
    return {"sim": after_sim - before, "gloo": count() - after_sim}


def test_a_destroyed_group_leaves_no_records_in_the_store():
    """The last member to release a group deletes its records (members' global ranks, releases): a job that makes
    and destroys groups adds no keys beyond what gloo itself leaves per group (the reference, measured beside it in
    the same job). Before, each sim group left two keys per member for good."""
    r0, r1 = run_distributed(keys_left, 2, 3, backend="sim", env=ENV, timeout_s=90)
    assert r0 == r1 and r0["sim"] == r0["gloo"], (r0, r1)
