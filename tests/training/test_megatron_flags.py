"""A Megatron launch script's flags: aliases give the same settings as omnitron's own spelling,
implementation selectors are accepted with a line saying what runs, contradictions and typos are one
line naming the fix, and abbreviations are refused (as Megatron refuses them)."""
from __future__ import annotations

import dataclasses
import logging

import pytest

from omnitron.core.config.parallel import ConfigError
from omnitron.core.training.arguments import parse_settings

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "40", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]


def _same(a, b) -> None:
    for name in ("model", "training", "optim", "logging", "parallel"):
        assert dataclasses.asdict(getattr(a, name)) == dataclasses.asdict(getattr(b, name)), name


def test_aliases_equal_omnitron_spelling(tmp_path):
    mega = parse_settings(BASE + ["--group-query-attention", "--num-query-groups", "2",
                                  "--use-rotary-position-embeddings", "--recompute-activations",
                                  "--tensorboard-dir", str(tmp_path / "tb"), "--lr-warmup-fraction", "0.25"], 1)
    own = parse_settings(BASE + ["--num-query-groups", "2", "--position-embedding-type", "rope",
                                 "--recompute-granularity", "selective", "--log-dir", str(tmp_path / "tb"),
                                 "--lr-warmup-iters", "10"], 1)
    _same(mega, own)
    # Megatron's rule: warm-up = fraction x the decay iterations when they are given
    frac = parse_settings(BASE + ["--lr-decay-iters", "30", "--lr-warmup-fraction", "0.5"], 1)
    assert frac.optim.lr_warmup_iters == 15


def test_config_file_takes_the_same_keys(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("use-rotary-position-embeddings: true\nuse_flash_attn: true\nlr-warmup-fraction: 0.5\n")
    s = parse_settings(BASE + ["--config", str(cfg)], 1)
    assert s.model.position_embedding_type == "rope" and s.optim.lr_warmup_iters == 20


def test_selectors_are_accepted_with_what_runs(caplog):
    with caplog.at_level(logging.INFO, logger="omnitron.train"):
        s = parse_settings(BASE + ["--use-flash-attn", "--transformer-impl", "transformer_engine", "--use-mcore-models",
                                   "--no-masked-softmax-fusion", "--attention-softmax-in-fp32",
                                   "--attention-backend", "auto"], 1)
    _same(s, parse_settings(BASE, 1))  # nothing changes
    said = caplog.text
    for flag in ("--use-flash-attn", "--transformer-impl", "--use-mcore-models", "--no-masked-softmax-fusion",
                 "--attention-softmax-in-fp32", "--attention-backend"):
        assert f"{flag}: accepted; " in said, flag


@pytest.mark.parametrize("extra, message", [
    (["--group-query-attention"], "--group-query-attention needs --num-query-groups N"),
    (["--use-rotary-position-embeddings", "--position-embedding-type", "learned_absolute"],
     "means --position-embedding-type rope, but --position-embedding-type learned_absolute was given"),
    (["--lr-warmup-fraction", "1.5"], r"--lr-warmup-fraction must lie in \[0, 1\]"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3"], "not both"),
])
def test_contradictions_name_the_fix(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_settings(BASE + extra, 1)


def test_typos_and_abbreviations_are_refused_with_suggestions(capsys):
    from omnitron.cli import main

    for bad, hint in ((["--tensor-parallel-size", "2"], "--tensor-parallel-size (did you mean "
                                                         "--tensor-model-parallel-size"),
                      (["--micro-batch", "2"], "--micro-batch (did you mean --micro-batch-size?)")):
        with pytest.raises(SystemExit) as info:
            main(["train", *bad])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "omnitron train: error: unrecognized arguments: " + hint in err, err
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    from omnitron import __version__

    assert capsys.readouterr().out.strip() == f"omnitron {__version__}"


def test_exit_signal_handler_is_the_default_handler():
    assert parse_settings(BASE + ["--exit-signal-handler"], 1).checkpoint.save_on_signal
    with pytest.raises(ConfigError, match="--exit-signal-handler means --save-on-signal True"):
        parse_settings(BASE + ["--exit-signal-handler", "--no-save-on-signal"], 1)


def test_exit_duration_stops_saves_and_says_so(tmp_path, caplog):
    """--exit-duration-in-mins: the first iteration past the limit saves and ends the run (here: the first)."""
    from omnitron.backends import get_backend
    from omnitron.core.training.loop import train

    save = tmp_path / "ck"
    settings = parse_settings(BASE + ["--exit-duration-in-mins", "1e-6", "--train-iters", "50", "--save", str(save),
                                      "--save-interval", "1000", "--no-tensorboard", "--log-dir", str(tmp_path),
                                      "--num-workers", "0"], 1)
    with caplog.at_level(logging.INFO, logger="omnitron.train"):
        result = train(settings, get_backend("cpu"))
    assert result["iteration"] == 1
    assert open(save / "latest").read() == "iter_0000001"
    assert "stopping after iteration 1 (checkpoint saved at 1)" in caplog.text
