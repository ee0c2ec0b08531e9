"""A tensor on a device its process group has no transport for (a host tensor on a simccl or NCCL group, a
device tensor on a gloo group) fails with one line naming the operation, the group's backend and the fix, on
every rank, strict or not (torch's own words were "No backend type associated with device type cpu")."""
from __future__ import annotations

import pytest

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim

pytestmark = [pytest.mark.multiprocess, requires_sim()]


def wrong_device_worker() -> dict:
    """Each call with a tensor the default group cannot carry; returns ``{case: error message}``."""
    import os

    import torch
    import torch.distributed as dist

    from omnitron.backends import get_backend

    be = get_backend()
    other = torch.device("cpu") if be.device_type != "cpu" else get_backend("sim").device()
    peer = 1 - dist.get_rank()
    cases = {
        "all_reduce": lambda: be.collectives.all_reduce(torch.ones(4, device=other)),
        "all_gather": lambda: be.collectives.all_gather(torch.empty(8, device=other), torch.ones(4, device=other)),
        "batch_p2p": lambda: be.collectives.batch_p2p([("send", torch.ones(3, device=other), peer),
                                                      ("recv", torch.empty(3, device=other), peer)]),
    }
    out = {}
    for strict in ("0", "1"):
        os.environ["OMNITRON_STRICT_COLLECTIVES"] = strict
        for name, call in cases.items():
            try:
                call()
                out[name, strict] = "no error"
            except ValueError as err:
                out[name, strict] = str(err)
    return out


@pytest.mark.parametrize("backend,got,group", [("sim", "cpu", "simccl"), ("cpu", "sim", "gloo")])
def test_tensor_on_a_device_the_group_cannot_carry_is_named(backend, got, group):
    for rank_out in run_distributed(wrong_device_worker, 2, backend=backend):
        assert len(rank_out) == 6, rank_out
        for (name, strict), msg in rank_out.items():
            assert msg.startswith(f"{name}: a '{got}' tensor on a '{group}' process group"), (strict, msg)
            assert "\n" not in msg and "backend.device()" in msg, msg
