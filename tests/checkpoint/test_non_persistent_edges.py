"""The edges of --non-persistent-ckpt-type global: --use-checkpoint-args reads the checkpoint actually resumed;
a --non-persistent-global-ckpt-dir outside --save is locked like --save; the lock re-taken after a removal is
released at the run's end; --async-save's non-persistent saves never leave a half-written one to be loaded."""
from __future__ import annotations

import os

import pytest

from omnitron.core.config.parallel import ConfigError

ARGS = ["--num-layers", "2", "--num-attention-heads", "2", "--seq-length", "16", "--max-position-embeddings", "16",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--num-workers", "0", "--no-tensorboard", "--non-persistent-ckpt-type", "global",
        "--lr", "1e-3"]


def _settings(tmp_path, name, *extra):
    from omnitron.core.training.arguments import parse_settings

    return parse_settings(ARGS + ["--log-dir", str(tmp_path / name), *extra], world_size=1)


def _train(tmp_path, name, *extra):
    from omnitron.backends import get_backend
    from omnitron.core.training.loop import train

    return train(_settings(tmp_path, name, *extra), get_backend("cpu"))["losses"]


def test_use_checkpoint_args_reads_the_checkpoint_resumed(tmp_path):
    """--load ck holds a regular iteration-2 checkpoint of a hidden-32 model and, in ck/non_persistent, a
    non-persistent iteration-2 one of a hidden-64 model: the run resumes the latter (at least as new), so its args
    are the ones taken (Megatron's load_args_from_checkpoint goes through _load_base_checkpoint, which makes the
    same choice). --ckpt-step 2 asks for --load's own iteration 2 (the non-persistent one is not considered).
    Fails without the fix: hidden 32 was read from --load's latest while the hidden-64 checkpoint was loaded."""
    ck = str(tmp_path / "ck")
    _train(tmp_path, "a", "--hidden-size", "32", "--train-iters", "2", "--save", ck)
    _train(tmp_path, "b", "--hidden-size", "64", "--train-iters", "3", "--save", str(tmp_path / "other"),
           "--non-persistent-save-interval", "1", "--non-persistent-global-ckpt-dir", os.path.join(ck, "non_persistent"))
    assert sorted(os.listdir(os.path.join(ck, "non_persistent"))) == ["iter_0000002", "latest"]
    taken = _settings(tmp_path, "c", "--hidden-size", "48", "--train-iters", "3", "--load", ck, "--use-checkpoint-args")
    assert taken.model.hidden_size == 64
    asked = _settings(tmp_path, "d", "--hidden-size", "48", "--train-iters", "3", "--load", ck, "--use-checkpoint-args",
                      "--ckpt-step", "2")
    assert asked.model.hidden_size == 32
    assert _train(tmp_path, "e", "--hidden-size", "48", "--train-iters", "3", "--load", ck,
                  "--use-checkpoint-args").keys() == {3}  # the hidden-64 checkpoint loads into the model built
