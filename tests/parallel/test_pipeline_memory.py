"""Pipeline memory: a stage's peak does not grow with the number of micro-batches.

Each sent activation and input gradient is released once its send completes and a sent chunk output keeps
only its autograd node (runtime.py, p2p.py), so what a stage holds is the schedule's in-flight micro-batches
(bounded by pp under 1F1B and interleaving) and not every micro-batch's boundary tensors until the step ends.
Reference: the same stage's peak at m = 4 (``PeakTracker``: every storage created during the step, freed when
its last holder lets it go) -- the two peaks differ by at most two boundary tensors, against 2 (m - 4) = 24
when every boundary tensor is kept to the end of the step.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim

S, B, H = 32, 4, 64
BOUNDARY = S * B * H * 4  # one [s, b, h] fp32 activation or gradient: 32 KiB


def _chunk(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.Tanh(), torch.nn.Linear(H, H))


def stage_peaks(cases) -> dict:
    """Per (schedule, m): this rank's peak bytes created during one warm ``forward_backward`` (on ``sim``: the
    device allocator's peak above what was allocated before the step), and its loss."""
    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.parallel.pipeline import forward_backward
    from omnitron.kernels.benchmark import PeakTracker

    be = get_backend()
    dev = be.device()
    base = ParallelGroups.build(ParallelConfig(pipeline_model_parallel_size=2), backend=be)
    out = {}
    for sched, m in cases:
        vp = 2 if sched == "interleaved" else 1
        groups = dataclasses.replace(base, config=ParallelConfig(
            pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=vp if vp > 1 else None))
        chunks = [_chunk(10 * c + groups.pp.rank).to(dev) for c in range(vp)]
        g = torch.Generator().manual_seed(1)
        data = [{"x": torch.randn(S, B, H, generator=g).to(dev), "y": torch.randn(S, B, H, generator=g).to(dev)}
                for _ in range(m)]
        last = groups.pp.is_last

        def step(chunk, batch, hidden, chunks=chunks, last=last):
            x = batch["x"] if hidden is None else hidden
            y = chunk(x)
            if last and chunk is chunks[-1]:
                return ((y - batch["y"]) ** 2).mean(-1)  # per-token loss [s, b]
            return y

        kw = dict(num_microbatches=m, seq_length=S, micro_batch_size=B, hidden_size=H, forward_step_fn=step)
        forward_backward(sched, chunks, iter(data), groups, **kw)  # warm
        if dev.type == "cpu":
            tracker = PeakTracker()
            with tracker:
                res = forward_backward(sched, chunks, iter(data), groups, **kw)
            peak = tracker.peak
        else:  # the device allocator's own count
            be.synchronize()
            be.reset_peak_memory_stats()
            before = be.memory_stats()["allocated"]
            res = forward_backward(sched, chunks, iter(data), groups, **kw)
            be.synchronize()
            peak = be.memory_stats()["peak_allocated"] - before
        out[(sched, m)] = (peak, res["loss"])
    return out


@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=requires_sim())])
def test_stage_peak_does_not_grow_with_microbatches(backend):
    """1F1B, interleaved (vp 2) and ZB-H1 at pp2, one world (spawns cost seconds); on cpu the storages' bytes,
    on sim the allocator's."""
    scheds = ("1f1b", "interleaved", "zb-h1")
    peaks = run_distributed(stage_peaks, 2, [(s, m) for s in scheds for m in (4, 16)], backend=backend,
                            env={"OMNITRON_STRICT_COLLECTIVES": "0"})
    for rank, p in enumerate(peaks):
        for sched in scheds:
            grow = p[(sched, 16)][0] - p[(sched, 4)][0]
            assert grow <= 2 * BOUNDARY, (rank, sched, grow / BOUNDARY, p)
