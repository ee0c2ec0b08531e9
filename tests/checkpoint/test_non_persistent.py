"""Megatron's --non-persistent-save-interval with --non-persistent-ckpt-type global: a save every N iterations
(where no regular save falls) into --non-persistent-global-ckpt-dir (default <--save>/non_persistent), which keeps
only the newest; --load resumes it when it is at least as new as --load's latest (Megatron's
_load_base_checkpoint), bit-exact; otherwise --load's latest."""
from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from omnitron.core.config.parallel import ConfigError

ARGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--num-workers", "0", "--no-tensorboard",
        "--non-persistent-ckpt-type", "global", "--hidden-dropout", "0.1", "--lr", "1e-3", "--lr-decay-iters", "20"]


def _train(tmp_path, name, *extra):
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    s = parse_settings(ARGS + ["--log-dir", str(tmp_path / name), *extra], world_size=1)
    out = train(s, get_backend("cpu"))
    return out["losses"], [{k: v.clone() for k, v in m.state_dict().items()} for m in out["components"].modules]


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_resume_takes_the_newer_of_the_two(tmp_path, caplog, fmt):
    """Run A: regular saves at 4 and 7 (the end), non-persistent ones at 3 and 6 (only 6 kept). Resumed from A as
    it is (latest 7, non-persistent 6): iteration 7's checkpoint. As a kill during iteration 7 leaves it (latest 4,
    non-persistent 6): the non-persistent 6, and iteration 7 comes out bit-exact as in A (loss, every weight; with
    dropout, so the RNG streams resume too). Fails without the fix: the flags were refused."""
    ck = str(tmp_path / "ck")
    losses, weights = _train(tmp_path, "a", "--train-iters", "7", "--save", ck, "--save-interval", "4",
                             "--non-persistent-save-interval", "3", "--ckpt-format", fmt)
    assert sorted(os.listdir(os.path.join(ck, "non_persistent"))) == ["iter_0000006", "latest"]
    assert sorted(d for d in os.listdir(ck) if d.startswith("iter_")) == ["iter_0000004", "iter_0000007"]
    with caplog.at_level(logging.INFO, logger="omnitron.train"):
        later, _ = _train(tmp_path, "c", "--train-iters", "8", "--load", ck)
    assert sorted(later) == [8] and "non-persistent checkpoint" in caplog.text and "is older than" in caplog.text
    shutil.rmtree(os.path.join(ck, "iter_0000007"))
    with open(os.path.join(ck, "latest"), "w") as f:
        f.write("iter_0000004")
    resumed, resumed_weights = _train(tmp_path, "b", "--train-iters", "7", "--load", ck)
    assert resumed == {7: losses[7]}, (resumed, losses)
    for a, b in zip(weights, resumed_weights):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "weights differ after the resume"


def test_its_own_directory_and_the_refusals(tmp_path):
    from omnitron.core.training.arguments import parse_settings

    np_dir = str(tmp_path / "np")
    _train(tmp_path, "a", "--train-iters", "2", "--save", str(tmp_path / "ck"), "--non-persistent-save-interval",
           "1", "--non-persistent-global-ckpt-dir", np_dir)
    assert sorted(os.listdir(np_dir)) == ["iter_0000001", "latest"]
    assert not os.path.exists(tmp_path / "ck" / "non_persistent")
    base = ARGS[:-8] + ["--train-iters", "2"]
    for extra, message in (
            (["--non-persistent-ckpt-type", "local"], "implements only 'global'"),
            (["--non-persistent-ckpt-type", "in_memory"], "implements only 'global'"),
            (["--non-persistent-save-interval", "2", "--save", "x"], "needs --non-persistent-ckpt-type global"),
            (["--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "global"], "needs --save"),
            (["--non-persistent-save-interval", "0", "--non-persistent-ckpt-type", "global", "--save", "x"],
             "must be >= 1")):
        with pytest.raises(ConfigError, match=message):
            parse_settings(base + extra, world_size=1)
