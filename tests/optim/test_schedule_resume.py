"""Resuming a learning-rate schedule whose command line changed, as Megatron's ``OptimizerParamScheduler``:
a difference in --lr, --min-lr, the warm-up, the decay length or style stops the load naming each value, unless
``--override-opt_param-scheduler`` (the command line's schedule) or ``--use-checkpoint-opt_param-scheduler`` (the
checkpoint's) says which stands. The progress is always the checkpoint's.

Reference: the transcription of Megatron's scheduler in test_megatron_schedule (``MegatronScheduler``), built
with the values that should stand and stepped to the checkpoint's progress.
"""
from __future__ import annotations

import json
import os
import random

import pytest

from omnitron.backends import get_backend
from omnitron.core.config.parallel import ConfigError
from omnitron.core.config.training import OptimizerConfig
from omnitron.core.optim.schedules import LRScheduler
from omnitron.core.training.arguments import parse_settings
from omnitron.core.training.loop import train
from tests.optim.test_megatron_schedule import MegatronScheduler


def _schedule(lr, min_lr, iters, style="cosine", warmup=3):
    return LRScheduler(OptimizerConfig(lr=lr, min_lr=min_lr, lr_decay_style=style, lr_warmup_iters=warmup), iters)


def _megatron(lr, min_lr, iters, done, style="cosine", warmup=3):
    """Megatron's rate after ``done`` steps of a run counted in iterations (global batch 1)."""
    ref = MegatronScheduler(0.0, lr, min_lr, warmup, iters, style)
    ref.step(done)
    return ref.lr


def _saved(rng):
    """A checkpoint's schedule after some steps, and its settings."""
    lr, iters, done = rng.uniform(1e-4, 1e-2), rng.randrange(20, 60), rng.randrange(5, 15)
    old = _schedule(lr, lr / 10, iters)
    for _ in range(done):
        old.advance(1)
    return old.state_dict(), (lr, lr / 10, iters), done


def test_unchanged_schedule_resumes_its_progress_silently():
    rng = random.Random()
    state, (lr, min_lr, iters), done = _saved(rng)
    new = _schedule(lr, min_lr, iters)
    assert new.load_state_dict(state) == [] and new.samples == done
    # both: the same few float64 operations on the same numbers
    assert new.lr_for_step(done, 1) == pytest.approx(_megatron(lr, min_lr, iters, done), rel=1e-13)


def test_a_changed_rate_or_length_stops_the_load_naming_each_value():
    rng = random.Random()
    state, (lr, min_lr, iters), _ = _saved(rng)
    new = _schedule(2 * lr, min_lr, iters + 10)
    with pytest.raises(ConfigError, match=r"--lr: .* in the checkpoint, .* now; the decay length .*"
                                          r"--override-opt_param-scheduler .* --use-checkpoint-opt_param-scheduler"):
        new.load_state_dict(state)
    with pytest.raises(ConfigError, match="--lr-decay-style: 'cosine' in the checkpoint, 'linear' now"):
        _schedule(lr, min_lr, iters, style="linear").load_state_dict(state)


@pytest.mark.parametrize("keep", ["command line", "checkpoint"])
def test_the_flag_chooses_which_schedule_stands(keep):
    rng = random.Random()
    state, (lr, min_lr, iters), done = _saved(rng)
    now = (rng.uniform(1e-4, 1e-2), rng.uniform(1e-6, 1e-5), iters + rng.randrange(1, 40))
    new = _schedule(*now)
    said = new.load_state_dict(state, keep)
    assert len(said) == 1 and f"the {keep}'s values stand" in said[0] and "--min-lr" in said[0]
    stands = now if keep == "command line" else (lr, min_lr, iters)
    for k in range(3):  # the next steps too: the progress is the checkpoint's (same float64 ops: a few ulp)
        assert new.lr_for_step(done + k, 1) == pytest.approx(_megatron(*stands, done + k), rel=1e-13)
        new.advance(1)


@pytest.mark.parametrize("keep", [None, "command line", "checkpoint"])
def test_a_changed_global_batch_size_is_a_changed_schedule(keep):
    """Megatron counts an iteration run in samples (warm-up and decay x --global-batch-size, progress the samples
    consumed): resuming under another batch size changes its warm-up and decay steps, so the load stops unless a
    flag says whose stand; then the progress is the checkpoint's samples over the batch size that stands."""
    rng = random.Random()
    old_gbs, new_gbs, warmup, decay = rng.choice([2, 4]), rng.choice([6, 8]), 3, rng.randrange(20, 40)
    cfg = OptimizerConfig(lr=1e-3, min_lr=1e-5, lr_decay_style="cosine", lr_warmup_iters=warmup, lr_decay_iters=decay)
    old = LRScheduler(cfg, decay, None, old_gbs)
    done = rng.randrange(2, 10)
    for _ in range(done):
        old.advance(old_gbs)
    new = LRScheduler(cfg, decay, None, new_gbs)
    if keep is None:
        with pytest.raises(ConfigError, match=f"--global-batch-size .*: {old_gbs} in the checkpoint, {new_gbs} now"):
            new.load_state_dict(old.state_dict())
        return
    new.load_state_dict(old.state_dict(), keep)
    stands = new_gbs if keep == "command line" else old_gbs
    ref = MegatronScheduler(0.0, 1e-3, 1e-5, warmup * stands, decay * stands, "cosine")
    ref.step(done * old_gbs)
    for k in range(4):  # the same few float64 operations on the same numbers: a few ulp
        assert new.lr_for_step(done + k, new_gbs) == pytest.approx(ref.lr, rel=1e-13)
        new.advance(new_gbs)
        ref.step(new_gbs)


def _args(tmp_path, *extra):
    return ["--model", "gpt2_tiny", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
            "--global-batch-size", "1", "--mock-data", "--vocab-size", "64", "--lr-decay-style", "linear",
            "--log-dir", str(tmp_path / "logs"), "--log-interval", "1", *extra]


def test_resumed_run_refuses_then_takes_the_command_lines_schedule(tmp_path):
    """End to end: a run extended with another --lr stops at the load; with --override-opt_param-scheduler its
    steps apply the new schedule from the checkpoint's progress (Megatron's rate, from the records)."""
    save, be = str(tmp_path / "ck"), get_backend("cpu")
    lr = random.uniform(1e-4, 1e-3)
    train(parse_settings(_args(tmp_path, "--train-iters", "4", "--lr", str(lr), "--min-lr", "0", "--save", save), 1),
          be)
    again = _args(tmp_path, "--train-iters", "8", "--lr", str(3 * lr), "--min-lr", "0", "--load", save)
    with pytest.raises(ConfigError, match="--lr: .* in the checkpoint"):
        train(parse_settings(again, 1), be)
    train(parse_settings(again + ["--override-opt_param-scheduler"], 1), be)
    recs = [json.loads(line) for line in open(os.path.join(tmp_path, "logs", "metrics.jsonl"))]
    applied = {r["iteration"]: r["lr"] for r in recs if "lr" in r}
    # step it applies the rate after it - 1 steps: linear from 3 lr over 8, no warm-up. The engine's float64 value
    # goes through JSON's shortest round-trip repr (exact) and the reference repeats the same few float64
    # operations: equal to a few ulp; 1e-12 leaves room for operation order
    for it in range(5, 9):
        assert applied[it] == pytest.approx(_megatron(3 * lr, 0.0, 8, it - 1, style="linear", warmup=0), rel=1e-12)


def test_both_flags_contradict():
    with pytest.raises(ConfigError, match="contradict"):
        parse_settings(["--model", "gpt2_tiny", "--mock-data", "--override-opt_param-scheduler",
                        "--use-checkpoint-opt_param-scheduler"], 1)


def test_the_command_line_refuses_a_changed_schedule_before_any_rank_starts(tmp_path):
    """`omnitron train` checks a torch_dist checkpoint's schedule (its metadata holds it) before launch: exit 2 and
    one line on stderr, no rank started."""
    import subprocess
    import sys

    save = str(tmp_path / "ck")
    train(parse_settings(_args(tmp_path, "--train-iters", "2", "--save", save), 1), get_backend("cpu"))
    proc = subprocess.run([sys.executable, "-m", "omnitron", "train", *_args(tmp_path, "--train-iters", "5",
                           "--load", save)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "the decay length" in proc.stderr and "--override-opt_param-scheduler" in proc.stderr, proc.stderr
