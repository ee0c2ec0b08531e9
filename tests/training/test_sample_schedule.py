"""Sample-based runs: --train-samples, --lr-*-samples and --rampup-batch-size (Megatron's meanings).

The batch sizes of a ramp are checked against values worked out by hand from Megatron's definition; the
learning rate of a sample-counted schedule against the same formula in float64 on the cumulative samples;
and a training run with a ramp against a one-process float64 evaluation of the very samples each step
should have read (at --lr 0 the weights stay put, so each step's loss names the samples it consumed).
"""
from __future__ import annotations

import copy
import datetime
import itertools
import json
import math
import random
import re

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.core.config.parallel import ConfigError
from omnitron.core.config.training import OptimizerConfig
from omnitron.core.models.family import family_of
from omnitron.core.optim import LRScheduler
from omnitron.core.training.arguments import parse_settings
from omnitron.core.training.batches import BatchRamp
from omnitron.core.training.loop import train
from omnitron.testing.megatron_log import extra_fields, parse_training_line


def _walk(ramp: BatchRamp, steps: int) -> list[int]:
    sizes, consumed = [], 0
    for _ in range(steps):
        sizes.append(ramp.global_batch(consumed))
        consumed += sizes[-1]
    return sizes


def test_ramp_sizes_by_hand():
    # start 4, +4 up to 16 over 210 samples: 3 increments, one per 70 samples. Steps start after 0, 4, ..., 68
    # samples (18 steps of 4), then 72, 80, ..., 136 (9 steps of 8: 136 < 140), then 144, ..., 204 (6 of 12:
    # 204 < 210), then 216 > 210: 16 from there on.
    ramp = BatchRamp(16, 2, (4, 4, 210))
    assert _walk(ramp, 35) == [4] * 18 + [8] * 9 + [12] * 6 + [16] * 2
    assert ramp.sizes() == [2, 4, 6, 8]
    # the iteration count as Megatron derives it: the 33 ramp steps consume 216 samples, then (1000 - 216) // 16
    assert ramp.iterations(1000) == 33 + 49
    assert BatchRamp(16, 2).iterations(1000) == 62 and _walk(BatchRamp(16, 2), 3) == [16] * 3


@pytest.mark.parametrize("per_step,ramp,why", [(4, (2, 2, 100), "multiples"), (2, (4, 5, 100), "whole number"),
                                               (2, (20, 4, 100), "whole number"), (2, (0, 4, 100), ">= 1")])
def test_ramp_refusals(per_step, ramp, why):
    with pytest.raises(ConfigError, match=why):
        BatchRamp(16, per_step, ramp)


def test_sample_schedule_equals_iteration_schedule_at_constant_batch():
    """Warmup and decay given in samples as iterations x batch: the same rate at every step, exactly."""
    gbs = 24
    for style in ("cosine", "linear", "WSD"):
        it = LRScheduler(OptimizerConfig(lr=1.0, min_lr=0.1, lr_decay_style=style, lr_warmup_iters=7,
                                         lr_decay_iters=50, lr_wsd_decay_iters=9), 60)
        sa = LRScheduler(OptimizerConfig(lr=1.0, min_lr=0.1, lr_decay_style=style, lr_warmup_samples=7 * gbs,
                                         lr_decay_samples=50 * gbs, lr_wsd_decay_samples=9 * gbs), 60, 60 * gbs)
        rates = []
        for step in range(60):
            rates.append(sa.lr_for_step(step, gbs))
            sa.advance(gbs)
        assert rates == [it.lr_for_step(step, gbs) for step in range(60)]


def test_sample_schedule_follows_the_ramp():
    """Cosine over samples with warmup from --lr-warmup-init, along a ramp, against the float64 formula."""
    ramp, lr, min_lr, init, warm, decay = BatchRamp(16, 2, (4, 4, 210)), 3e-3, 3e-5, 1e-4, 40, 600
    sched = LRScheduler(OptimizerConfig(lr=lr, min_lr=min_lr, lr_warmup_samples=warm, lr_decay_samples=decay,
                                        lr_warmup_init=init, lr_decay_style="cosine"), 80, 1000)
    consumed = 0
    for step in range(80):
        b = ramp.global_batch(consumed)
        p = consumed  # Megatron: the rate of a step is lr(samples consumed before it)
        if p <= warm:
            want = init + (lr - init) * p / warm
        else:
            want = min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * min(p - warm, decay - warm) / (decay - warm)))
        # both sides are float64 evaluations of the same expression in other orders: a few ulp (~1e-16) apart
        assert sched.lr_for_step(step, b) == pytest.approx(want, rel=1e-12)
        sched.advance(b)
        consumed = p + b


def test_schedule_unit_refusals():
    base = ["--model", "gpt2_tiny", "--mock-data"]
    for extra, match in ((["--train-samples", "64", "--train-iters", "3"], "not both"),
                         (["--train-samples", "64", "--lr-warmup-iters", "3"], "--lr-warmup-samples"),
                         (["--lr-decay-samples", "64"], "--lr-decay-iters"),
                         (["--rampup-batch-size", "1", "1", "8"], "--train-samples"),
                         (["--train-samples", "3", "--global-batch-size", "4"], "less than one global batch")):
        with pytest.raises(ConfigError, match=match):
            parse_settings(base + extra, 1)


def _reference_loss(model, dataset, start: int, count: int) -> float:
    """Mean token loss of ``count`` samples from ``start`` in float64, one sample at a time."""
    fam, total, tokens = family_of(model.config), 0.0, 0
    with torch.no_grad():
        for i in range(start, start + count):
            batch = {k: torch.as_tensor(v).unsqueeze(0) for k, v in dataset[i].items()}
            loss_sum, n = fam.loss_fn(fam.forward_step(model, model, batch, None), batch)
            total, tokens = total + float(loss_sum), tokens + int(n)
    return total / tokens


def test_rampup_run_reads_consecutive_samples(tmp_path, capsys):
    """A ramp 2 -> 6 by 2 over 10 samples (one increment per 5): step i reads the samples after those of the
    steps before it."""
    args = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
            "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            "100", "--num-workers", "0", "--micro-batch-size", "2", "--global-batch-size", "6", "--log-interval", "1",
            "--no-tensorboard", "--data-cache-path", str(tmp_path / "cache"), "--log-dir", str(tmp_path / "logs"),
            "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "0", "--train-samples", "30",
            "--rampup-batch-size", "2", "2", "10"]
    settings = parse_settings(args, 1)
    # after 0, 2, 4 samples (< 5): 2; after 6: 4; after 10 (not yet past 10, but 2 increments due): 6; the ramp
    # ends at 16 samples; then (30 - 16) // 6 = 2 more steps
    sizes = [2, 2, 2, 4, 6, 6, 6]
    assert settings.training.train_iters == len(sizes)
    res = train(settings, get_backend("cpu"))
    c = res["components"]
    model = copy.deepcopy(c.modules[0]).double()
    consumed = 0
    for step, size in enumerate(sizes, start=1):
        # NOTE: the run is fp32 against this float64 reference: a relative error of a few 1e-7 per logit; the
        # mean losses of two different sets of samples differ by ~1e-2 here, so 1e-4 tells them apart
        assert res["losses"][step] == pytest.approx(_reference_loss(model, c.train_data, consumed, size), abs=1e-4)
        consumed += size
    assert c.consumed_samples == consumed
    # the records and lines say the batch, the data position and the time
    recs = [json.loads(line) for line in open(tmp_path / "logs" / "metrics.jsonl")]
    assert [r["global_batch_size"] for r in recs] == sizes
    assert [r["consumed_samples"] for r in recs] == list(itertools.accumulate(sizes))
    stamps = [datetime.datetime.fromisoformat(r["time"]) for r in recs]
    assert all(s.tzinfo is not None for s in stamps) and stamps == sorted(stamps)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if parse_training_line(ln)]
    assert len(lines) == len(sizes)
    assert [parse_training_line(ln)["global_batch_size"] for ln in lines] == sizes
    stamp = r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\]"  # Megatron's, to the microsecond
    assert re.match(stamp + r" iteration +7/ +7 \| consumed samples: +28 \|", lines[-1])
    assert all(re.fullmatch(r"\d+:\d\d:\d\d", extra_fields(ln)["ETA"]) for ln in lines)


def test_rampup_resume_is_bit_exact(tmp_path):
    """Stopped mid-ramp by --exit-interval and resumed: the batch sizes, the sample-counted learning rate and
    so the losses continue exactly as in the run that never stopped."""
    def args(save, *extra):
        return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
                "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                "100", "--num-workers", "0", "--micro-batch-size", "2", "--global-batch-size", "6", "--log-interval",
                "1", "--no-tensorboard", "--data-cache-path", str(tmp_path / "cache"), "--lr", "3e-3",
                "--lr-warmup-samples", "8", "--train-samples", "30", "--rampup-batch-size", "2", "2", "10",
                "--save", str(tmp_path / save), *extra]

    be = get_backend("cpu")
    whole = train(parse_settings(args("whole"), 1), be)["losses"]
    first = train(parse_settings(args("parts", "--exit-interval", "4"), 1), be)["losses"]
    rest = train(parse_settings(args("parts", "--load", str(tmp_path / "parts")), 1), be)
    assert sorted(first) == [1, 2, 3, 4] and sorted(rest["losses"]) == [5, 6, 7]
    assert {**first, **rest["losses"]} == whole
    assert rest["components"].scheduler.samples == 28


def megatron_train_iters(gbs: int, rampup: tuple[int, int, int], train_samples: int) -> tuple[int, bool]:
    """Megatron-LM d98e8a6 ``update_train_iters`` (megatron/training/training.py) with its
    ``RampupBatchsizeNumMicroBatchesCalculator`` (megatron/core/num_microbatches_calculator.py), transcribed: the
    ramp phase steps while consumed <= SAMPLES and <= train_samples, each at ``start + int(consumed /
    per_increment) * increment`` (``gbs`` past SAMPLES), then whole global batches of the rest. Also returns whether
    the ramp phase's consumed count landed exactly on SAMPLES."""
    start, inc, samples = rampup
    per_increment = samples / ((gbs - start) // inc)
    iterations = consumed = 0
    exact = False
    while consumed <= samples and consumed <= train_samples:
        exact = exact or consumed == samples
        consumed += gbs if consumed > samples else start + int(consumed / per_increment) * inc
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // gbs
    return iterations, exact


def test_ramp_iterations_as_megatron_counts_them():
    """Random ramps and --train-samples (small numbers, so the ramp's count often lands exactly on SAMPLES, the
    edge where Megatron still takes a ramp step): BatchRamp.iterations equals Megatron's count."""
    rng = random.Random()
    edges = 0
    for _ in range(400):
        per_step = rng.choice([1, 2, 4])
        start, inc = per_step * rng.randint(1, 4), per_step * rng.randint(1, 3)
        gbs = start + inc * rng.randint(1, 4)
        rampup = (start, inc, rng.randint(inc, 60))
        train_samples = rng.randint(1, 160)
        want, exact = megatron_train_iters(gbs, rampup, train_samples)
        edges += exact
        assert BatchRamp(gbs, per_step, rampup).iterations(train_samples) == want, (gbs, rampup, train_samples)
    assert edges > 5
