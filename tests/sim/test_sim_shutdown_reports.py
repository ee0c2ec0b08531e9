"""A deadlock report that no operation raised surfaces once, at the release of the group it belongs to: one found
at the end of the job, and one found mid-run with no later operation on the device.

The device's communicator queue is shared by every group a rank uses, so a report that breaks it (group A's cycle)
is seen by every group's release; only A's may raise it (csrc/sim/collectives.cpp, flush_cycles), and only when no
operation raised it before. The ring is test_sim_group_order's: each rank's send batch before its receive batch,
which NCCL never completes (gloo does).
"""
from __future__ import annotations

import pytest
import torch

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim
from tests.sim.test_sim_group_order import BRIEF_RING, ENV

pytestmark = [requires_sim(), pytest.mark.multiprocess, pytest.mark.planted]


def ring_on_a_with_b_pending(world_ring: bool = False) -> dict:
    """Ranks 0 and 1 post their side of the ring on group A, then receives from rank 2 on group B, and destroy B
    (whose release waits for B's pending batch), A and the world one by one. Rank 2 posts its side of the ring 0.2 s
    later, so A's cycle is found while ranks 0 and 1 are in B's release; it waits for its ring, sleeps a second (A's
    report breaks its device meanwhile, so its post on B raises it), posts B's sends and destroys the groups. Per
    step ("post", "B", "A", "world"): "" or the error; and A's name. ``world_ring``: first a subgroup S used and
    destroyed mid-run, then a legal ring of batches on another group G (its "legal" step: "" or the error), before
    A's ring; G is destroyed after B (its "G" step)."""
    import time

    import torch.distributed as dist

    from omnitron.backends import get_backend

    dev, me = get_backend().device(), dist.get_rank()
    a, b = dist.new_group([0, 1, 2]), dist.new_group([0, 1, 2])

    def post(group, ops):
        return dist.batch_isend_irecv([dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer, group)
                                       for kind, t, peer in ops])

    out = {"legal": ""}
    if world_ring:
        g, s = dist.new_group([0, 1, 2]), dist.new_group([0, 1, 2])
        dist.all_reduce(torch.ones(2, device=dev), group=s)
        dist.destroy_process_group(s)  # mid-run: the job goes on
        try:  # a legal ring: each rank's send and receive in one batch
            ring = [("send", torch.ones(4, device=dev), (me + 1) % 3),
                    ("recv", torch.zeros(4, device=dev), (me - 1) % 3)]
            for w in post(g, ring):
                w.wait()
            dist.all_reduce(torch.ones(2, device=dev), group=g)
            time.sleep(0.5)  # a report that came (none should) reaches G's watchdog
        except RuntimeError as err:
            out["legal"] = str(err)

    if me == 2:
        time.sleep(0.2)
    works = [w for batch in BRIEF_RING[me] for w in post(a, [(k, torch.zeros(4, device=dev), p) for k, p, _ in batch])]
    out.update(name=a.group_name, post="")
    try:
        if me < 2:
            post(b, [("recv", torch.zeros(4, device=dev), 2)])  # never waited
        else:
            for w in works:
                w.wait()
            time.sleep(1.0)
            post(b, [("send", torch.ones(4, device=dev), r) for r in (0, 1)])
    except RuntimeError as err:
        out["post"] = str(err)
    steps = (("B", b), ("G", g), ("A", a), ("world", None)) if world_ring else (("B", b), ("A", a), ("world", None))
    return destroy_each(steps, out)


def destroy_each(steps, out: dict) -> dict:
    """Destroy each (step, group) in turn (a group this rank is not in skipped): out[step] is "" or the error."""
    import torch.distributed as dist

    for step, group in steps:
        try:
            if group is not dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(group)
            out[step] = ""
        except RuntimeError as err:
            out[step] = str(err)
    return out


def test_a_report_surfaces_once_on_its_own_group():
    """Every rank raises A's cycle report exactly once: at its post on B (rank 2, whose device A's report broke
    while it slept), or at A's destroy (ranks 0 and 1). B's destroy, which waits for B's pending batch while A's
    report arrives, raised A's report before (and A's destroy then raised nothing)."""
    for r in run_distributed(ring_on_a_with_b_pending, 3, backend="sim", env=ENV, timeout_s=150):
        said = [step for step in ("post", "B", "A", "world") if r[step]]
        assert len(said) == 1 and said[0] in ("post", "A"), r
        m = r[said[0]]
        assert "\n" not in m and "sim: point-to-point cycle deadlock on group '" in m, r
        assert r["name"] in m and m.count("test_sim_shutdown_reports.py") == 6, r


def test_a_subgroup_destroyed_mid_run_does_not_end_the_job():
    """A subgroup destroyed mid-run does not switch report-keeping on for the groups still in use: the legal ring on
    G after it reports nothing, at its operations or at G's destroy, and the later ring's cycle on A is
    raised exactly once per rank, by A (at rank 2's post on B, or at A's destroy)."""
    for r in run_distributed(ring_on_a_with_b_pending, 3, True, backend="sim", env=ENV, timeout_s=150):
        assert r["legal"] == "" and r["G"] == "", r
        said = [step for step in ("post", "B", "G", "A", "world") if r[step]]
        assert len(said) == 1 and said[0] in ("post", "A"), r
        m = r[said[0]]
        assert "\n" not in m and "sim: point-to-point cycle deadlock on group '" in m, r
        assert r["name"] in m and m.count("test_sim_shutdown_reports.py") == 6, r


def ring_found_mid_run() -> dict:
    """Every rank posts its side of the ring on a group G and never waits on it; the watchdog finds the cycle while
    the ranks sleep (mid-run: no release has begun), and no later operation follows on the device. Then G is
    destroyed: "" or the error ``destroy_process_group(G)`` raised (the default group stays for the harness)."""
    import time

    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.testing.distributed import device_wedged

    dev, me = get_backend().device(), dist.get_rank()
    g = dist.new_group([0, 1, 2])
    for batch in BRIEF_RING[me]:
        dist.batch_isend_irecv([dist.P2POp(dist.isend if kind == "send" else dist.irecv, torch.zeros(4, device=dev),
                                           peer, g) for kind, peer, _ in batch])
    time.sleep(1.5)  # a watchdog poll or two finds the cycle (0.1 s each): noted by every rank's communicator
    device_wedged()  # the closing barrier on the store: a collective there would raise the report itself
    try:
        dist.destroy_process_group(g)
        return {"destroy": "", "name": g.group_name}
    except RuntimeError as err:
        return {"destroy": str(err), "name": g.group_name}


def test_a_report_found_mid_run_that_no_operation_raised_surfaces_at_the_end():
    """NCCL never completes the ring: the job hangs at its next synchronization with the device, or its watchdog
    ends it at the timeout. sim found the cycle mid-run, and with no later operation to raise it every rank used to
    go on cleanly (the group's destroy returned, nothing said); now each rank's release of the group raises it."""
    for r in run_distributed(ring_found_mid_run, 3, backend="sim", env=ENV, timeout_s=150):
        m = r["destroy"]
        assert "\n" not in m and "sim: point-to-point cycle deadlock on group '" in m, r
        assert r["name"] in m and m.count("test_sim_shutdown_reports.py") == 6, r


def two_reports_then_an_error(late: bool = False) -> dict:
    """Rank 1 issues an unbatched send to rank 0 on group A and one to rank 2 on group B, never waited; 0.5 s later
    ranks 0 and 2 each issue a send back at the same place (two sends: each raises its report at issue, and leaves
    it for rank 1). Rank 1's watchdog notes both, each by its own group's communicator; the first breaks its device,
    so its next operation raises that one only. Then every rank destroys A and B: per step, "" or the error.
    ``late``: rank 2 sends only once rank 1's operation raised A's report, and rank 1 destroys the groups after its
    watchdog's polls read B's (a poll that came after the operation, as on a loaded machine)."""
    import time

    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.testing.distributed import device_wedged

    dev, me = get_backend().device(), dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    a, b = dist.new_group([0, 1]), dist.new_group([1, 2])
    x, out = torch.zeros(4, device=dev), {}
    if me == 1:
        out["works"] = [dist.isend(x, 0, group=a), dist.isend(x, 2, group=b)]  # first at each place
    elif late and me == 2:
        store.wait(["raised"])
    else:
        time.sleep(0.5)
    if me != 1:
        try:
            dist.isend(x, 1, group=a if me == 0 else b)
            out["send"] = ""
        except RuntimeError as err:
            out["send"] = str(err)
        if late and me == 2:
            store.set("sent", "1")
    if not late:
        time.sleep(1.5)  # a watchdog poll or two (0.1 s each): both reports noted on rank 1
    out["op"] = ""
    if me == 1:
        try:
            dist.all_reduce(torch.ones(2, device=dev))  # late: waits until A's report breaks the device
        except RuntimeError as err:
            out["op"] = str(err)
        if late:
            store.set("raised", "1")
            store.wait(["sent"])
            time.sleep(1.5)  # fifteen watchdog polls (0.1 s each) read B's report before B's destroy
    device_wedged()  # the closing barrier on the store: the devices are broken
    out.pop("works", None)
    return destroy_each((("B", b), ("A", a)), out)


@pytest.mark.parametrize("late", [False, True], ids=["noted-before", "noted-after"])
def test_a_report_the_job_said_another_way_is_not_raised_again_at_release(late):
    """Rank 1's operation raised one of the two reports (the device's, broken by the first noted); the other is the
    same job's failure: NCCL's job hangs (or its watchdog ends it) once, so no release raises it as a second error in
    teardown (it used to: B's or A's destroy raised it), whether rank 1's watchdog noted it before that operation
    raised or after (``late``: B's destroy raised it, an outcome that hung on the watchdog's timing under load)."""
    r0, r1, r2 = run_distributed(two_reports_then_an_error, 3, late, backend="sim", env=ENV, timeout_s=150)
    for r in (r0, r2):
        assert "sim: point-to-point deadlock on group '" in r["send"], r
        assert r["A"] == "" and r["B"] == "", r
    assert "sim: point-to-point deadlock on group '" in r1["op"], r1
    assert r1["op"] in (r0["send"], r2["send"]), (r1, r0, r2)
    if late:
        assert r1["op"] == r0["send"], (r1, r0)  # A's: B's report came after the operation raised
    assert r1["A"] == "" and r1["B"] == "", r1
