"""The learning rate each optimizer step applies, step for step, against Megatron's scheduler.

megatron-core is not installed here, so the reference is a transcription of Megatron-LM at d98e8a6
(d98e8a64ddf34856e74b24714e3bedb2f5a39553): ``OptimizerParamScheduler.get_lr`` / ``step`` in
megatron/core/optimizer_param_scheduler.py, driven as megatron/training/training.py drives it
(``get_optimizer_param_scheduler``: every count in samples, iteration counts times --global-batch-size,
``lr_warmup_steps = fraction * lr_decay_steps``; ``step(0)`` at construction; after each *successful* step
``step(increment=global batch)``). The rate a step applies is the one set before it runs.
"""
from __future__ import annotations

import math

import pytest

from omnitron.core.config.training import OptimizerConfig
from omnitron.core.optim.schedules import LRScheduler
from omnitron.core.training.batches import BatchRamp


class MegatronScheduler:
    """OptimizerParamScheduler's learning-rate half, transcribed (names as there)."""

    def __init__(self, init_lr, max_lr, min_lr, lr_warmup_steps, lr_decay_steps, lr_decay_style,
                 wsd_decay_steps=None, lr_wsd_decay_style=None):
        self.init_lr, self.max_lr, self.min_lr = init_lr, float(max_lr), min_lr
        self.lr_warmup_steps, self.lr_decay_steps = lr_warmup_steps, lr_decay_steps
        self.wsd_decay_steps, self.lr_wsd_decay_style = wsd_decay_steps, lr_wsd_decay_style
        self.lr_decay_style, self.num_steps = lr_decay_style, 0
        assert self.lr_decay_steps > 0 and self.lr_warmup_steps < self.lr_decay_steps
        self.step(0)

    def get_lr(self):
        max_lr, min_lr = self.max_lr, self.min_lr
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + ((max_lr - self.init_lr) * float(self.num_steps) / float(self.lr_warmup_steps))
        if self.lr_decay_style == 'constant':
            return max_lr
        if self.num_steps > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == 'inverse-square-root':
            warmup_steps = max(self.lr_warmup_steps, 1)
            num_steps = max(self.num_steps, 1)
            lr = max_lr * warmup_steps**0.5 / (num_steps**0.5)
            return max(min_lr, lr)
        num_steps_ = self.num_steps - self.lr_warmup_steps
        decay_steps_ = self.lr_decay_steps - self.lr_warmup_steps
        decay_ratio = float(num_steps_) / float(decay_steps_)
        assert 0.0 <= decay_ratio <= 1.0
        delta_lr = max_lr - min_lr
        if self.lr_decay_style == 'linear':
            coeff = 1.0 - decay_ratio
        elif self.lr_decay_style == 'cosine':
            coeff = 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
        elif self.lr_decay_style == 'WSD':
            wsd_anneal_start_ = self.lr_decay_steps - self.wsd_decay_steps
            if self.num_steps <= wsd_anneal_start_:
                coeff = 1.0
            else:
                wsd_steps = self.num_steps - wsd_anneal_start_
                wsd_decay_ratio = float(wsd_steps) / float(self.wsd_decay_steps)
                coeff = {"linear": lambda r: 1.0 - r, "cosine": lambda r: 0.5 * (math.cos(math.pi * r) + 1.0),
                         "exponential": lambda r: (2.0 * math.pow(0.5, r)) - 1.0,
                         "minus_sqrt": lambda r: 1.0 - math.sqrt(r)}[self.lr_wsd_decay_style](wsd_decay_ratio)
        return min_lr + coeff * delta_lr

    def step(self, increment):
        self.num_steps += increment
        self.lr = self.get_lr()


STYLES = [("constant", None), ("linear", None), ("cosine", None), ("inverse-square-root", None),
          ("WSD", "linear"), ("WSD", "cosine"), ("WSD", "exponential"), ("WSD", "minus_sqrt")]


def _compare(ours: LRScheduler, ref: MegatronScheduler, batches, skipped=()):
    """Each step's applied rate; a skipped (fp16 overflow) step advances neither schedule, as Megatron."""
    successful = 0
    for i, b in enumerate(batches):
        # both are the same few float64 operations on the same integers: equal to a few ulp
        assert ours.lr_for_step(successful, b) == pytest.approx(ref.lr, rel=1e-13, abs=1e-300), (i, ref.num_steps)
        if i in skipped:
            continue
        successful += 1
        ours.advance(b)
        ref.step(b)


@pytest.mark.parametrize("style,wsd", STYLES)
@pytest.mark.parametrize("warmup,init", [(0, 0.0), (4, 0.0), (4, 2e-5)])
def test_iteration_schedule_applies_megatrons_rate(style, wsd, warmup, init):
    gbs, iters, decay, wsd_iters = 8, 30, 24, 6
    cfg = OptimizerConfig(lr=3e-4, min_lr=3e-5, lr_decay_style=style, lr_warmup_iters=warmup, lr_decay_iters=decay,
                          lr_warmup_init=init, lr_wsd_decay_iters=wsd_iters, lr_wsd_decay_style=wsd or "linear")
    ref = MegatronScheduler(init, 3e-4, 3e-5, warmup * gbs, decay * gbs, style, wsd_iters * gbs, wsd or "linear")
    _compare(LRScheduler(cfg, train_iters=iters, global_batch_size=gbs), ref, [gbs] * iters, skipped={3, 11})
    if warmup and init == 0.0:
        assert LRScheduler(cfg, train_iters=iters).lr_for_step(0, gbs) == 0.0  # the first step applies lr(0) = 0


@pytest.mark.parametrize("style,wsd", STYLES)
def test_sample_schedule_applies_megatrons_rate_along_a_ramp(style, wsd):
    ramp = BatchRamp(16, 2, (4, 4, 120))  # 4, 8, 12, 16 sequences a step
    cfg = OptimizerConfig(lr=1e-3, min_lr=1e-5, lr_decay_style=style, lr_warmup_samples=30, lr_decay_samples=500,
                          lr_warmup_init=1e-6, lr_wsd_decay_samples=90, lr_wsd_decay_style=wsd or "linear")
    ref = MegatronScheduler(1e-6, 1e-3, 1e-5, 30, 500, style, 90, wsd or "linear")
    batches, consumed = [], 0
    while consumed < 600:
        batches.append(ramp.global_batch(consumed))
        consumed += batches[-1]
    _compare(LRScheduler(cfg, train_iters=len(batches), train_samples=600), ref, batches, skipped={2})


@pytest.mark.parametrize("train", [["--train-iters", "40", "--lr-decay-iters", "33"],
                                   ["--train-samples", "160", "--lr-decay-samples", "150"]])
def test_warmup_fraction_is_megatrons_unrounded_fraction(train):
    """--lr-warmup-fraction 0.1 of 33 iterations is 3.3 iterations (26.4 samples at 8 a step) in Megatron."""
    from omnitron.core.training.arguments import parse_settings

    argv = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "8", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
            "--lr", "1e-3", "--lr-decay-style", "linear", "--lr-warmup-fraction", "0.1", *train]
    s = parse_settings(argv, 1)
    samples = train[0] == "--train-samples"
    decay = int(train[3]) * (1 if samples else 8)
    ref = MegatronScheduler(0.0, 1e-3, 0.0, 0.1 * decay, decay, "linear")
    ours = LRScheduler(s.optim, s.training.train_iters, s.training.train_samples, s.training.global_batch_size)
    _compare(ours, ref, [8] * 20)
