"""Datatypes and counts on simccl: a send and its receive must agree on both, and so must a collective's ranks.

NCCL's ncclSend/ncclRecv: the receiver "needs to call ncclRecv with the same datatype and the same count"; gloo
moves bytes, so a float32[8] sent into a bfloat16[16] arrives as garbage, silently. csrc/sim/pair_order.cpp compares
the datatype and element count (not the bytes) of each send with its receive, unbatched or batched, before the
second is launched; a collective's fingerprint (shape, dtype, reduce op) is exchanged in strict mode
(comm_check.cpp). The references here are hand-derived: which pairs NCCL accepts (same dtype and count, any shape).
"""
from __future__ import annotations

import os

import pytest
import torch

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim

pytestmark = [requires_sim(), pytest.mark.multiprocess, pytest.mark.planted]
ENV = {"OMNITRON_SIM_DEADLOCK_S": "30", "OMNITRON_STRICT_COLLECTIVES": "1"}


def exchange(recv_dtype: str, recv_shape: tuple, batched: bool, seed: int) -> dict:
    """Rank 0 sends a random float32[8] (from ``seed``) to rank 1, which receives into ``recv_dtype[recv_shape]``:
    what rank 1 got (as float64) and the error, per rank."""
    import torch.distributed as dist

    from omnitron.backends import get_backend

    from tests.sim.test_sim_group_order import _exit_soon

    dev, me = get_backend().device(), dist.get_rank()
    sent = torch.randn(8, generator=torch.Generator().manual_seed(seed))
    t = sent.to(dev) if me == 0 else torch.empty(recv_shape, dtype=getattr(torch, recv_dtype), device=dev)
    try:
        if batched:
            op = dist.P2POp(dist.isend if me == 0 else dist.irecv, t, 1 - me)
            for work in dist.batch_isend_irecv([op]):
                work.wait()
        elif me == 0:
            dist.send(t, 1)
        else:
            dist.recv(t, 0)
        got = t.cpu().double().reshape(-1)
        return {"error": "", "exact": me == 0 or torch.equal(got, sent.double())}
    except RuntimeError as err:
        _exit_soon()
        return {"error": str(err), "exact": None}


@pytest.mark.parametrize("batched", [False, True])
def test_same_dtype_and_count_in_another_shape_is_delivered(batched):
    """float32[8] into float32[2, 4]: NCCL's datatype and count agree (the shape is the program's business)."""
    seed = int.from_bytes(os.urandom(4), "little")
    for r in run_distributed(exchange, 2, "float32", (2, 4), batched, seed, backend="sim", env=ENV, timeout_s=90):
        assert r == {"error": "", "exact": True}, (seed, r)


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("dtype,shape,kind", [("bfloat16", (16,), "dtype"), ("float64", (4,), "dtype"),
                                              ("float32", (9,), "size")])
def test_other_dtype_or_count_fails_both_ranks(dtype, shape, kind, batched):
    """float32[8] into bfloat16[16] or float64[4] (the same 32 bytes: passed before), or float32[9]: both ranks
    fail with one line naming both operations, their datatypes and call sites."""
    seed = int.from_bytes(os.urandom(4), "little")  # the values do not matter here: the mismatch fails first
    for r in run_distributed(exchange, 2, dtype, shape, batched, seed, backend="sim", env=ENV, timeout_s=90):
        m = r["error"]
        assert "\n" not in m and f"sim: point-to-point {kind} mismatch" in m and "same count and datatype" in m, m
        name = {"bfloat16": "BFloat16", "float64": "Double", "float32": "Float"}[dtype]  # as c10 prints them
        assert "dtype=Float to rank 1" in m and f"shape={list(shape)} dtype={name} from rank 0" in m, m
        assert m.count("test_sim_dtypes.py") == 2, m


def collective(kind: str, mismatch: str) -> str:
    """Rank 1 calls ``kind`` with another dtype (same bytes), count or reduce op than rank 0 (``mismatch``), as a
    plain torch.distributed call (FSDP2's and DCP's path): the error each rank gets."""
    import torch.distributed as dist

    from omnitron.backends import get_backend

    from tests.sim.test_sim_group_order import _exit_soon

    dev, me = get_backend().device(), dist.get_rank()
    dtype = torch.float64 if me == 1 and mismatch == "dtype" else torch.float32
    n = (4 if dtype == torch.float64 else 8) + (1 if me == 1 and mismatch == "count" else 0)
    op = dist.ReduceOp.MAX if me == 1 and mismatch == "op" else dist.ReduceOp.SUM
    x = torch.ones(n, dtype=dtype, device=dev)
    try:
        if kind == "all_reduce":
            dist.all_reduce(x, op=op)
        elif kind == "broadcast":
            dist.broadcast(x, 0)
        elif kind == "all_gather":
            dist.all_gather_into_tensor(torch.empty(2 * n, dtype=dtype, device=dev), x)
        elif kind == "reduce_scatter":
            dist.reduce_scatter_tensor(torch.empty(n, dtype=dtype, device=dev), torch.cat([x, x]), op=op)
        else:
            dist.all_to_all_single(torch.empty(2 * n, dtype=dtype, device=dev), torch.cat([x, x]))
        return ""
    except RuntimeError as err:
        _exit_soon()
        return str(err)


@pytest.mark.parametrize("kind,mismatch", [
    ("all_reduce", "dtype"), ("all_reduce", "count"), ("all_reduce", "op"), ("broadcast", "dtype"),
    ("broadcast", "count"), ("all_gather", "dtype"), ("all_gather", "count"), ("reduce_scatter", "dtype"),
    ("reduce_scatter", "op"), ("all_to_all", "dtype")])
def test_collectives_with_another_dtype_count_or_op_fail_every_rank(kind, mismatch):
    """Strict mode's fingerprint exchange (shape, dtype, reduce op) catches each: one line naming both ranks'."""
    for m in run_distributed(collective, 2, kind, mismatch, backend="sim", env=ENV, timeout_s=90):
        assert "\n" not in m and "issued different collectives" in m, m
        assert "rank 0 (of the group)" in m and "rank 1 (of the group)" in m, m


def uneven_all_to_all(shift: int, engine: bool = False) -> dict:
    """Rank i sends ``i + j + 1`` rows of 3 to rank j, and rank j expects ``i + j + 1 + shift`` from rank i
    (``shift`` 1 on rank 1 only: its output splits do not pair with the peers' input splits): what each rank got
    against the hand-derived rows, and the error. ``engine``: through the engine's collective layer (the MoE
    dispatcher's and Ulysses' route, which checks its own fingerprint with dim 0 left free), not torch's call."""
    import torch.distributed as dist

    from omnitron.backends import get_backend

    from tests.sim.test_sim_group_order import _exit_soon

    dev, me, n = get_backend().device(), dist.get_rank(), dist.get_world_size()
    rows = [torch.full((me + j + 1, 3), float(100 * me + j)) for j in range(n)]
    out_splits = [i + me + 1 + (shift if me == 1 else 0) for i in range(n)]
    out = torch.empty(sum(out_splits), 3, device=dev)
    try:
        a2a = get_backend().collectives.all_to_all if engine else dist.all_to_all_single
        a2a(out, torch.cat(rows).to(dev), out_splits, [len(r) for r in rows])
        want = torch.cat([torch.full((i + me + 1, 3), float(100 * i + me)) for i in range(n)])
        return {"error": "", "exact": torch.equal(out.cpu(), want)}
    except RuntimeError as err:
        _exit_soon()
        return {"error": str(err), "exact": None}


@pytest.mark.parametrize("engine", [False, True])
def test_uneven_all_to_all_that_pairs_is_delivered(engine):
    for r in run_distributed(uneven_all_to_all, 3, 0, engine, backend="sim", env=ENV, timeout_s=90):
        assert r == {"error": "", "exact": True}, r


@pytest.mark.parametrize("engine", [False, True])
def test_all_to_all_splits_that_do_not_pair_fail_every_rank(engine):
    """Rank 1 expects one row more from each peer than it sends: the shapes agree but for dim 0 (which differs per
    rank anyway), so only the pairing of the counts (rank i's to j against j's from i) finds it, on every rank.
    Through the engine's layer too (its own check leaves dim 0 free; gloo failed there on rank 1's own counts and
    the peers saw a closed connection)."""
    for r in run_distributed(uneven_all_to_all, 3, 1, engine, backend="sim", env=ENV, timeout_s=90):
        m = r["error"]
        assert "\n" not in m and "issued an all_to_all whose counts do not pair: rank 0 (of the group) sends 6 " in m, m
        assert "elements to rank 1 (" in m and "which receives 9 from it (" in m, m
        assert m.count("test_sim_dtypes.py") == 2, m
