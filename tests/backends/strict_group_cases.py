"""Worker functions for tests/backends/test_strict_nccl_groups.py (module level so spawned ranks import them).

Each runs a correct point-to-point program in strict mode with ``dist.batch_isend_irecv`` wrapped to log every
group this rank issues, as ``[(kind, peer, tag)]`` in op order, and returns that log with what it received."""
from __future__ import annotations

import torch
import torch.distributed as dist


def _logged() -> list:
    """Wrap ``dist.batch_isend_irecv`` in this process; the returned list fills with one entry per group."""
    log, real = [], dist.batch_isend_irecv

    def batch_isend_irecv(ops):
        log.append([("send" if op.op is dist.isend else "recv", op.peer, op.tag) for op in ops])
        return real(ops)

    dist.batch_isend_irecv = batch_isend_irecv
    return log


def _coll(fused: bool | None = True):
    """The backend's collectives, posting strict p2p batches as a library that runs its groups in order would
    (``fused``: the shape the device backends get; gloo runs it too when the sizes agree; None: the backend's own)."""
    from omnitron.backends import get_backend

    be = get_backend()
    torch.set_default_device(be.device())
    if fused is not None:
        be.collectives.p2p_groups_in_order = fused
    return be.collectives


def symmetric(fused: bool | None, rounds: int = 3) -> dict:
    """Both ranks send two tensors to and receive two from each other in one batch (1F1B's
    send_forward_recv_backward, a two-rank ring), ``rounds`` times; each value names sender, round and slot."""
    coll, log = _coll(fused), _logged()
    me, peer, got = dist.get_rank(), 1 - dist.get_rank(), []
    for i in range(rounds):
        bufs = [torch.empty(64), torch.empty(32)]
        ops = [("send", torch.full((64,), 100.0 * me + 10 * i), peer), ("recv", bufs[0], peer),
               ("send", torch.full((32,), 100.0 * me + 10 * i + 1), peer), ("recv", bufs[1], peer)]
        for h in coll.batch_p2p(ops):
            h.wait()
        got += [b.unique().tolist() for b in bufs]
    return {"groups": log, "got": got}


class _World:
    """The pipeline group of a run with pp = world size (StageP2P's group interface)."""
    handle = None

    @staticmethod
    def global_rank(rank: int) -> int:
        return rank


def _value(msg) -> float:
    kind, stage, mb = msg
    return (1.0 if kind == "act" else -1.0) * (100 * mb + stage + 1)


def pipeline(name: str, pp: int, vp: int, m: int) -> dict:
    """Drive ``StageP2P`` through schedule ``name``'s table (no model: each message carries :func:`_value` of its
    name) and return the groups issued and the messages whose received value differs from the one sent."""
    from omnitron.core.parallel.pipeline.p2p import StageP2P, _message, input_message
    from omnitron.core.parallel.pipeline.schedules import build_schedule

    coll, log = _coll(), _logged()
    schedule, rank, wrong = build_schedule(name, pp, vp, m), dist.get_rank(), []
    p2p = StageP2P(schedule, rank, _World(), coll, (8,), torch.float32, torch.get_default_device())
    for step, a in enumerate(schedule.tables[rank]):
        p2p.exchange(step)
        need = input_message(schedule, rank, a)
        if need is not None and not torch.equal(p2p.recv(need), torch.full((8,), _value(need))):
            wrong.append(need)
        out = _message(schedule, rank, a)
        if out is not None:
            p2p.send(out, torch.full((8,), _value(out)))
    p2p.finish()
    return {"groups": log, "wrong": wrong}


def transposed_shape() -> str:
    """Rank 0 sends a [2, 3] tensor where rank 1 receives [3, 2] (same size: the fused group delivers it); returns
    the error this rank saw (the process group is closed after it: its pairs may be broken)."""
    coll = _coll()
    try:
        if dist.get_rank() == 0:
            coll.send(torch.ones(2, 3), 1)
        else:
            coll.recv(torch.empty(3, 2), 0)
        out = "no error"
    except RuntimeError as err:
        out = str(err)
    dist.destroy_process_group()
    return out
