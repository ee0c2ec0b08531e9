"""Adam moments stored in bf16 / fp16 (--exp-avg-dtype / --exp-avg-sq-dtype, Megatron's precision-aware optimizer).

Reference: a float64 transcription of Transformer Engine's FusedAdam with low-precision moments (read each moment
as fp32 -- fp16 times its per-tensor scale --, take the AdamW step -- ``p -= lr * (m_hat / (sqrt(v_hat) + eps) +
wd * p)`` -- and write each moment back: bf16 rounded to nearest, fp16 rescaled so that its largest magnitude is
fp16's max / 2 = 32752), applied step by step to the optimizer's own stored state on fresh random gradients. The
state dict keeps bf16 moments in bf16 (a resume continues bit for bit) and fp16 ones unscaled in fp32 (TE's
state_dict).
"""
from __future__ import annotations

import os

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.core.config.training import OptimizerConfig
from omnitron.core.optim import MixedPrecisionOptimizer
from omnitron.core.parallel.groups import ParallelGroups

U32, UNIT = 2.0 ** -24, {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
"""Unit roundoffs of fp32 (24 significant bits), and of each storage dtype after the fp32 step (0: fp32 keeps
the fp32 value)."""
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.LayerNorm(17), torch.nn.Linear(17, 9)).bfloat16()


def _optimizer(model, exp_avg: str, exp_avg_sq: str) -> MixedPrecisionOptimizer:
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0, adam_beta2=0.95, exp_avg_dtype=exp_avg,
                          exp_avg_sq_dtype=exp_avg_sq)
    return MixedPrecisionOptimizer(model.named_parameters(), cfg, ParallelGroups.single(), backend=get_backend("cpu"))


def _grads(model, gen: torch.Generator) -> None:
    for p in model.parameters():  # magnitudes spread over 2^-10 .. 2^4, so the moments span many binades
        g = torch.randn(p.shape, generator=gen, dtype=torch.float64) * torch.exp2(torch.randint(-10, 5, p.shape,
                                                                                                generator=gen))
        p.grad = g.to(torch.bfloat16)


def _te_step(p, g, m, v, *, step, cfg, decay):
    """One step of TE's FusedAdam (adam_w_mode, bias correction) in float64: (p, m, v) before rounding, the update
    ``m_hat / denom`` and ``(|m0| + |g|) / (bc1 * denom)`` (m's terms, which may cancel, over denom). The
    betas, eps, lr and decay are the fp32 numbers TE's kernel takes (``float`` arguments)."""
    b1, b2, eps, lr, wd = (_f32(x) for x in (cfg.adam_beta1, cfg.adam_beta2, cfg.adam_eps, cfg.lr, cfg.weight_decay))
    terms = m.abs() + g.abs()
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = (v / (1 - b2 ** step)).sqrt() + eps
    upd = m / (1 - b1 ** step) / denom
    return p - lr * (upd + (wd if decay else 0.0) * p), m, v, upd, terms / (1 - b1 ** step) / denom


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def _value(opt, key: str, i: int) -> torch.Tensor:
    """Moment ``key`` of master ``i`` in float64, read independently: fp16 times its scale (exact in float64)."""
    t = opt.state[key][i].double()
    return t * opt.scales[key][i].double() if key in opt.scales else t


@pytest.mark.parametrize("exp_avg,exp_avg_sq", [("bf16", "bf16"), ("bf16", "fp32"), ("fp32", "bf16"),
                                                ("fp16", "fp16"), ("fp16", "bf16")])
def test_steps_match_float64_fused_adam(exp_avg, exp_avg_sq):
    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs each run; the seed is in every message
    gen = torch.Generator().manual_seed(seed)
    model = _model(seed % 1000)
    opt = _optimizer(model, exp_avg, exp_avg_sq)
    cfg = opt.config
    for step in range(1, 7):
        _grads(model, gen)
        before = [(x.double(), _value(opt, "exp_avg", i), _value(opt, "exp_avg_sq", i))
                  for i, x in enumerate(opt.masters)]
        grads = [p.grad.double() for p in opt.params]
        opt.step(cfg.lr)
        for i, ((p0, m0, v0), g) in enumerate(zip(before, grads)):
            p, m, v, upd, spread = _te_step(p0, g, m0, v0, step=step, cfg=cfg, decay=opt.decay[i])
            b2 = _f32(cfg.adam_beta2)
            for name, ref, terms in (("exp_avg", m, m0.abs() + g.abs()),
                                     ("exp_avg_sq", v, b2 * v0 + (1 - b2) * g * g)):
                stored = opt.state[name][i]
                assert stored.dtype == DTYPES[exp_avg if name == "exp_avg" else exp_avg_sq]
                # the fp32 step: <= 4 roundings of terms' size (fp16's read fp16 * scale; m: a difference, a
                # product, a sum -- TE's b1 * m + (1 - b1) * g or the lerp m + (1 - b1) * (g - m) -- each of at
                # most |m0| + |g|; v: two products and a sum of positive terms): err32 = 4 * U32 * terms. Then
                # the storage: bf16 rounds to nearest, U * |x| with |x| <= |ref| + err32; fp16 first multiplies
                # by fp32(1 / scale) (2 more fp32 roundings, read back times scale), then rounds to fp16: U * |x|,
                # or half of fp16's smallest subnormal step 2^-24 in scaled units below 2^-14: 2^-25 * scale.
                # Truncating instead of rounding, stepping in the storage dtype, or fp16 unscaled (its moments of
                # 1e-9 and less flush to 0) errs well past this.
                u, err32 = UNIT[stored.dtype], 4 * U32 * terms
                bound = (u + 2 * U32) * (ref.abs() + err32) + err32 + 1e-300
                if stored.dtype == torch.float16:
                    scale = float(opt.scales[name][i])
                    bound = bound + 2.0 ** -25 * scale
                    # TE's rule: the largest magnitude lands at fp16's max / 2 (32752 * (1 +- 2 U32) rounds there)
                    assert float(stored.abs().max()) in (0.0, 32752.0), (seed, step, i, name)
                err = (_value(opt, name, i) - ref).abs()
                assert (err <= bound).all(), (seed, step, i, name, float((err / bound).max()))
            # the master: fp32 compute of p*(1 - lr*wd) (2 roundings of |p0|) minus lr * m_hat / denom from the
            # fp32 moments: m errs by 3 roundings of its terms (they may cancel: lr * 3 * spread), v (positive
            # terms) by 3 relative, denom by <= 5 relative (v's halved by the sqrt, the bias correction, the sqrt,
            # + eps), then the division, the bias correction and the product: <= 8 roundings of lr * |upd| in
            # all; and one final rounding of |p|
            bound = U32 * (3 * p0.abs() + p.abs() + cfg.lr * (8 * upd.abs() + 3 * spread))
            err = (opt.masters[i].double() - p).abs()
            assert (err <= bound).all(), (seed, step, i, "master", float((err / bound).max()))


def _trained(dtype: str):
    """(seed, its generator, a model, its optimizer with both moments in ``dtype`` after 3 steps, its state dict)."""
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    model = _model(1)
    opt = _optimizer(model, dtype, dtype)
    for _ in range(3):
        _grads(model, gen)
        opt.step(1e-2)
    return seed, gen, model, opt, opt.state_dict()


def test_state_dict_keeps_bf16_and_resumes_bit_for_bit():
    seed, gen, model, opt, saved = _trained("bf16")
    entry = saved["tensors"]["0.weight"]
    assert entry["exp_avg"].dtype == entry["exp_avg_sq"].dtype == torch.bfloat16 and entry["master"].dtype == \
        torch.float32
    copy = _model(2)  # other weights: the load must bring everything
    copy.load_state_dict(model.state_dict())
    resumed = _optimizer(copy, "bf16", "bf16")
    resumed.load_state_dict(saved)
    for _ in range(2):
        _grads(model, gen)
        for p, q in zip(model.parameters(), copy.parameters()):
            q.grad = p.grad.clone()
        opt.step(1e-2)
        resumed.step(1e-2)
    for a, b in zip([*opt.masters, *opt.state["exp_avg"], *opt.state["exp_avg_sq"]],
                    [*resumed.masters, *resumed.state["exp_avg"], *resumed.state["exp_avg_sq"]]):
        assert torch.equal(a, b), seed
    assert opt.state_bytes() == sum(4 * p.numel() + 2 * 2 * p.numel() for p in model.parameters())


def test_bf16_moments_step_in_chunks_bit_for_bit(monkeypatch):
    """The step of bf16 moments runs through fp32 copies MOMENT_CHUNK elements at a time: elementwise, so with
    chunks of 7 elements (cutting every tensor but the norm's) the state equals the whole tensors' step exactly."""
    from omnitron.core.optim import optimizer as optimizer_module

    seed, gen, model, opt, saved = _trained("bf16")
    copy = _model(2)
    copy.load_state_dict(model.state_dict())
    chunked = _optimizer(copy, "bf16", "bf16")
    chunked.load_state_dict(saved)
    _grads(model, gen)
    for p, q in zip(model.parameters(), copy.parameters()):
        q.grad = p.grad.clone()
    opt.step(1e-2)
    monkeypatch.setattr(optimizer_module, "MOMENT_CHUNK", 7)
    chunked.step(1e-2)
    for a, b in zip([*opt.masters, *opt.state["exp_avg"], *opt.state["exp_avg_sq"]],
                    [*chunked.masters, *chunked.state["exp_avg"], *chunked.state["exp_avg_sq"]]):
        assert torch.equal(a, b), seed


def test_fp16_state_dict_holds_unscaled_fp32_and_loads_rescaled():
    """TE's state_dict / load_state_dict: an fp16 moment is saved as its fp32 value (fp16 times scale) and scaled
    afresh on load (scale = fp32(absmax / 32752); the values rounded through fp16 again)."""
    seed, _, model, opt, saved = _trained("fp16")
    resumed = _optimizer(_model(3), "fp16", "fp16")
    resumed.load_state_dict(saved)
    for i, name in enumerate(opt.names):
        for key in ("exp_avg", "exp_avg_sq"):
            x = saved["tensors"][name][key]
            assert x.dtype == torch.float32 and torch.equal(x, opt.state[key][i].float() * opt.scales[key][i]), seed
            x, scale = x.double(), resumed.scales[key][i]
            # TE: torch.div(absmax, max_range, out=scale), both fp32 (the saved values are fp32, so is absmax)
            assert float(scale) == float(x.abs().max().float() / torch.tensor(32752.0)), (seed, name, key)
            # the value times fp32(1 / scale) (2 roundings), to fp16 (2^-11, or 2^-25 * scale below fp16's
            # normal range), times scale (exact in float64)
            bound = (2.0 ** -11 + 2 * U32) * x.abs() + 2.0 ** -25 * float(scale)
            assert ((_value(resumed, key, i) - x).abs() <= bound).all(), (seed, name, key)
    assert resumed.state_bytes() == opt.state_bytes() == sum(4 * p.numel() + 2 * 2 * p.numel() + 2 * 4
                                                              for p in model.parameters())


AWARE = ["--use-precision-aware-optimizer", "--use-distributed-optimizer"]


def test_flags_parse_as_megatron_reads_them():
    from omnitron.core.training.arguments import parse_settings

    base = ["--model", "gpt2_tiny", "--bf16"]
    s = parse_settings([*base, *AWARE, "--exp-avg-dtype", "bf16", "--main-grads-dtype", "bf16"], 1)
    # Megatron: --main-grads-dtype bf16 keeps validate_args from turning fp32 accumulation on under --bf16
    assert (s.optim.exp_avg_dtype, s.optim.exp_avg_sq_dtype) == ("bf16", "fp32")
    assert s.ddp.grad_reduce_in_bf16 and not s.ddp.accumulate_allreduce_grads_in_fp32
    assert parse_settings([*base, *AWARE], 1).ddp.accumulate_allreduce_grads_in_fp32


@pytest.mark.parametrize("extra,match", [
    (["--exp-avg-dtype", "bf16"], "^--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
    (["--exp-avg-dtype", "fp8", *AWARE], "^--exp-avg-dtype fp8: Transformer Engine's scaled fp8"),
    (["--main-params-dtype", "fp16", *AWARE], "^--main-params-dtype fp16: Transformer Engine's scaled fp16 master"),
    (["--main-grads-dtype", "bf16", "--accumulate-allreduce-grads-in-fp32", *AWARE],
     "^--main-grads-dtype bf16 contradicts --accumulate-allreduce-grads-in-fp32"),
    # Megatron: precision-aware needs its distributed optimizer, which --use-torch-fsdp2 asserts off
    (["--use-precision-aware-optimizer", "--use-torch-fsdp2", "--exp-avg-dtype", "bf16"],
     "^--use-precision-aware-optimizer with --use-torch-fsdp2: Megatron runs the former with its distributed"),
])
def test_what_is_not_implemented_stops_in_one_line(extra, match):
    from omnitron.core.config.parallel import ConfigError
    from omnitron.core.training.arguments import parse_settings

    with pytest.raises(ConfigError, match=match):
        parse_settings(["--model", "gpt2_tiny", "--bf16", *extra], 1)
