"""The precision-aware Adam step's temporaries: what ``omnitron plan`` counts (:mod:`omnitron.plan.optimizer_step`)
bounds what the sim accelerator's allocator sees during the step, and the step no longer grows with the slice.

Reference: sim's own allocator (peak bytes above those held when ``_adamw`` starts), on a real built
``Components`` (bf16, distributed optimizer, precision-aware; dp2 so every rank steps its own slices) with random
gradients. ``MOMENT_CHUNK`` is set to 1024 elements (both the optimizer and the plan read it), so the largest owned
slices (the embedding's, thousands of elements) go in several chunks; run again with one chunk as large as any
slice -- what the step did before fp16 moments were chunked -- the same step's temporaries exceed the plan. And
the steps leave nothing allocated beyond the state (with --main-grads-dtype bf16 the step once kept an fp32 copy
of every owned gradient slice).
Both sides are integer byte counts. The plan counts every fp32 chunk, mask and copy from the code in the
allocator's 512-byte blocks; its one upper count is the allowance of :data:`~omnitron.plan.optimizer_step.SCALARS`
one-element tensors alive at once (the step holds between 0 and that many, each one block), so the plan may exceed
the measurement by at most ``SCALARS`` blocks and never fall below it.
"""
from __future__ import annotations

import os

import pytest

from omnitron.plan.optimizer_step import BLOCK, SCALARS
from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim
from test_state import _args

CHUNK = 1024


def _step_peaks(args: list[str], world: int) -> tuple[int, list[int], int]:
    """(the plan's step bytes, the measured step temporaries with chunks of CHUNK and of 2^24 elements, the bytes
    the two steps left allocated)."""
    import torch

    from omnitron.backends import get_backend
    from omnitron.core.optim import optimizer as opt_module
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.components import build_components
    from omnitron.plan.memory import model_config
    from omnitron.plan.state import state_bytes

    be = get_backend()
    s = parse_settings(args, world)
    c = build_components(s, be)
    opt = c.optimizer
    seen = []
    adamw = opt._adamw

    def measured(*a, **k):
        held = be.memory_stats()["allocated"]
        be.reset_peak_memory_stats()
        adamw(*a, **k)
        seen.append(be.memory_stats()["peak_allocated"] - held)

    opt._adamw = measured
    opt_module.MOMENT_CHUNK = CHUNK
    planned = state_bytes(s, model_config(s), c.groups.pp.rank).step
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    start = be.memory_stats()["allocated"]
    for size in (CHUNK, 1 << 24):
        opt_module.MOMENT_CHUNK = size
        for ch in c.chunks:
            for buf in ch.buffers:
                buf.data.copy_(torch.randn(buf.data.shape, generator=gen))
        opt.step(1e-3)
    return planned, seen, be.memory_stats()["allocated"] - start


MOMENTS = {"fp16": ["--exp-avg-dtype", "fp16", "--exp-avg-sq-dtype", "fp16"],
           "bf16": ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"],
           "bf16_fp16": ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "fp16"],
           "fp32_remainders": [],
           # the step reads the bf16 gradient buffers as they are (no fp32 copy of every slice kept between steps)
           "bf16_grads": ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16", "--main-grads-dtype", "bf16"]}


@requires_sim()
@pytest.mark.parametrize("name", list(MOMENTS))
def test_planned_step_temporaries_bound_the_measured(name, tmp_path):
    args = _args(str(tmp_path), 1, 1, ["--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer",
                                       "--global-batch-size", "2", *MOMENTS[name]])
    for rank, (planned, (chunked, whole), kept) in enumerate(run_distributed(_step_peaks, 2, args, 2,
                                                                                backend="sim")):
        assert 0 < chunked <= planned <= chunked + SCALARS * BLOCK, (name, rank, planned, chunked)
        assert whole > planned, (name, rank, planned, whole)
        assert kept == 0, (name, rank, kept)  # nothing but the state outlives a step
