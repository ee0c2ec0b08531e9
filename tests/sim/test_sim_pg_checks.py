"""simccl checks and records at the process-group level, so collectives that bypass the engine's
``Collectives`` layer (FSDP2's ``fully_shard``, DCP, plain ``torch.distributed``) are fingerprinted in strict
mode and appear in the flight record with their completion, not only their issue."""
from __future__ import annotations

import pytest
import torch

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim

pytestmark = [requires_sim(), pytest.mark.multiprocess]
STRICT = {"OMNITRON_STRICT_COLLECTIVES": "1", "OMNITRON_SIM_DEADLOCK_S": "3"}


def _sharded(be):
    """Two FSDP2 units of different sizes (8x16+16 and 16x4+4 parameters) under a root, over both ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(be.device())
    mesh = init_device_mesh(be.device_type, (2,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def fsdp_unshard_out_of_order() -> str:
    """Rank 1 unshards FSDP2's two units in the opposite order to rank 0: the all-gathers differ in size."""
    import torch.distributed as dist

    from omnitron.backends import get_backend

    model = _sharded(get_backend())
    order = [model[0], model[1]] if dist.get_rank() == 0 else [model[1], model[0]]
    try:
        for unit in order:
            unit.unshard()
    except RuntimeError as err:
        return str(err)
    return ""


@pytest.mark.planted
def test_fsdp2_collectives_out_of_order_are_named_on_one_line():
    messages = run_distributed(fsdp_unshard_out_of_order, 2, backend="sim", env=STRICT, timeout_s=90)
    # one FSDP2 all-gather input per rank: half of each unit's flat parameters
    first, second = f"shape=[{(8 * 16 + 16) // 2}]", f"shape=[{(16 * 4 + 4) // 2}]"
    for m in messages:
        assert "\n" not in m and "issued different collectives" in m, m
        assert ("rank 0 (of the group) all_gather_into_tensor #" in m
                and "rank 1 (of the group) all_gather_into_tensor #" in m), m
        # rank 0 gathers the first unit, rank 1 the second
        assert m.index(first) < m.index("rank 1") < m.index(second), m
        assert m.count("test_sim_pg_checks.py") == 2, m  # both ranks' call sites


def fsdp_step_records() -> dict:
    """One FSDP2 forward and backward; the collectives counted by torch's CommDebugMode (the reference) and
    the lines of simccl's flight record."""
    from torch.distributed.tensor.debug import CommDebugMode

    from omnitron.backends import get_backend
    from omnitron.backends.collectives import flight_recorder_dump

    be = get_backend()
    model = _sharded(be)
    before = len([line for line in flight_recorder_dump() if line.startswith("simccl")])
    with CommDebugMode() as comm:
        model(torch.randn(3, 8, device=be.device())).square().sum().backward()
    be.synchronize()
    counts = {str(op).replace("allgather", "all_gather"): n for op, n in comm.get_comm_counts().items()}
    lines = [line for line in flight_recorder_dump() if line.startswith("simccl")][before:]
    return {"counts": counts, "lines": lines}


def test_fsdp2_collectives_recorded_with_completion():
    for r in run_distributed(fsdp_step_records, 2, backend="sim", env=STRICT, timeout_s=90):
        gathers = [line for line in r["lines"] if " all_gather_into_tensor " in line]
        reduces = [line for line in r["lines"] if " reduce_scatter_tensor " in line]
        want_gathers = sum(n for op, n in r["counts"].items() if "all_gather" in op)
        want_reduces = sum(n for op, n in r["counts"].items() if "reduce_scatter" in op)
        assert want_gathers >= 2 and want_reduces >= 2, r["counts"]  # the reference saw FSDP2's collectives
        assert (len(gathers), len(reduces)) == (want_gathers, want_reduces), (r["counts"], r["lines"])
        for line in gathers + reduces:
            assert " completed " in line and " waited " in line, line
        # the forward's call site (backward's: autograd's thread)
        assert "test_sim_pg_checks.py" in gathers[0], gathers[0]


def barrier_against_all_reduce() -> str:
    """Rank 0 enters a plain torch barrier where rank 1 issues an all-reduce (both outside the engine's layer)."""
    import torch.distributed as dist

    from omnitron.backends import get_backend

    try:
        if dist.get_rank() == 0:
            dist.barrier()
        else:
            dist.all_reduce(torch.ones(3, device=get_backend().device()))
    except RuntimeError as err:
        return str(err)
    return ""


@pytest.mark.planted
def test_barrier_is_fingerprinted_against_a_collective():
    """A barrier is queued and checked like the collectives: met by another rank's all-reduce, both ranks name
    both in one line (it bypassed simccl's queue and check before: the run hung until its timeout)."""
    for m in run_distributed(barrier_against_all_reduce, 2, backend="sim", env=STRICT, timeout_s=60):
        assert "\n" not in m and "issued different collectives" in m, m
        assert "barrier #1 no tensors" in m and "all_reduce #1 shape=[3]" in m, m


def barrier_records() -> list[str]:
    """A plain torch barrier, an all-reduce behind it, and simccl's flight record of both."""
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.backends.collectives import flight_recorder_dump

    dist.barrier()
    dist.all_reduce(torch.ones(2, device=get_backend().device()))
    return [line for line in flight_recorder_dump() if line.startswith("simccl")]


def test_barrier_recorded_with_completion():
    for lines in run_distributed(barrier_records, 2, backend="sim", env=STRICT, timeout_s=60):
        barrier, reduce = lines[-2:]
        assert " barrier " in barrier and " completed " in barrier and " waited " in barrier, lines
        assert "test_sim_pg_checks.py" in barrier and " all_reduce " in reduce, lines
        assert int(barrier.split()[1][1:]) < int(reduce.split()[1][1:])  # in issue order, one queue


def fsdp_backward_sites() -> list[str]:
    """The flight-record lines of FSDP2's backward reduce-scatters (issued from autograd's device thread)."""
    from omnitron.backends import get_backend
    from omnitron.backends.collectives import flight_recorder_dump

    be = get_backend()
    model = _sharded(be)
    loss = model(torch.randn(3, 8, device=be.device())).square().sum()
    loss.backward()  # the call site the records must name
    be.synchronize()
    return [line for line in flight_recorder_dump() if " reduce_scatter_tensor " in line]


def test_fsdp2_backward_collectives_name_the_backward_call():
    """A collective issued from a hook on autograd's thread has only torch frames: its record names the
    innermost of them and the backward call the main thread waits in (was "(no Python frame)")."""
    for lines in run_distributed(fsdp_backward_sites, 2, backend="sim", env=STRICT, timeout_s=90):
        assert len(lines) >= 2, lines
        for line in lines:
            assert "(no Python frame)" not in line and "torch/distributed/fsdp/" in line, line
            assert "autograd thread; backward called at " in line and "test_sim_pg_checks.py" in line, line
            assert "(fsdp_backward_sites)" in line, line


def _part(rank: int, rows: int) -> torch.Tensor:
    """Rank ``rank``'s float64 input of ``rows`` x 3, the same in the workers and the reference."""
    return torch.randn(rows, 3, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)


def forms_nccl_accepts() -> dict:
    """Plain torch.distributed calls NCCL runs and gloo's own checks refuse or strict mode misread: the stacked
    (world, *part) forms of all_gather_into_tensor and reduce_scatter_tensor, all_to_all_single whose inputs
    differ in length between the ranks (uneven splits, as an MoE dispatch sends), and all_to_all's list form
    with tensors of different sizes."""
    import torch.distributed as dist

    from omnitron.backends import get_backend

    d, rank = get_backend().device(), dist.get_rank()
    gathered = torch.zeros(2, 2, 3, dtype=torch.float64, device=d)
    dist.all_gather_into_tensor(gathered, _part(rank, 2).to(d))
    shard = torch.zeros(2, 3, dtype=torch.float64, device=d)
    dist.reduce_scatter_tensor(shard, _part(rank, 4).view(2, 2, 3).to(d))
    send = [1, 2] if rank == 0 else [3, 1]  # rank 0 has 3 rows, rank 1 has 4
    received = torch.zeros(1 + 3 if rank == 0 else 2 + 1, 3, dtype=torch.float64, device=d)
    dist.all_to_all_single(received, _part(rank, sum(send)).to(d), [1, 3] if rank == 0 else [2, 1], send)
    pieces = [torch.zeros(2 + peer, 3, dtype=torch.float64, device=d) for peer in range(2)]  # peer p sends 2 + p
    dist.all_to_all(pieces, list(_part(rank, 2 * (2 + rank)).to(d).split(2 + rank)))
    return {"gathered": gathered.cpu(), "shard": shard.cpu(), "received": received.cpu(),
            "pieces": [p.cpu() for p in pieces]}


def test_forms_nccl_accepts_match_plain_torch():
    """Each rank's results equal plain torch's on the same float64 inputs, exactly: gathers and all-to-all copy,
    and a two-rank sum is one addition (commutative in IEEE arithmetic, so the order the ranks add in is moot)."""
    results = run_distributed(forms_nccl_accepts, 2, backend="sim", env=STRICT, timeout_s=120)
    parts2, parts4 = [_part(r, 2) for r in range(2)], [_part(r, 4) for r in range(2)]
    split = {0: [1, 2], 1: [3, 1]}
    chunks = {r: torch.split(_part(r, sum(split[r])), split[r]) for r in range(2)}
    for rank, r in enumerate(results):
        assert torch.equal(r["gathered"], torch.stack(parts2)), r["gathered"]
        assert torch.equal(r["shard"], (parts4[0] + parts4[1])[2 * rank:2 * rank + 2]), r["shard"]
        assert torch.equal(r["received"], torch.cat([chunks[0][rank], chunks[1][rank]])), r["received"]
        for peer in range(2):  # rank ``peer`` sent its ``rank``-th piece of 2 + peer rows
            assert torch.equal(r["pieces"][peer], _part(peer, 2 * (2 + peer)).split(2 + peer)[rank]), peer


def batch_handles() -> dict:
    """A batch of one send and one receive with the peer, through plain ``batch_isend_irecv`` and through the
    engine's ``batch_p2p`` (strict mode off: its own path), on fresh random tensors."""
    import torch.distributed as dist

    from omnitron.backends import get_backend

    be, rank = get_backend(), dist.get_rank()
    sent = [torch.randn(8, dtype=torch.float64) for _ in range(2)]
    got = [torch.zeros(8, dtype=torch.float64, device=be.device()) for _ in range(2)]
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, sent[0].to(be.device()), 1 - rank),
                                    dist.P2POp(dist.irecv, got[0], 1 - rank)])
    for w in works:
        w.wait()
    handles = be.collectives.batch_p2p([("send", sent[1].to(be.device()), 1 - rank), ("recv", got[1], 1 - rank)])
    for h in handles:
        h.wait()
    return {"works": len(works), "handles": len(handles), "sent": sent, "got": [t.cpu() for t in got]}


def test_batches_coalesce_as_on_nccl_with_a_handle_per_operation():
    """simccl coalesces ``batch_isend_irecv`` into one work for the batch, as ProcessGroupNCCL does (torch returns
    the coalescing manager's single work); the engine's ``batch_p2p`` still returns one handle per operation,
    which the pipeline pairs with its messages. Each receive gets what the peer sent (exact: a copy)."""
    results = run_distributed(batch_handles, 2, backend="sim", env={"OMNITRON_STRICT_COLLECTIVES": "0"},
                              timeout_s=90)
    for rank, r in enumerate(results):
        assert (r["works"], r["handles"]) == (1, 2), r
        for got, sent in zip(r["got"], results[1 - rank]["sent"]):
            assert torch.equal(got, sent)
