"""--use-checkpoint-args takes the model and tokenizer from the checkpoint (overriding the command line, each
change logged) and resumes; --exit-on-missing-checkpoint stops when --load holds nothing."""
from __future__ import annotations

import logging

import pytest

from omnitron.backends import get_backend
from omnitron.core.checkpoint import CheckpointError
from omnitron.core.config.parallel import ConfigError
from omnitron.core.training.arguments import parse_settings
from omnitron.core.training.checkpointing import check_resume
from omnitron.core.training.loop import train


def _run(tmp_path, *shape):
    return ["--mock-data", "--tokenizer-type", "NullTokenizer", "--num-workers", "0", "--no-tensorboard",
            "--log-interval", "1", "--data-cache-path", str(tmp_path / "cache"), "--save", str(tmp_path / "ckpt"),
            *shape]


def test_checkpoint_args_override_the_command_line(tmp_path, caplog):
    first = parse_settings(_run(tmp_path, "--num-layers", "3", "--hidden-size", "48", "--num-attention-heads", "3",
                                "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "90",
                                "--position-embedding-type", "rope", "--swiglu", "--train-iters", "2"), 1)
    train(first, get_backend("cpu"))
    with caplog.at_level(logging.INFO, logger="omnitron.train"):
        again = parse_settings(_run(tmp_path, "--model", "gpt2_tiny", "--vocab-size", "500", "--train-iters", "3",
                                    "--hidden-dropout", "0.3", "--load", str(tmp_path / "ckpt"),
                                    "--use-checkpoint-args", "--use-checkpoint-opt_param-scheduler"), 1)
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "position_embedding_type",
                 "swiglu", "ffn_hidden_size"):
        assert getattr(again.model, name) == getattr(first.model, name), name
    assert again.data.vocab_size == 90 and again.model.hidden_dropout == 0.3  # a training choice stays
    assert "--use-checkpoint-args: model and tokenizer settings from" in caplog.text
    assert "--num-layers" in caplog.text and "--hidden-size" in caplog.text
    res = train(again, get_backend("cpu"))
    assert sorted(res["losses"]) == [3]  # resumed at iteration 2


def test_checkpoint_args_and_missing_checkpoints_are_clear(tmp_path):
    base = _run(tmp_path, "--model", "gpt2_tiny", "--load", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="--use-checkpoint-args: no checkpoint under --load"):
        parse_settings(base + ["--use-checkpoint-args"], 1)
    with pytest.raises(ConfigError, match="--use-checkpoint-args needs --load"):
        parse_settings(_run(tmp_path, "--model", "gpt2_tiny", "--use-checkpoint-args"), 1)
    with pytest.raises(CheckpointError, match="--exit-on-missing-checkpoint: no checkpoint under --load"):
        check_resume(parse_settings(base + ["--exit-on-missing-checkpoint"], 1))
    check_resume(parse_settings(base, 1))  # without the flag: a fresh start


def test_checkpoint_records_tokenizer_files_as_absolute_paths(tmp_path, monkeypatch):
    """A run given relative tokenizer paths records them absolute, so `omnitron generate --load` and the exports
    find them from any directory; a name that is no file here (a hub tokenizer) stays as given."""
    import os
    import shutil

    from omnitron.core.training.arguments import resolved_config

    src = os.path.join(os.path.dirname(__import__("omnitron").__file__), "data", "gpt2")
    monkeypatch.chdir(tmp_path)
    os.makedirs("tok")
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(os.path.join(src, name), os.path.join("tok", name))
    s = parse_settings(["--model", "gpt2_tiny", "--mock-data", "--tokenizer-type", "GPT2BPETokenizer",
                        "--vocab-file", "tok/vocab.json", "--merge-file", "tok/merges.txt"], 1)
    got = resolved_config(s)
    assert got["vocab_file"] == str(tmp_path / "tok" / "vocab.json")
    assert got["merge_file"] == str(tmp_path / "tok" / "merges.txt")
    hub = parse_settings(["--model", "gpt2_tiny", "--mock-data", "--tokenizer-type", "HuggingFaceTokenizer",
                          "--tokenizer-model", "no-such-org/no-such-tokenizer"], 1)
    assert resolved_config(hub)["tokenizer_model"] == "no-such-org/no-such-tokenizer"
