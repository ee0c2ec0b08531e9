"""The distributed optimizer's low-precision state: fp16 moments saved as the plain optimizer saves them (TE's
state_dict): unscaled, as fp32 -- each owned slice's fp16 values times that slice's scale (the product of an fp16
value and an fp32 scale, 11 + 24 significant bits, is exact in float64; its one rounding to fp32 is what is saved)
-- and bf16 moments in bf16; bf16 main grads clipped in place (Megatron's precision-aware step).

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


def test_bf16_main_grads_are_clipped_in_place_without_an_fp32_copy():
    """Precision-aware step over bf16 gradient buffers (a bf16 model, its main grads in bf16): as Megatron, the
    global-norm clip scales the buffers themselves (no fp32 copy of every slice, 4 bytes an owned element): after
    the step each gradient is ``bf16(g * clip / (norm + 1e-6))``. Reference: the norm and the product in float64
    from the gradients the test wrote; the engine takes the norm in fp32 and scales in fp32 before the one bf16
    rounding, so its result is within one bf16 ulp (2^-8 relative) of the float64 product rounded."""
    from omnitron.core.optim.distributed import DistributedOptimizer
    from omnitron.core.parallel.data import DataParallelConfig, DistributedDataParallel

    torch.manual_seed(4)
    be, groups = get_backend("cpu"), ParallelGroups.single()
    model = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Linear(7, 5)).bfloat16()
    ddp = DistributedDataParallel(model, groups, DataParallelConfig(use_distributed_optimizer=True, bucket_size=40),
                                  collectives=be.collectives)
    clip = 0.25
    cfg = OptimizerConfig(lr=1e-2, clip_grad=clip, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    opt = DistributedOptimizer(list(model.named_parameters()), cfg, groups, backend=be, chunks=[ddp])
    ddp.zero_grad_buffer()
    gen = torch.Generator().manual_seed(5)
    written = {}
    for name, p in model.named_parameters():
        assert p.main_grad.dtype == torch.bfloat16
        p.main_grad.copy_(torch.randn(p.shape, generator=gen))
        written[name] = p.main_grad.double().clone()
    ddp.finish_grad_sync()
    norm = sum(float(g.pow(2).sum()) for g in written.values()) ** 0.5
    coeff = clip / (norm + 1e-6)
    assert coeff < 0.2  # the clip acts: a gradient left as written would be 5x off
    assert not opt.step(cfg.lr).skipped
    for name, p in model.named_parameters():
        want = (written[name] * coeff).to(torch.bfloat16).double()
        err = (p.main_grad.double() - want).abs()
        assert (err <= 2.0 ** -8 * want.abs()).all(), name
