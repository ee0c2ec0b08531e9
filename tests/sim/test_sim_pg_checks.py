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
        assert "rank 0 (of the group) all_gather_into_tensor #" in m and "rank 1 (of the group) all_gather_into_tensor #" in m, m
        assert m.index(first) < m.index("rank 1") < m.index(second), m  # rank 0 gathers the first unit, rank 1 the second
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
        assert "test_sim_pg_checks.py" in gathers[0], gathers[0]  # the forward's call site (backward's: autograd's thread)
