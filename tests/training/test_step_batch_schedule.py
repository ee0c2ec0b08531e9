"""Megatron's --step-batch-size-schedule: the batch size of each step against a transcription of Megatron's own
calculator, the iteration count of a --train-samples run, the learning rate of an iteration-counted run, and a
short training run reading the samples each step should read."""
from __future__ import annotations

import random

import pytest

from omnitron.backends import get_backend
from omnitron.core.config.parallel import ConfigError
from omnitron.core.config.training import OptimizerConfig
from omnitron.core.optim import LRScheduler
from omnitron.core.training.arguments import parse_settings
from omnitron.core.training.batches import BatchRamp, parse_step_schedule


def megatron_schedule(schedule_str: str, seq_length: int) -> list[tuple[int, int]]:
    """Transcribed from Megatron-LM d98e8a6, megatron/core/num_microbatches_calculator.py,
    StepBatchsizeNumMicroBatchesCalculator._parse_numeric_value and _parse_schedule."""
    def parse(value_str):
        value_str = value_str.strip().upper()
        multiplier = 1
        for suffix, m in (("T", 1_000_000_000_000), ("B", 1_000_000_000), ("M", 1_000_000), ("K", 1_000)):
            if value_str.endswith(suffix):
                multiplier, value_str = m, value_str[:-1]
                break
        return int(float(value_str) * multiplier)

    schedule = []
    for entry in schedule_str.strip().replace(",", " ").split():
        threshold_str, batch_size_str = entry.split(":", 1)
        schedule.append((parse(threshold_str) // seq_length, parse(batch_size_str)))
    schedule.sort(key=lambda x: x[0])
    return schedule


def megatron_batch(schedule: list[tuple[int, int]], consumed_samples: int) -> int:
    """_get_batch_size_for_samples, transcribed."""
    batch_size = schedule[0][1]
    for threshold, bs in schedule:
        if consumed_samples >= threshold:
            batch_size = bs
        else:
            break
    return batch_size


def megatron_train_iters(schedule, train_samples: int) -> int:
    """megatron/training/training.py update_train_iters with a step schedule, transcribed."""
    iterations = consumed_samples = 0
    while consumed_samples < train_samples:
        consumed_samples += megatron_batch(schedule, consumed_samples)
        iterations += 1
    return iterations


GPT3_175B = "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"  # examples/gpt3/train_gpt3_175b_distributed.sh


def _random_schedule(rng: random.Random, per_step: int) -> str:
    tokens, parts = 0, []
    for _ in range(rng.randint(1, 5)):
        parts.append(f"{tokens}:{per_step * rng.randint(1, 12)}")
        tokens += rng.randint(1, 4000)
    rng.shuffle(parts)
    return ",".join(parts) if rng.random() < 0.5 else " ".join(parts)


def test_batch_per_step_is_megatrons():
    rng = random.Random()
    for _ in range(40):
        per_step, seq = rng.choice([1, 2, 4]), rng.choice([1, 8, 16, 33])
        text = _random_schedule(rng, per_step)
        ref = megatron_schedule(text, seq)
        if ref[0][0] != 0 or any(b[0] <= a[0] for a, b in zip(ref, ref[1:])):
            # two thresholds can fall in the same sample at this --seq-length: Megatron's _validate_schedule
            # asserts strict increase, and so must the parser (it was called before this check until a CI run
            # drew '0:48,4949:44,4931:28,2127:36' at seq 33: 4949 // 33 == 4931 // 33)
            with pytest.raises(ConfigError, match="--step-batch-size-schedule"):
                parse_step_schedule(text, seq)
            continue
        steps = parse_step_schedule(text, seq)
        ramp = BatchRamp(ref[-1][1], per_step, steps=steps)
        consumed = 0
        for _ in range(300):
            assert ramp.global_batch(consumed) == megatron_batch(ref, consumed), (text, seq, consumed)
            consumed += ramp.global_batch(consumed)
        n = rng.randint(1, 5000)
        assert ramp.iterations(n) == megatron_train_iters(ref, n)
    # the GPT-3 175B script's schedule at --seq-length 2048: 2.4B tokens = 1171875 samples
    ref = megatron_schedule(GPT3_175B, 2048)
    ramp = BatchRamp(1536, 16, steps=parse_step_schedule(GPT3_175B, 2048))
    for consumed in (0, 1171874, 1171875, 2343750, 5859374, 5859375, 10 ** 8):
        assert ramp.global_batch(consumed) == megatron_batch(ref, consumed)
    assert ramp.sizes() == [1, 20, 39, 58, 77, 96]


BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
        "--num-workers", "0", "--micro-batch-size", "2", "--log-interval", "1", "--no-tensorboard",
        "--hidden-dropout", "0", "--attention-dropout", "0"]


def test_flag_checks():
    s = parse_settings(BASE + ["--train-iters", "5", "--step-batch-size-schedule", "0:2 64:6",
                               "--global-batch-size", "6"], 1)
    assert s.training.global_batch_size == 6  # the 175B script gives the schedule's last size too: accepted
    for extra, match in ((["--global-batch-size", "4"], "the schedule ends at 6"),
                         (["--rampup-batch-size", "2", "2", "8"], "not both"),
                         (["--micro-batch-size", "4"], "not a multiple of --micro-batch-size"),
                         (["--step-batch-size-schedule", "16:2"], "first threshold must be 0")):
        args = BASE + ["--train-samples", "40", "--step-batch-size-schedule", "0:2 64:6", *extra]
        with pytest.raises(ConfigError, match=match):
            parse_settings(args, 1)


def test_iteration_run_learning_rate_counts_samples():
    """Megatron's scheduler in an iteration run steps by the batch's samples against iterations x
    --global-batch-size (optimizer_param_scheduler.step(increment=get_current_global_batch_size()))."""
    gbs, warm, decay, lr, min_lr = 8, 3, 20, 1.0, 0.1
    ramp = BatchRamp(gbs, 2, steps=((0, 2), (10, 4), (30, 8)))
    sched = LRScheduler(OptimizerConfig(lr=lr, min_lr=min_lr, lr_decay_style="linear", lr_warmup_iters=warm,
                                        lr_decay_iters=decay), 25, None, gbs, varying_batch=True)
    consumed = 0
    for step in range(25):
        b = ramp.global_batch(consumed)
        num_steps, warmup_steps, decay_steps = consumed, warm * gbs, decay * gbs  # Megatron's sample units
        if num_steps <= warmup_steps:
            want = lr * num_steps / warmup_steps
        else:
            want = min_lr + (lr - min_lr) * (1 - min(num_steps - warmup_steps, decay_steps - warmup_steps)
                                             / (decay_steps - warmup_steps))
        # float64 on both sides, the same ratios in another order: a few ulp apart
        assert sched.lr_for_step(step, b) == pytest.approx(want, rel=1e-12)
        sched.advance(b)
        consumed += b


def test_step_schedule_run_batches(tmp_path):
    """``0:2 64:4`` at --seq-length 16: 2 sequences per step until 64 tokens (4 samples) are consumed, then 4."""
    import json

    from omnitron.core.training.loop import train

    args = BASE + ["--data-cache-path", str(tmp_path / "cache"), "--log-dir", str(tmp_path / "logs"), "--lr", "0",
                   "--train-samples", "14", "--step-batch-size-schedule", "0:2 64:4"]
    settings = parse_settings(args, 1)
    sizes = [2, 2, 4, 4, 4]  # after 0, 2 samples: 2; after 4 (= 64 tokens // 16): 4; 14 samples reached after 16
    assert settings.training.train_iters == len(sizes)
    train(settings, get_backend("cpu"))
    recs = [json.loads(line) for line in open(tmp_path / "logs" / "metrics.jsonl")]
    assert [r["global_batch_size"] for r in recs] == sizes


def test_gpt3_175b_training_args_parse():
    """examples/gpt3/train_gpt3_175b_distributed.sh's TRAINING_ARGS (Megatron-LM d98e8a6), model sizes scaled
    down: the schedule and its matching --global-batch-size are accepted, every step's batch is Megatron's."""
    training = ["--micro-batch-size", "1", "--global-batch-size", "1536", "--step-batch-size-schedule", GPT3_175B,
                "--train-iters", "500000", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
                "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style",
                "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000"]
    model = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "2048",
             "--max-position-embeddings", "2048", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
             "100"]
    s = parse_settings(model + training, 1)
    assert s.training.global_batch_size == 1536 and s.training.step_batch_size_schedule == GPT3_175B
    from omnitron.core.training.arguments import batch_ramp

    ramp, ref = batch_ramp(s.training, 1, 2048), megatron_schedule(GPT3_175B, 2048)
    for consumed in (0, 1171874, 1171875, 4687499, 4687500, 5859375):
        assert ramp.global_batch(consumed) == megatron_batch(ref, consumed)
