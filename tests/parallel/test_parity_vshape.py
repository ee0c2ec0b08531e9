"""The V-shaped schedules (zb-v, dualpipe-v) train the tiny GPT (tied embedding: both copies on rank 0)
with the same per-step losses and final weights as one process, at pp2 and pp4 with 4 and 8 micro-batches
(gloo; float64 with the reference kernels, as ``test_parity_3d.py``). The chunks come from the training
code's ``build_model_chunks`` (V placement) and the tied copies are summed by ``finalize_model_grads``.
"""
import dataclasses

import pytest
import torch

from omnitron.core.config import ParallelConfig
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.testing.distributed import REFERENCE_KERNELS, run_distributed
from omnitron.testing.parity import reference_kernels
from omnitron.testing.sim import requires_sim
from tests.parallel.test_parity_3d import MBS, SEED, SEQ, STEPS, _config, assert_run_matches, run_steps, \
    train_one_process

# float64: the layouts differ from one process only in the order of the micro-batch gradient sums and
# the tied copies' sum (~sqrt(n) u ~ 1e-15 relative); three SGD steps at lr 0.5 amplify it at most ~2x a
# step (see test_parity_3d.py): ~1e-14. TOL leaves a factor 100.
TOL = 1e-12


def _data(m: int) -> torch.Tensor:
    """Token ids: [STEPS, m micro-batches x MBS, SEQ + 1], fresh per micro-batch count."""
    g = torch.Generator().manual_seed(100 + m)
    return torch.randint(0, 96, (STEPS, MBS * m, SEQ + 1), generator=g)


def _iterator(data: torch.Tensor, device=None):
    for step in data.to(device):
        for mb in step.view(-1, MBS, SEQ + 1):
            yield {"tokens": mb[:, :-1], "labels": mb[:, 1:]}


def vshape_worker(runs) -> dict:
    from omnitron.backends import get_backend
    from omnitron.core.training.components import build_model_chunks

    be = get_backend()
    pp = torch.distributed.get_world_size()
    base = ParallelGroups.build(ParallelConfig(pipeline_model_parallel_size=pp), backend=be)
    groups = dataclasses.replace(base, config=ParallelConfig(pipeline_model_parallel_size=pp,
                                                             virtual_pipeline_model_parallel_size=2))
    out = {}
    for sched, m in runs:
        out[(sched, m)] = train_chunks(build_model_chunks(_config(), groups, SEED, be, sched), groups, sched,
                                       _data(m), be)
        assert out[(sched, m)][2].style == "v"
    return out


def train_chunks(built: list, groups, sched: str, data: torch.Tensor, be) -> tuple:
    """(evaluation + per-step losses, this rank's part of the full state, the schedule): ``built`` (this rank's
    chunks, on the device) wrapped for data parallelism and trained ``STEPS`` SGD steps over ``data``."""
    from omnitron.core.parallel.data import DataParallelConfig, DistributedDataParallel

    chunks = [DistributedDataParallel(c, groups, DataParallelConfig(overlap_grad_reduce=True, bucket_size=3000))
              for c in built]
    m = data.shape[1] // MBS
    dev = be.device()  # the data on the backend's device (the chunks are put there by build_model_chunks)
    return run_steps(sched, chunks, groups, _iterator(data[:1], dev), _iterator(data, dev), m, MBS * SEQ * m)


def _check(per_rank: list[dict]) -> None:
    for key in per_rank[0]:
        with reference_kernels():
            ref = train_one_process(_data(key[1]))
        assert_run_matches(key, [res[key][:2] for res in per_rank], *ref, tol=TOL)


def test_parity_vshape_pp2():
    runs = [(s, m) for s in ("zb-v", "dualpipe-v") for m in (4, 8)]
    _check(run_distributed(vshape_worker, 2, runs, env=REFERENCE_KERNELS))


@pytest.mark.slow
def test_parity_vshape_pp4():
    """pp4: zb-v at 4 and 8 micro-batches, dualpipe-v at 8 (it needs m >= 2p)."""
    _check(run_distributed(vshape_worker, 4, [("zb-v", 4), ("zb-v", 8), ("dualpipe-v", 8)], env=REFERENCE_KERNELS))


@pytest.mark.slow
@requires_sim()
def test_parity_vshape_pp2_on_sim():
    """The same on the simulated device (same tolerance: placement moves nothing when right)."""
    _check(run_distributed(vshape_worker, 2, [("zb-v", 4), ("dualpipe-v", 8)], backend="sim", env=REFERENCE_KERNELS))
