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


def test_resume_reads_the_validation_stream_on_from_the_checkpoints_count(tmp_path):
    """Megatron saves consumed_valid_samples and a resumed run's validation loader starts there, whatever
    --eval-iters it now runs with. A (4 iterations, evaluations at 2 and 4 of one batch of 4) has read 8 samples.
    Resumed to 6 with --eval-iters 2, the evaluation at 6 must read batches 2 and 3: the mean of what the same
    resume with --eval-iters 1 reads at 6 and after training (batch 2, then batch 3, the same weights). The
    formula from the new flags (2 evaluations x 2 batches) would start at batch 4. Losses are exact: one process,
    the same computation on the same batches, and evaluate's mean of two is (a + b) / 2 as written here."""
    from omnitron.core.checkpoint import find_latest, read_metadata

    flags = ("--eval-interval", "2", "--hidden-dropout", "0", "--attention-dropout", "0", "--lr-decay-iters", "8")
    first = str(tmp_path / "first")
    _train(_args(str(tmp_path), *flags, "--train-iters", "4", "--save", first))
    assert read_metadata(find_latest(first))["consumed_valid_samples"] == 2 * 1 * 4
    one = _train(_args(str(tmp_path), *flags, "--train-iters", "6", "--load", first, "--save", str(tmp_path / "a")))
    two = _train(_args(str(tmp_path), *flags, "--train-iters", "6", "--load", first, "--save", str(tmp_path / "b"),
                       "--eval-iters", "2"))
    assert [v["iteration"] for v in one["validation"]] == [6, 6] == [v["iteration"] for v in two["validation"]]
    b2, b3 = (v["val_loss"] for v in one["validation"])
    assert b2 != b3 and two["validation"][0]["val_loss"] == (b2 + b3) / 2
    assert read_metadata(find_latest(str(tmp_path / "b")))["consumed_valid_samples"] == 8 + 2 * 4  # saved at 6


def test_checkpoint_without_the_count_falls_back_to_the_formula():
    """A checkpoint from before consumed_valid_samples was saved: the stream starts after the evaluations the
    run's flags put before its iteration (Megatron's fallback); a saved count wins; --skip-train starts at 0."""
    from types import SimpleNamespace

    from omnitron.core.training.loop import ValidationStream

    t = SimpleNamespace(eval_interval=3, eval_iters=2, eval_batch=4, skip_train=False, start_eval_at_iter=None)
    c = SimpleNamespace(settings=SimpleNamespace(training=t), iteration=7, consumed_valid_samples=None)
    assert ValidationStream(c).start == (7 // 3) * 2 * 4 == c.consumed_valid_samples
    c.consumed_valid_samples = 12
    assert ValidationStream(c).start == 12
    t.skip_train = True
    assert ValidationStream(c).start == 0


def test_resume_with_a_longer_interval_sizes_the_split_past_the_saved_count(tmp_path):
    """Evaluations at 1..4 read 4 batches (16 samples); resumed with --eval-interval 4 to iteration 8 the new
    flags' formula sizes the split at (8 // 4 + 1) batches = 12 samples, short of where the stream resumes:
    the split must be sized from the saved count (16 + 2 evaluations x 4) and both evaluations must run."""
    from omnitron.core.checkpoint import find_latest, read_metadata

    flags = ("--lr-decay-iters", "8", "--hidden-dropout", "0", "--attention-dropout", "0")
    first = str(tmp_path / "first")
    _train(_args(str(tmp_path), *flags, "--eval-interval", "1", "--train-iters", "4", "--save", first))
    assert read_metadata(find_latest(first))["consumed_valid_samples"] == 4 * 4
    run = _train(_args(str(tmp_path), *flags, "--eval-interval", "4", "--train-iters", "8", "--load", first))
    assert [v["iteration"] for v in run["validation"]] == [8, 8]
