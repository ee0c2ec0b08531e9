"""The store traffic of a legal long wait (csrc/sim/collective_wait.cpp, wait_cycle.cpp, pair_order.cpp; SearchPace
in comm.h, poll_pair_waits in comm_queue.cpp).

A wait() blocked 0.1 s publishes a record for the cycle search. Rank 0 writing a checkpoint while the others sit in
an all-reduce (or a receive) is legal, and used to cost each waiting rank a compareSet plus one read per member
every 0.1 s (N*(N+1)*10 store operations a second on the TCPStore, ~42k/s at N = 64). Now a search runs only when a
record changed since the last one began, and the polls back off from 0.1 s to 1 s. An unbatched receive issued
before its send also polled the pair's key and the sender's order record every 20 ms (185 store operations in this
test's 1.5 s window per waiting rank, counted on that code); it now waits in the store for the sender's claim (woken
at once, no polling), and the watchdog runs its order check on the same backoff.

Bound, derived (per waiting rank, in the window [WINDOW_S[0], WINDOW_S[1]] after the phase's barrier): every rank
blocks and publishes within ~0.2 s (LATE_S = 0.8 s allowed on a loaded machine); after the last record change r the
polls come at r + 0.1, 0.3, 0.7, 1.5, 2.5 s (intervals doubling to 1 s), so with r <= LATE_S the window holds
polls only at least 0.8 s apart: at most 1 + 1.5 / 0.8 < 3 of them, each without a search: two operations (the
deadlock key, the version) for a collective; for a point-to-point wait one (the version) and, on the same ladder
from the wait's start, the receive's order check (one check of the sender's record, and one read once it is there):
three. Besides, each communicator that took part in point-to-point (the receive's group, in the p2p phase only) has
the device's watchdog check its deadlock-report key, one operation, on the same ladder from the group's last
point-to-point operation (the receive, issued by LATE_S; ReportPace in comm_queue.cpp): at most 3 checks in the
window. The old code polled every 0.1 s (at least 10 polls in the window), each one operation or more, the receive's
20 ms loop three operations an iteration (at least 75 iterations in the window), and the watchdog checked the report
key at every 0.1 s poll (at least 14 checks in the window: 1 + 1.5 / 0.1 = 16 at most).

Every store operation simccl issues is counted (csrc/sim/counted_store.cpp: its communicators' stores, their
clones, the job store under them, wrapped), not the ones a change chose to count: a polling loop anywhere shows.
"""
from __future__ import annotations

import pytest
import torch

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim

pytestmark = [requires_sim(), pytest.mark.multiprocess]
ENV = {"OMNITRON_SIM_DEADLOCK_S": "30", "OMNITRON_STRICT_COLLECTIVES": "1"}
SLEEP_S = 3.5  # rank 0's "checkpoint": the others wait this long, legally
WINDOW_S = (1.5, 3.0)  # where the store operations are counted (after the backoff's ladder, before the wait ends)
POLLS_IN_WINDOW = 3  # see the module's docstring
OPS_PER_POLL = {"collective": 2, "p2p": 3}
REPORT_CHECKS = {"collective": 0, "p2p": POLLS_IN_WINDOW}  # the watchdog's checks of the receive's group's report key


def legal_long_waits() -> dict:
    """Per phase: this rank's store operations (every one simccl issued) in the window (rank 0: None), and whether
    the phase's data arrived."""
    import threading
    import time

    import torch
    import torch.distributed as dist

    import omnitron._sim as sim_ext
    from omnitron.backends import get_backend

    dev, me, world = get_backend().device(), dist.get_rank(), dist.get_world_size()
    out = {}
    for phase in ("collective", "p2p"):
        dist.barrier()
        t0, seen = time.monotonic(), []

        def count():
            for at in WINDOW_S:
                time.sleep(max(0.0, t0 + at - time.monotonic()))
                seen.append(sim_ext.store_ops())

        counter = threading.Thread(target=count, daemon=True)
        if me == 0:
            time.sleep(SLEEP_S)
        else:
            counter.start()
        t = torch.full((4,), float(me + 1), device=dev)
        if phase == "collective":
            dist.all_reduce(t)
            ok = bool((t.cpu() == world * (world + 1) / 2).all())
        elif me == 0:
            for peer in range(1, world):
                dist.send(t, peer)
            ok = True
        else:
            dist.recv(t, 0)
            ok = bool((t.cpu() == 1.0).all())
        if me:
            counter.join()
        out[phase] = {"ops": seen[1] - seen[0] if me else None, "ok": ok}
    return out


def test_a_legal_long_wait_polls_the_store_with_backoff():
    for rank, r in enumerate(run_distributed(legal_long_waits, 3, backend="sim", env=ENV, timeout_s=120)):
        for phase, got in r.items():
            assert got["ok"], (rank, phase, r)
            if rank:
                assert got["ops"] <= POLLS_IN_WINDOW * OPS_PER_POLL[phase] + REPORT_CHECKS[phase], (rank, phase, r)


ROUNDS = 11  # more than the 8 connections a thread used to keep: their growth shows before any cap


def blocked_waits_over_groups() -> list:
    """ROUNDS times: a new group, rank 1's receive waited on before rank 0's send is issued (a blocked wait: its
    own connection to the group's store), the group destroyed. This rank's open file descriptors after each."""
    import gc
    import os
    import time

    import torch.distributed as dist

    from omnitron.backends import get_backend

    dev, me, fds = get_backend().device(), dist.get_rank(), []
    for _ in range(ROUNDS):
        g = dist.new_group([0, 1])
        t = torch.zeros(4, device=dev)
        if me == 0:
            time.sleep(0.2)  # rank 1's receive waits in the store meanwhile
            dist.send(t, 1, group=g)
        else:
            dist.recv(t, 0, group=g)
        dist.destroy_process_group(g)
        del g, t  # the group object (its gloo context's descriptors) lived on until the next round rebound g
        gc.collect()
        fds.append(len(os.listdir("/proc/self/fd")))
    return fds


def test_a_blocked_waits_store_connection_goes_with_its_group():
    """The connection a blocked wait opened is closed at its group's release: the receiver's descriptors stay flat
    over the rounds (the first round's, which opens what the job keeps, aside); they grew by one a round."""
    for rank, fds in enumerate(run_distributed(blocked_waits_over_groups, 2, backend="sim", env=ENV, timeout_s=120)):
        assert len(set(fds[1:])) == 1, (rank, fds)
