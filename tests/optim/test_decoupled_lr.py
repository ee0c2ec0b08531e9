"""--decoupled-lr / --decoupled-min-lr: the input embedding and output layer follow the schedule between
their own end points (Megatron's per-group max_lr / min_lr), every other parameter the --lr schedule.

References are written here from the definitions: the schedule's closed form in float64, and
torch.optim.AdamW in float64 with the embedding and output layer in a group of their own.
"""
from __future__ import annotations

import math

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.core.config import ConfigError
from omnitron.core.config.training import OptimizerConfig
from omnitron.core.models.gpt import GPTModel, gpt2_tiny
from omnitron.core.optim import LRScheduler, MixedPrecisionOptimizer
from omnitron.core.parallel.groups import ParallelGroups

DECOUPLED = {"embedding.word_embeddings.weight", "output_layer.weight"}
"""Megatron-Core's ``is_embedding_or_output_parameter`` set for a GPT: named independently of the flag."""


def _cosine(i, lo, hi, warmup, decay, init):
    if i <= warmup:
        return init + (hi - init) * i / warmup
    if i >= decay:
        return lo
    return lo + 0.5 * (1 + math.cos(math.pi * (i - warmup) / (decay - warmup))) * (hi - lo)


@pytest.mark.parametrize("decoupled_min", [None, 2e-5])
def test_schedule_gives_each_group_its_own_end_points(decoupled_min):
    cfg = OptimizerConfig(lr=3e-4, min_lr=3e-5, lr_warmup_iters=4, lr_decay_style="cosine", lr_warmup_init=1e-5,
                          decoupled_lr=1e-3, decoupled_min_lr=decoupled_min)
    sched = LRScheduler(cfg, train_iters=20)
    lo = 3e-5 if decoupled_min is None else decoupled_min  # Megatron: --decoupled-min-lr defaults to --min-lr
    for done in range(22):
        i = done  # the rate of the step after ``done`` successful ones: Megatron's lr(num_steps) before it
        # NOTE: both sides are a handful of float64 operations on the same values: equal to rounding
        assert sched.lr_for_step(done, 8) == pytest.approx(_cosine(i, 3e-5, 3e-4, 4, 20, 1e-5), rel=1e-12)
        assert sched.decoupled_lr_for_step(done, 8) == pytest.approx(_cosine(i, lo, 1e-3, 4, 20, 1e-5), rel=1e-12)
    plain = LRScheduler(OptimizerConfig(lr=3e-4), train_iters=20)
    assert plain.decoupled_lr_for_step(0, 8) is None


def test_checkpointed_schedule_keeps_the_decoupled_end_points():
    cfg = OptimizerConfig(lr=3e-4, lr_decay_style="linear", decoupled_lr=1e-3, decoupled_min_lr=1e-4)
    state = LRScheduler(cfg, train_iters=10).state_dict()
    other = LRScheduler(OptimizerConfig(lr=3e-4, lr_decay_style="linear"), train_iters=10)
    with pytest.raises(ConfigError, match="--decoupled-lr: 0.001 in the checkpoint, None now"):
        other.load_state_dict(state)  # a difference stops the load, as for --lr (Megatron's check)
    other.load_state_dict(state, keep="checkpoint")  # --use-checkpoint-opt_param-scheduler: the checkpoint's stand
    assert other.decoupled_lr_for_step(4, 1) == pytest.approx(1e-4 + (1e-3 - 1e-4) * (1 - 4 / 10), rel=1e-12)


def test_bad_decoupled_rates_are_refused():
    with pytest.raises(ConfigError, match="--decoupled-min-lr needs --decoupled-lr"):
        OptimizerConfig(decoupled_min_lr=1e-5)
    with pytest.raises(ConfigError, match="--decoupled-min-lr .* <= --decoupled-lr"):
        OptimizerConfig(decoupled_lr=1e-4, decoupled_min_lr=1e-3)


def _fill(model, seed):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)


def test_adamw_steps_embedding_and_output_layer_with_the_decoupled_rate():
    cfg = OptimizerConfig(lr=1e-3, decoupled_lr=7e-3, weight_decay=0.1, clip_grad=0.0)
    model = GPTModel(gpt2_tiny(vocab_size=61, num_layers=1, hidden_size=16, ffn_hidden_size=32, seq_length=8,
                               untie_embeddings_and_output_weights=True), ParallelGroups.single(), seed=3)
    ref = {n: p.detach().double().clone().requires_grad_(True) for n, p in model.named_parameters()}
    assert DECOUPLED <= set(ref)
    groups = [{"params": [ref[n] for n in ref if (n in DECOUPLED) == dec and (ref[n].ndim > 1) == wd],
               "lr": 7e-3 if dec else 1e-3, "weight_decay": 0.1 if wd else 0.0}
              for dec in (True, False) for wd in (True, False)]
    torch_opt = torch.optim.AdamW([g for g in groups if g["params"]], betas=(0.9, 0.999), eps=1e-8)
    opt = MixedPrecisionOptimizer(model.named_parameters(), cfg, ParallelGroups.single(), backend=get_backend("cpu"))
    for step in range(3):
        _fill(model, 50 + step)
        for n, p in model.named_parameters():
            ref[n].grad = p.grad.double()
        opt.step(1e-3, decoupled_lr=7e-3)
        torch_opt.step()
    # NOTE: fp32 AdamW against float64. Per step: the stored value rounds by |p| * 2**-24 (<= 1e-7 for the norm
    # weights near 1), and the update lr * m_hat / (sqrt(v_hat) + eps) (|m_hat / sqrt(v_hat)| <= ~1) carries the
    # fp32 bias correction 1 - 0.999**t, whose cancellation costs 2**-24 / 1e-3 ~ 6e-5 relative: with lr <= 7e-3,
    # 3 steps stay below 3 * (1e-7 + 7e-3 * 1e-4) ~ 2.4e-6. One rate for every parameter would miss by ~1e-2.
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach().double(), ref[n].detach(), rtol=0, atol=2.5e-6, msg=n)
    with_one_rate = MixedPrecisionOptimizer(
        GPTModel(model.config, ParallelGroups.single(), seed=3).named_parameters(), cfg, ParallelGroups.single(),
        backend=get_backend("cpu"))
    assert sum(with_one_rate.decoupled) == 2  # exactly the embedding and the output layer
