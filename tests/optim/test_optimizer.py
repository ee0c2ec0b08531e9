"""The optimizer, loss scaler and LR schedules against torch.optim / closed forms, in one process."""
from __future__ import annotations

import math

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.core.config.training import OptimizerConfig, PrecisionConfig
from omnitron.core.optim import LRScheduler, MixedPrecisionOptimizer
from omnitron.core.optim.optimizer import master_dtype
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.core.precision import ConstantLossScaler, DynamicLossScaler, build_loss_scaler


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))
    return m.to(dtype)


def _fill_grads(model, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=g, dtype=torch.float64) * scale).to(p.dtype)


def _torch_reference(kind, cfg, steps, lr, scale=3.0):
    """float64 torch.optim with the same decay/no-decay split and clipping."""
    ref = _model().double()
    decay = [p for n, p in ref.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in ref.named_parameters() if p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if kind == "adam":
        opt = torch.optim.AdamW(groups, lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    else:
        opt = torch.optim.SGD(groups, lr=lr, momentum=cfg.sgd_momentum)
    norms = []
    for s in range(steps):
        _fill_grads(ref, 100 + s, scale=scale)
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.clip_grad)))
        opt.step()
    return ref, norms


# float64: the engine and torch.optim differ only in the order of sums (the norm's 68 squares: <= 68 u = 8e-15
# relative, u = 1.1e-16) and in how AdamW's few operations are grouped (a few u per update); 4 steps of lr 1e-2 on
# weights ~0.3 and random gradients (none near eps) keep the weights within ~4 x lr x 1e-14 / 0.3 ~ 1e-15
# relative: 1e-12 and 1e-13 leave a factor ~100; float32 masters (the bug this case guards) err by ~1e-8.
NORM_REL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float64: 1e-13}
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float64: 1e-12}


# gradient scales: 3.0 gives global norms ~25 (every step clips to 1.0), 0.05 norms ~0.4 (no step clips: a clip
# factor that also scales small gradients up shows there)
@pytest.mark.parametrize("scale", [3.0, 0.05])
@pytest.mark.parametrize("kind", ["adam", "sgd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_matches_torch_optim(kind, dtype, scale):
    cfg = OptimizerConfig(optimizer=kind, lr=1e-2, weight_decay=0.1, clip_grad=1.0)
    ref, ref_norms = _torch_reference(kind, cfg, 4, cfg.lr, scale)
    assert all(n > 1.0 for n in ref_norms) if scale > 1 else all(n < 1.0 for n in ref_norms)
    model = _model(dtype)
    opt = MixedPrecisionOptimizer(model.named_parameters(), cfg, ParallelGroups.single(), backend=get_backend("cpu"))
    for s in range(4):
        _fill_grads(model, 100 + s, scale=scale)
        res = opt.step(cfg.lr)
        assert not res.skipped
        # bf16 grads are rounded before the norm: compare loosely there
        assert res.grad_norm == pytest.approx(ref_norms[s], rel=NORM_REL[dtype])
    tol = TOL[dtype]
    assert all(t.dtype == master_dtype(dtype) for ts in opt.state.values() for t in ts)  # Adam's / SGD's state
    for (name, p), m, (_, r) in zip(model.named_parameters(), opt.masters, ref.named_parameters()):
        assert m.dtype == master_dtype(dtype)
        torch.testing.assert_close(m.double(), r.detach(), rtol=tol, atol=tol)
        if dtype != torch.float32:
            assert p.dtype == dtype and torch.equal(p.detach(), m.to(dtype)), name


def test_main_grad_preferred_and_no_decay_on_1d():
    cfg = OptimizerConfig(optimizer="sgd", lr=0.5, weight_decay=0.3, sgd_momentum=0.0, clip_grad=0.0)
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e6)  # must be ignored: main_grad wins
        p.main_grad = torch.zeros_like(p)
    MixedPrecisionOptimizer(model.named_parameters(), cfg, ParallelGroups.single(),
                            backend=get_backend("cpu")).step(0.5)
    for n, p in model.named_parameters():
        expect = before[n] * (1 - 0.5 * 0.3) if p.ndim > 1 else before[n]
        torch.testing.assert_close(p.detach(), expect)


@pytest.mark.parametrize("norm_over_max", [2.1, 0.93])
def test_clip_coefficient_is_megatrons_with_its_epsilon(norm_over_max):
    """Megatron's clip (``clip_grad_by_total_norm_fp32``): gradients times ``min(1, max_norm / (norm + 1e-6))``.
    At --clip-grad 1e-5 the 1e-6 is a tenth of the norm, so its value shows: a norm just under the threshold is
    still clipped (by 1e-5 / (0.93e-5 + 1e-6) = 0.97). SGD without momentum or decay applies ``-lr * coef * g``;
    the reference is that formula in float64, from the float64 norm of fresh random gradients. Float32 arithmetic:
    the update is a few roundings of its float64 value (1e-6 relative bounds them), and the stored parameter one
    more, half a float32 ulp of it (2**-24 of its magnitude); lr 1e3 makes the update ~1e-3, far above that."""
    cfg = OptimizerConfig(optimizer="sgd", lr=1e3, weight_decay=0.0, sgd_momentum=0.0, clip_grad=1e-5)
    model = _model()
    before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    _fill_grads(model, torch.randint(0, 2 ** 31, ()).item())
    first = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))
    for p in model.parameters():
        p.grad.mul_(norm_over_max * 1e-5 / first)  # the norm near the threshold (float32: not exactly there)
    grads = {n: p.grad.double() for n, p in model.named_parameters()}
    norm = math.sqrt(sum(float(g.square().sum()) for g in grads.values()))
    coef = min(1.0, 1e-5 / (norm + 1e-6))
    assert coef < 0.99  # both cases clip
    MixedPrecisionOptimizer(model.named_parameters(), cfg, ParallelGroups.single(),
                            backend=get_backend("cpu")).step(1e3)
    for n, p in model.named_parameters():
        step = 1e3 * coef * grads[n]
        got = p.detach().double() - before[n]
        bound = 1e-6 * step.abs() + 2 ** -24 * (before[n] - step).abs()
        assert bool(((got + step).abs() <= bound).all()), (n, float(((got + step).abs() - bound).max()))


def test_clip_grad_zero_switches_clipping_off_and_huge_gradients_keep_a_finite_norm():
    """--clip-grad 0 disables clipping (Megatron clips only when clip_grad > 0): gradients of norm ~1e20 step whole.
    Their squares overflow float32 (|g| > 1.8e19) though every gradient is finite: the reported norm is the
    float64 one, not inf. Hand-derived: SGD applies ``-lr * g``; the norm of fresh float32 gradients in float64
    (rel 1e-6: the float64 sum of float32 squares, against an exact float64 sum of the same squares)."""
    cfg = OptimizerConfig(optimizer="sgd", lr=1e-21, weight_decay=0.0, sgd_momentum=0.0, clip_grad=0.0)
    model = _model()
    before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    _fill_grads(model, torch.randint(0, 2 ** 31, ()).item(), scale=1e20)
    grads = {n: p.grad.double() for n, p in model.named_parameters()}
    norm = math.sqrt(sum(float(g.square().sum()) for g in grads.values()))
    res = MixedPrecisionOptimizer(model.named_parameters(), cfg, ParallelGroups.single(),
                                  backend=get_backend("cpu")).step(1e-21)
    assert res.grad_norm == pytest.approx(norm, rel=1e-6)
    for n, p in model.named_parameters():
        step = 1e-21 * grads[n]  # ~0.1: unclipped (a clip to any finite max_norm would make it ~1e-21 * max_norm)
        bound = 1e-6 * step.abs() + 2 ** -24 * (before[n] - step).abs()
        assert bool(((p.detach().double() - before[n] + step).abs() <= bound).all()), n


def test_state_dict_round_trip_continues_identically():
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1)
    a = _model(torch.bfloat16)
    opt_a = MixedPrecisionOptimizer(a.named_parameters(), cfg, ParallelGroups.single(), backend=get_backend("cpu"))
    for s in range(2):
        _fill_grads(a, s)
        opt_a.step(1e-2)
    b = _model(torch.bfloat16, seed=5)
    b.load_state_dict(a.state_dict())
    opt_b = MixedPrecisionOptimizer(b.named_parameters(), cfg, ParallelGroups.single(), backend=get_backend("cpu"))
    opt_b.load_state_dict(opt_a.state_dict())
    for opt, m in ((opt_a, a), (opt_b, b)):
        _fill_grads(m, 9)
        opt.step(1e-2)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    with pytest.raises(ValueError, match="--optimizer"):
        MixedPrecisionOptimizer(b.named_parameters(), OptimizerConfig(optimizer="sgd"), ParallelGroups.single(),
                                backend=get_backend("cpu")).load_state_dict(opt_a.state_dict())


def test_fp16_overflow_skips_and_backs_off_with_hysteresis():
    scaler = DynamicLossScaler(initial_scale=1024.0, min_scale=1.0, growth_interval=3, hysteresis=2)
    cfg = OptimizerConfig(lr=1e-2)
    model = _model(torch.float16)
    opt = MixedPrecisionOptimizer(model.named_parameters(), cfg, ParallelGroups.single(), backend=get_backend("cpu"),
                                  loss_scaler=scaler)
    before = [p.detach().clone() for p in model.parameters()]
    _fill_grads(model, 0)
    next(model.parameters()).grad[0, 0] = float("inf")
    res = opt.step(1e-2)
    assert res.skipped and res.loss_scale == 1024.0 and scaler.scale == 1024.0  # hysteresis 2: not yet
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    next(model.parameters()).grad[0, 0] = float("nan")
    assert opt.step(1e-2).skipped and scaler.scale == 512.0 and opt.step_count == 0
    # clean steps: gradients are divided by the scale before the update
    _fill_grads(model, 1, scale=512.0)
    res = opt.step(1e-2)
    assert not res.skipped and opt.step_count == 1
    ref = _model(torch.float16)
    _fill_grads(ref, 1)
    assert res.grad_norm == pytest.approx(math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in ref.parameters())),
                                          rel=2e-3)
    for _ in range(2):
        _fill_grads(model, 2, scale=512.0)
        opt.step(1e-2)
    assert scaler.scale == 1024.0  # grew after 3 clean steps
    assert DynamicLossScaler(8.0, min_scale=4.0, hysteresis=1).scale == 8.0
    s = DynamicLossScaler(8.0, min_scale=4.0, hysteresis=1)
    for _ in range(3):
        s.update(True)
    assert s.scale == 4.0  # floor
    t = DynamicLossScaler()
    t.load_state_dict(scaler.state_dict())
    assert t.state_dict() == scaler.state_dict()


def test_build_loss_scaler():
    assert build_loss_scaler(PrecisionConfig(bf16=True)) is None
    assert isinstance(build_loss_scaler(PrecisionConfig(fp16=True, loss_scale=128.0)), ConstantLossScaler)
    dyn = build_loss_scaler(PrecisionConfig(fp16=True, initial_loss_scale=64.0, hysteresis=3))
    assert isinstance(dyn, DynamicLossScaler) and dyn.scale == 64.0 and dyn.hysteresis == 3


def test_lr_schedules():
    def sched(style, **kw):
        return LRScheduler(OptimizerConfig(lr=1.0, min_lr=0.1, lr_decay_style=style, lr_warmup_iters=10, **kw), 110)

    cos = sched("cosine")
    assert cos.lr(1) == pytest.approx(0.1) and cos.lr(10) == pytest.approx(1.0)
    assert cos.lr(60) == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi * 0.5) + 1))
    assert cos.lr(110) == pytest.approx(0.1) and cos.lr(500) == pytest.approx(0.1)
    lin = sched("linear")
    assert lin.lr(35) == pytest.approx(0.1 + 0.9 * 0.75)
    assert sched("constant").lr(100) == 1.0
    wsd = sched("WSD", lr_wsd_decay_iters=20, lr_wsd_decay_style="linear")
    assert wsd.lr(90) == 1.0 and wsd.lr(100) == pytest.approx(0.1 + 0.9 * 0.5) and wsd.lr(110) == pytest.approx(0.1)
    lrs = [cos.lr(i) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    other = LRScheduler(OptimizerConfig(lr=5.0), 10)
    other.load_state_dict(cos.state_dict(), keep="checkpoint")  # --use-checkpoint-opt_param-scheduler
    assert [other.lr(i) for i in range(1, 120)] == [cos.lr(i) for i in range(1, 120)]


def test_fp32_grads_reuse_their_buffers():
    """A bf16 parameter's fp32 gradient and a gradient-less parameter's zeros are buffers made once: the same
    storage every step (no allocation per step), refilled each time -- the zeros stay zeros after a step that
    scaled them by NaN (a NaN clip coefficient), and the converted gradient equals this step's bf16 one."""
    from omnitron.kernels.benchmark import PeakTracker

    model = _model(torch.bfloat16)
    cfg = OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0)
    opt = MixedPrecisionOptimizer(model.named_parameters(), cfg, ParallelGroups.single(), backend=get_backend("cpu"))
    params = list(model.parameters())
    first = None
    for s in range(3):
        _fill_grads(model, 100 + s)
        params[-1].grad = None  # no gradient this step: zeros
        with PeakTracker() as tracker:
            grads = opt._fp32_grads()
        assert tracker.peak == 0 or s == 0, tracker.events  # nothing new after the first step
        ptrs = [g.data_ptr() for g in grads]
        assert first is None or ptrs == first
        first = ptrs
        for p, g in zip(params[:-1], grads):
            assert g.dtype == torch.float32 and torch.equal(g, p.grad.float())
        assert torch.count_nonzero(grads[-1]) == 0
        torch._foreach_mul_(grads, float("nan"))  # what a NaN clip coefficient does to them in place


@pytest.mark.parametrize("extra,refused", [
    ({"min_loss_scale": 2.0 ** 33}, True),  # above the default first scale, 2^32
    ({"min_loss_scale": 8.0, "initial_loss_scale": 8.0}, False),
    ({"min_loss_scale": 2.0 ** 33, "loss_scale": 4.0}, False),  # a constant scale: no dynamic scaler
])
def test_min_loss_scale_above_the_first_is_refused(extra, refused):
    """Megatron's DynamicGradScaler asserts min_scale <= initial_scale; with --fp16 and dynamic scaling the
    settings are refused in one line naming both flags, and accepted otherwise."""
    from omnitron.core.config.parallel import ConfigError
    from omnitron.core.config.training import PrecisionConfig

    if not refused:
        assert PrecisionConfig(fp16=True, **extra).fp16
        return
    with pytest.raises(ConfigError, match="--min-loss-scale 8.58993e[+]09 is above --initial-loss-scale 4.29497e[+]09"):
        PrecisionConfig(fp16=True, **extra)

