"""Worker functions for tests/backends/test_strict.py (module level so spawned ranks import them).

Each plants one fault that gloo forgives and NCCL does not. :func:`caught` runs one on every rank
and returns what this rank saw: the error text and the seconds from the planted call to the error
(process start-up excluded), or the case's own result when strict mode missed the fault.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist


def caught(name: str) -> dict:
    """Run case ``name`` (after one barrier: the clock measures detection, not process start-up), then
    close the process group: after a fault its pairs may be broken, so the harness's last barrier is skipped.

    On sim a rank whose wait failed another way first (its peer's connection closed) raises its communicator's
    report of the fault when the group is released (docs/backends.md): after a fault that is the same fault's
    report, added to the rank's error; after a clean run it propagates (a report on a legal program is a bug)."""
    fn = globals()[name]
    _coll().barrier()
    t0 = time.monotonic()
    try:
        out = {"result": fn(), "seconds": time.monotonic() - t0}
    except Exception as err:  # noqa: BLE001 - the planted fault, reported to the test
        out = {"error": f"{type(err).__name__}: {err}", "seconds": time.monotonic() - t0}
    try:
        dist.destroy_process_group()
    except Exception as err:  # noqa: BLE001 - sim's report said at release, see above
        if "error" not in out:
            raise
        out["error"] += f"\nat release: {type(err).__name__}: {err}"
        from omnitron.testing.distributed import device_wedged

        device_wedged()  # the group stays broken and registered: the harness's closing barrier goes to the store
    return out


def _coll():
    """The backend's collectives; new tensors go on the backend's device (a device library takes no host tensors)."""
    from omnitron.backends import get_backend

    be = get_backend()
    torch.set_default_device(be.device())
    return be.collectives


def different_shape() -> str:
    """Rank 1 all-reduces one more element than rank 0."""
    coll = _coll()
    coll.all_reduce(torch.ones(4))  # agreed: both ranks
    coll.all_reduce(torch.ones(8 + dist.get_rank()))  # planted
    return "no error"


def skipped_collective() -> str:
    """Rank 1 skips a broadcast that rank 0 issues, then both all-reduce."""
    coll = _coll()
    if dist.get_rank() == 0:
        coll.broadcast(torch.ones(3), src=0)  # planted: rank 1 never issues it
    coll.all_reduce(torch.ones(3))
    return "no error"


def peer_closes_after_its_timeout() -> None:
    """As gloo does it: rank 1's bounded wait expires and gloo closes the pair, so rank 0's wait fails with a
    closed connection before its own timeout (works standing in for gloo's, the wait is the real one)."""
    from omnitron.backends import flight

    me = dist.get_rank()

    class Work:
        def wait(self, timeout=None):
            if me == 0:
                time.sleep(0.5)
                raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5809")
            raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv")

    flight.timed_wait(Work(), lambda: [f"recv shape=[5] from rank {1 - me}"], dist.group.WORLD)


def recv_before_send() -> str:
    """Both ranks receive from each other before sending: fine on gloo (matched by tag), a deadlock on NCCL."""
    coll = _coll()
    me, peer = dist.get_rank(), 1 - dist.get_rank()
    got = torch.empty(5)
    handles = coll.batch_p2p([("recv", got, peer)])  # posted alone: NCCL runs it before the send below
    for h in coll.batch_p2p([("send", torch.full((5,), float(me)), peer)]):
        h.wait()
    for h in handles:
        h.wait()
    return f"received {got[0].item()}"


def send_recv_batched() -> float:
    """The fixed pattern: each rank's send and receive in one batch (completes under NCCL order)."""
    coll = _coll()
    me, peer = dist.get_rank(), 1 - dist.get_rank()
    got = torch.empty(5)
    for h in coll.batch_p2p([("recv", got, peer), ("send", torch.full((5,), float(me)), peer)]):
        h.wait()
    return float(got[0])


def p2p_buffers_freed() -> list[bool]:
    """Each rank sends and receives one tensor in a batch, waits, lets both go (the cyclic collector off): whether
    each storage is still alive (held by nothing but the strict ops' own bookkeeping)."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    coll = _coll()
    me, peer = dist.get_rank(), 1 - dist.get_rank()
    gc.collect()
    gc.disable()
    try:
        got, sent = torch.empty(1000), torch.full((1000,), float(me))
        for h in coll.batch_p2p([("recv", got, peer), ("send", sent, peer)]):
            h.wait()
        refs = [StorageWeakRef(t.untyped_storage()) for t in (got, sent)]
        del got, sent, h
        return [not r.expired() for r in refs]
    finally:
        gc.enable()


def p2p_shape_mismatch() -> str:
    """Rank 0 sends 6 elements, rank 1 expects 5."""
    coll = _coll()
    if dist.get_rank() == 0:
        coll.send(torch.ones(6), dst=1)
    else:
        coll.recv(torch.empty(5), src=0)
    return "no error"


def recorder_lines() -> list[str]:
    """Two collectives, then this rank's flight recorder."""
    from omnitron.backends.collectives import flight_recorder_dump

    coll = _coll()
    coll.all_reduce(torch.ones(2, 3))
    coll.broadcast(torch.ones(4, dtype=torch.float64), src=0)
    return flight_recorder_dump()
