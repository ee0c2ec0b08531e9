"""Megatron's evaluation flags: ``--skip-train`` evaluates a loaded model on the first --eval-iters batches of
the validation and test splits and saves nothing; ``--start-eval-at-iter`` starts the --eval-interval
evaluations there, and a run resumed after it reads the validation stream on where the uninterrupted run does;
``--eval-global-batch-size`` sets the evaluation batch.
The references are the training runs' own evaluations of the same weights on the same batches (one process,
so the equalities are exact: the same computation in the same order)."""
from __future__ import annotations

import os

import pytest


def _args(root: str, *extra: str) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            "128", "--num-workers", "0", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3",
            "--seed", "5", "--no-tensorboard", "--log-interval", "1", "--eval-iters", "1",
            "--data-cache-path", os.path.join(root, "cache"), *extra]


def _train(argv: list[str]) -> dict:
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    return train(parse_settings(argv, 1), get_backend("cpu"))


def test_skip_train_evaluates_the_loaded_model_from_the_splits_starts(tmp_path):
    """A 4-iteration run evaluates at iteration 4 (its stream's first batch) and then the test split's first
    batch, with iteration 4's weights; --skip-train from its checkpoint must give both losses exactly, train
    nothing and write no checkpoint."""
    save = str(tmp_path / "run")
    run = _train(_args(str(tmp_path), "--train-iters", "4", "--eval-interval", "4", "--save", save))
    assert [v["iteration"] for v in run["validation"]] == [4, 4]
    latest = open(os.path.join(save, "latest")).read()
    again = _train(_args(str(tmp_path), "--train-iters", "4", "--skip-train", "--load", save, "--save", save))
    assert again["losses"] == {} and again["iteration"] == 4
    assert [v["val_loss"] for v in again["validation"]] == [run["validation"][0]["val_loss"]]
    assert again["test"]["test_loss"] == run["test"]["test_loss"]
    assert open(os.path.join(save, "latest")).read() == latest
    assert run["validation"][0]["val_loss"] != run["validation"][1]["val_loss"]  # other batches: other losses


def test_start_eval_at_iter_and_a_resume_after_it(tmp_path):
    """--eval-interval 2 --start-eval-at-iter 4 over 8 iterations evaluates at 4, 6, 8 and after training; a run
    stopped at 5 and resumed must evaluate at 6, 8 and after training on the uninterrupted run's batches (one
    evaluation read before the stop: Megatron's formula, 5 // 2 - 4 // 2 = 0, would read it again)."""
    flags = ("--train-iters", "8", "--eval-interval", "2", "--start-eval-at-iter", "4", "--hidden-dropout", "0",
             "--attention-dropout", "0")
    full = _train(_args(str(tmp_path), *flags, "--save", str(tmp_path / "full")))
    assert [v["iteration"] for v in full["validation"]] == [4, 6, 8, 8]
    part = str(tmp_path / "part")
    first = _train(_args(str(tmp_path), *flags, "--save", part, "--exit-interval", "5"))
    second = _train(_args(str(tmp_path), *flags, "--save", part, "--load", part))
    pieces = first["validation"] + second["validation"]
    assert [v["iteration"] for v in pieces] == [4, 6, 8, 8]
    assert [v["val_loss"] for v in pieces] == [v["val_loss"] for v in full["validation"]]
    assert len({v["val_loss"] for v in full["validation"]}) == 4


def test_eval_global_batch_size_reads_the_same_samples_in_smaller_batches(tmp_path):
    """--eval-global-batch-size 4 --eval-iters 2 reads each evaluation's 8 validation samples (and the test
    split's) in two batches of the same micro-batches that one batch of 8 reads; the training is unchanged, so
    every evaluation's loss is the mean of the same four micro-batch losses. Bound: the float32 micro-batch
    means are summed and halved in float64, where (a + b + c + d) / 4 and ((a + b) / 2 + (c + d) / 2) / 2 of
    float32 values near 5 are both exact but for the last rounding: 1e-15 relative."""
    flags = ("--train-iters", "4", "--eval-interval", "2", "--global-batch-size", "8")
    one = _train(_args(str(tmp_path / "one"), *flags))
    two = _train(_args(str(tmp_path / "two"), *flags, "--eval-global-batch-size", "4", "--eval-iters", "2"))
    assert two["losses"] == one["losses"]
    pairs = [(a["val_loss"], b["val_loss"]) for a, b in zip(one["validation"], two["validation"], strict=True)]
    pairs.append((one["test"]["test_loss"], two["test"]["test_loss"]))
    assert len(pairs) == 4 and len({a for a, _ in pairs}) == 4
    for a, b in pairs:
        assert abs(a - b) <= 1e-15 * abs(a), pairs


@pytest.mark.parametrize("extra,needle", [
    (["--skip-train", "--eval-iters", "0"], "--skip-train with --eval-iters 0 evaluates nothing"),
    (["--start-eval-at-iter", "-1"], "--start-eval-at-iter -1: give an iteration >= 0"),
    (["--eval-global-batch-size", "6", "--micro-batch-size", "4"], "--eval-global-batch-size 6 is not a multiple of"),
    (["--eval-global-batch-size", "0"], "--eval-global-batch-size must be >= 1, got 0"),
])
def test_bad_evaluation_flags_are_one_line(extra, needle, tmp_path):
    from omnitron.core.config.parallel import ConfigError
    from omnitron.core.training.arguments import parse_settings

    with pytest.raises(ConfigError, match=needle):
        parse_settings(_args(str(tmp_path), "--train-iters", "2", *extra), 1)
