"""--weight-decay-incr-style / --start-weight-decay / --end-weight-decay against Megatron's scheduler.

The reference is a transcription of Megatron-LM at d98e8a6: ``OptimizerParamScheduler.get_wd``
(megatron/core/optimizer_param_scheduler.py), driven as megatron/training/training.py drives it
(``get_optimizer_param_scheduler``: ``wd_incr_steps`` is --train-iters x --global-batch-size or --train-samples,
``num_steps`` the samples of the successful steps before the one that applies it) and set up as
``validate_args`` sets it (a constant style takes --weight-decay at both ends). Each step's decay multiplies the
decayed parameters' update (``param_group['weight_decay'] = get_wd() * wd_mult``, wd_mult 0 for 1-D and bias).
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from omnitron.core.config.parallel import ConfigError
from omnitron.core.config.training import OptimizerConfig
from omnitron.core.optim import LRScheduler, MixedPrecisionOptimizer
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.core.training.batches import BatchRamp


def megatron_wd(num_steps, start_wd, end_wd, wd_incr_steps, wd_incr_style):
    """OptimizerParamScheduler.get_wd, transcribed (names as there)."""
    if num_steps > wd_incr_steps:
        return end_wd
    if wd_incr_style == 'constant':
        assert start_wd == end_wd
        return end_wd
    incr_ratio = float(num_steps) / float(wd_incr_steps)
    assert 0.0 <= incr_ratio <= 1.0
    delta_wd = end_wd - start_wd
    if wd_incr_style == 'linear':
        coeff = incr_ratio
    elif wd_incr_style == 'cosine':
        coeff = 0.5 * (math.cos(math.pi * (1 - incr_ratio)) + 1.0)
    return start_wd + coeff * delta_wd


def _compare(ours: LRScheduler, batches, ref_args, skipped=()):
    """Each step's decay; a skipped (fp16 overflow) step advances neither schedule, as Megatron."""
    successful, num_steps = 0, 0
    for i, b in enumerate(batches):
        want = megatron_wd(num_steps, *ref_args)
        # the same few float64 operations on the same integers (ours in units of the global batch): a few ulp
        assert ours.wd_for_step(successful, b) == pytest.approx(want, rel=1e-13, abs=1e-300), (i, num_steps)
        if i in skipped:
            continue
        successful += 1
        num_steps += b
        ours.advance(b)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_iteration_run_follows_megatrons_get_wd(style):
    gbs, iters = 8, 30
    cfg = OptimizerConfig(weight_decay_incr_style=style, start_weight_decay=0.01, end_weight_decay=0.2)
    # 34 batches: the last ones are past the run's length (Megatron keeps the end value there)
    _compare(LRScheduler(cfg, iters, None, gbs), [gbs] * 34, (0.01, 0.2, iters * gbs, style), skipped={2, 9})


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_sample_run_follows_megatrons_get_wd_along_a_ramp(style):
    ramp = BatchRamp(16, 2, (4, 4, 120))  # 4, 8, 12, 16 sequences a step
    cfg = OptimizerConfig(weight_decay_incr_style=style, start_weight_decay=0.0, end_weight_decay=0.1)
    batches, consumed = [], 0
    while consumed < 600:
        batches.append(ramp.global_batch(consumed))
        consumed += batches[-1]
    _compare(LRScheduler(cfg, len(batches), 560), batches, (0.0, 0.1, 560, style), skipped={1})


def test_constant_style_is_weight_decay():
    sched = LRScheduler(OptimizerConfig(weight_decay=0.07), 10, None, 4)
    _compare(sched, [4] * 12, (0.07, 0.07, 40, "constant"))


@pytest.mark.parametrize("kw,match", [
    ({"weight_decay_incr_style": "exponential"}, "use constant, linear or cosine"),
    ({"start_weight_decay": 0.1}, "need --weight-decay-incr-style linear or cosine"),
    ({"weight_decay_incr_style": "linear", "start_weight_decay": 0.1}, "needs both"),
    ({"weight_decay_incr_style": "cosine", "start_weight_decay": 0.2, "end_weight_decay": 0.1}, "only increases"),
    ({"weight_decay_incr_style": "linear", "start_weight_decay": -0.1, "end_weight_decay": 0.1}, "need 0 <="),
])
def test_bad_weight_decay_settings_stop_in_one_line(kw, match):
    """Megatron asserts these (validate_args; the scheduler's start_wd >= 0 and end_wd >= start_wd)."""
    with pytest.raises(ConfigError, match=match) as info:
        OptimizerConfig(**kw)
    assert "\n" not in str(info.value)


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))


def _grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.device, p.dtype)


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_optimizer_applies_each_steps_decay(kind, backend):
    """torch.optim in float64, its decayed group's weight_decay set to the step's value (1-D parameters: none)."""
    wds = [0.0, 0.05, 0.3, 0.12]
    cfg = OptimizerConfig(optimizer=kind, lr=0.05, weight_decay=0.9, clip_grad=0.0, sgd_momentum=0.5)
    ref = _model().double()
    groups = [{"params": [p for p in ref.parameters() if p.ndim > 1]},
              {"params": [p for p in ref.parameters() if p.ndim <= 1], "weight_decay": 0.0}]
    topt = torch.optim.AdamW(groups, lr=cfg.lr) if kind == "adam" else torch.optim.SGD(groups, lr=cfg.lr, momentum=0.5)
    model = _model().to(backend.device())  # the backend under test's kernels and device
    opt = MixedPrecisionOptimizer(model.named_parameters(), cfg, ParallelGroups.single(), backend=backend)
    for s, wd in enumerate(wds):
        topt.param_groups[0]["weight_decay"] = wd
        _grads(ref, s)
        topt.step()
        _grads(model, s)
        opt.step(cfg.lr, weight_decay=wd)
    # fp32 masters against float64 over 4 steps of |update| <= lr: the fp32 rounding of each step (~1e-7 relative)
    # and Adam's division by sqrt(v) + eps on O(1) gradients keep the difference near 1e-6
    for m, r in zip(opt.masters, ref.parameters()):
        torch.testing.assert_close(m.double().cpu(), r.detach(), rtol=1e-5, atol=1e-5)


def test_resume_checks_the_weight_decay_schedule():
    """Megatron's load_state_dict checks start/end wd, their style and length (``_check_and_set``); a checkpoint
    without them (written before) loads; a constant decay does not depend on the run's length."""
    cfg = OptimizerConfig(weight_decay_incr_style="linear", start_weight_decay=0.0, end_weight_decay=0.1)
    saved = LRScheduler(cfg, 20, None, 4).state_dict()
    other = OptimizerConfig(weight_decay_incr_style="linear", start_weight_decay=0.0, end_weight_decay=0.2)
    with pytest.raises(ConfigError, match="--end-weight-decay"):
        LRScheduler(other, 20, None, 4).load_state_dict(saved)
    with pytest.raises(ConfigError, match="the weight decay's rise"):
        LRScheduler(cfg, 30, None, 4).load_state_dict(saved)
    kept = LRScheduler(other, 20, None, 4)
    kept.load_state_dict(saved, keep="checkpoint")
    assert kept.wd(10) == pytest.approx(0.05)  # the checkpoint's ends: halfway is 0.05, not 0.1
    plain = OptimizerConfig(lr_decay_iters=10)
    old = {k: v for k, v in LRScheduler(plain, 20, None, 4).state_dict().items() if "wd" not in k}
    LRScheduler(plain, 30, None, 4).load_state_dict(old)
    LRScheduler(plain, 30, None, 4).load_state_dict(LRScheduler(plain, 20, None, 4).state_dict())


def test_training_run_applies_megatrons_weight_decay(tmp_path, backend):
    """A real run: the decay each step applied (metrics.jsonl) is Megatron's, and the weights saw it (a run with
    --end-weight-decay 0 ends elsewhere)."""
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    def run(name, end):
        argv = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "5", "--mock-data",
                "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--lr", "1e-2", "--log-interval", "1",
                "--no-tensorboard", "--log-dir", str(tmp_path / name), "--data-cache-path", str(tmp_path / "cache"),
                "--weight-decay-incr-style", "cosine", "--start-weight-decay", "0.0", "--end-weight-decay", end]
        train(parse_settings(argv, 1), backend)
        return [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]

    recs = run("a", "0.5")
    for i, rec in enumerate(recs):
        assert rec["weight_decay"] == pytest.approx(megatron_wd(i * 4, 0.0, 0.5, 20, "cosine"), rel=1e-13)
    plain = run("b", "0.0")
    assert recs[0]["lm_loss"] == plain[0]["lm_loss"]  # step 1 decays by 0 in both
    assert recs[-1]["lm_loss"] != plain[-1]["lm_loss"]


def _megatron_no_wd(name, shape, apply_wd_to_qk_layernorm):
    """get_standard_config_overrides' wd_mult 0 predicate, transcribed (names as Megatron-Core's, which omnitron's
    GPT uses: ``self_attention.q_layernorm.weight``, ...)."""
    if apply_wd_to_qk_layernorm:
        return (len(shape) == 1 or name.endswith(".bias")) and not ("q_layernorm." in name or "k_layernorm." in name)
    return len(shape) == 1 or name.endswith(".bias")


@pytest.mark.parametrize("flag", [False, True])
def test_qk_layernorm_decay_is_megatrons_rule(flag, backend):
    """--apply-wd-to-qk-layernorm: an SGD step on zero gradients scales exactly the decayed parameters by
    1 - lr x wd (the others stay), and those are Megatron's (the q/k norms too with the flag)."""
    from omnitron.core.models.gpt import GPTModel, gpt2_tiny
    from omnitron.core.training.arguments import parse_settings

    base = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--mock-data", "--vocab-size",
            "64", "--tokenizer-type", "NullTokenizer"]
    cfg = parse_settings(base + ["--optimizer", "sgd", "--sgd-momentum", "0", "--weight-decay", "0.25",
                                 "--clip-grad", "0"] + (["--apply-wd-to-qk-layernorm"] if flag else []), 1).optim
    assert cfg.apply_wd_to_qk_layernorm is flag
    model = GPTModel(gpt2_tiny(vocab_size=64, num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               seq_length=8, qk_layernorm=True), ParallelGroups.single(), seed=3).to(backend.device())
    with torch.no_grad():
        for p in model.parameters():  # norms start at ones and zeros: make every decay visible
            p.add_(torch.rand(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(p.device) + 0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    MixedPrecisionOptimizer(model.named_parameters(), cfg, ParallelGroups.single(), backend=backend).step(0.4)
    names = [n for n, _ in model.named_parameters()]
    assert any("q_layernorm." in n for n in names) and any("k_layernorm." in n for n in names)
    for name, p in model.named_parameters():
        decayed = not _megatron_no_wd(name, tuple(p.shape), flag)
        # one fp32 multiply by 1 - 0.1: within one rounding of the float64 product
        want = before[name].double() * (1 - 0.4 * 0.25) if decayed else before[name].double()
        torch.testing.assert_close(p.detach().double(), want, rtol=1e-7, atol=0), name
