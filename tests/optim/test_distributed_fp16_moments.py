"""The distributed optimizer saves fp16 moments as the plain optimizer does (TE's state_dict): unscaled, as fp32 --
each owned slice's fp16 values times that slice's scale (the product of an fp16 value and an fp32 scale, 11 + 24
significant bits, is exact in float64; its one rounding to fp32 is what is saved) -- and bf16 moments in bf16.

Reference: the optimizer's stored fp16 slices and scales read by the test itself, multiplied in float64 and rounded
once to fp32; one process, one data-parallel rank (each parameter one slice of its bucket)."""
from __future__ import annotations

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.core.config.training import OptimizerConfig
from omnitron.core.parallel.groups import ParallelGroups


def _trained(exp_avg: str, exp_avg_sq: str, seed: int):
    from omnitron.core.optim.distributed import DistributedOptimizer
    from omnitron.core.parallel.data import DataParallelConfig, DistributedDataParallel

    torch.manual_seed(seed)
    be, groups = get_backend("cpu"), ParallelGroups.single()
    model = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 5))
    ddp = DistributedDataParallel(model, groups, DataParallelConfig(use_distributed_optimizer=True, bucket_size=40),
                                  collectives=be.collectives)
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0, exp_avg_dtype=exp_avg, exp_avg_sq_dtype=exp_avg_sq)
    opt = DistributedOptimizer(list(model.named_parameters()), cfg, groups, backend=be, chunks=[ddp])
    gen = torch.Generator().manual_seed(seed)
    for _ in range(3):
        ddp.zero_grad_buffer()
        for p in model.parameters():  # magnitudes over 2^-8 .. 2^4: the moments span many binades
            p.main_grad.copy_(torch.randn(p.shape, generator=gen) * torch.exp2(torch.randint(-8, 5, p.shape,
                                                                                              generator=gen)))
        ddp.finish_grad_sync()
        assert not opt.step(cfg.lr).skipped
    return model, opt


@pytest.mark.parametrize("seed", [0, 1])
def test_fp16_moments_are_saved_unscaled_in_fp32(seed):
    model, opt = _trained("fp16", "fp16", seed)
    saved = opt.state_dict()["tensors"]
    for j, s in enumerate(opt.slices):
        name = opt.names[s.param]
        for key in ("exp_avg", "exp_avg_sq"):
            stored, scale = opt.state[key][j], opt.scales[key][j]
            assert stored.dtype == torch.float16
            want = (stored.double() * float(scale)).float()
            got = saved[name][key].reshape(-1)[s.lo:s.hi]
            assert got.dtype == torch.float32 and torch.equal(got, want), (seed, name, key)
            assert want.abs().max() > 0  # three steps of nonzero gradients: not vacuous


def test_bf16_moments_are_saved_as_they_are_stored():
    _, opt = _trained("bf16", "bf16", 2)
    saved = opt.state_dict()["tensors"]
    for j, s in enumerate(opt.slices):
        for key in ("exp_avg", "exp_avg_sq"):
            got = saved[opt.names[s.param]][key].reshape(-1)[s.lo:s.hi]
            assert got.dtype == torch.bfloat16 and torch.equal(got, opt.state[key][j])
