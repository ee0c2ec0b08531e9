"""``omnitron plan`` prints the estimate's table; invalid requests get one line naming the binding constraint
and exit code 2; ``omnitron train --log-memory-estimate`` logs the same table before the first step."""
from __future__ import annotations

import logging

import pytest

from omnitron.cli import main

TINY = ["--model", "gpt2_tiny", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200"]


def test_plan_prints_every_stage_and_the_largest_rank(capsys):
    from omnitron.commands.plan import settings_of
    from omnitron.plan.memory import estimate

    assert main(["plan", *TINY, "--layout", "tp2,pp2,dp2", "--global-batch-size", "8"]) == 0
    out = capsys.readouterr().out
    stages = estimate(settings_of({"model": "gpt2_tiny", "mock_data": True, "tokenizer_type": "NullTokenizer",
                                   "vocab_size": 200, "layout": "tp2,pp2,dp2", "global_batch_size": 8}))
    assert "world 8: tp2 pp2 cp1 dp2" in out
    top = max(stages, key=lambda s: s.total)
    assert f"largest rank: stage {top.stage}, " in out and f"({top.total} bytes)" in out
    assert len([line for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])]) == 2


@pytest.mark.parametrize("argv,needle", [
    (["--model", "gpt2_nope"], "--model 'gpt2_nope' is not a preset"),
    (["--model", "gpt2_tiny", "--layout", "tp3"],
     "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"),
    (["--model", "gpt2_tiny", "--layout", "pp3"],
     "--num-layers 4 is not divisible by --pipeline-model-parallel-size 3"),
    (["--model", "gpt2_tiny", "--layout", "tq3"], "'tq3' is not tpN"),
    # families the planner does not model: refused, not probed as GPT (a traceback, or "pp 2" for a pp1 layout)
    (["--model", "bert_tiny", "--layout", "tp2", "--global-batch-size", "8"], "--model-type bert is not modelled"),
    (["--model", "t5_tiny", "--layout", "tp1", "--global-batch-size", "8"], "--model-type t5 is not modelled"),
    (["--model", "llava_tiny", "--global-batch-size", "8", "--devices", "2", "--device", "h100-sxm"],
     "--model-type multimodal is not modelled"),
    (TINY + ["--global-batch-size", "8", "--devices", "4", "--device", "h100-sxm", "--top", "0"],
     "--top must be >= 1"),
])
def test_invalid_requests_get_one_line(argv, needle, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err, err


def test_train_logs_the_estimate(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="omnitron.train")
    argv = ["train", *TINY, "--num-layers", "2", "--train-iters", "1", "--no-tensorboard", "--log-memory-estimate",
            "--num-workers", "0", "--data-cache-path", str(tmp_path / "cache"), "--log-dir", str(tmp_path / "log"),
            "--seq-length", "32", "--max-position-embeddings", "32"]
    assert main(argv) == 0
    text = caplog.text
    assert "predicted memory per rank (omnitron plan)" in text and "largest rank: stage 0" in text


def test_layout_and_parallel_flags_combine_or_refuse():
    """A dimension the layout does not name keeps its flag (found 2026-12-04: `--layout tp4,pp4,dp4
    --expert-model-parallel-size 4` planned ep1 silently); a named one that disagrees with its flag is refused."""
    from omnitron.core.config.parallel import ConfigError
    from omnitron.plan.settings import flat_flags

    base = {"model": "gpt2_tiny", "layout": "tp2,dp2"}
    assert flat_flags({**base, "expert_model_parallel_size": 4})["expert_model_parallel_size"] == 4
    assert flat_flags(base)["expert_model_parallel_size"] == 1
    assert flat_flags({**base, "tensor_model_parallel_size": 2})["tensor_model_parallel_size"] == 2  # agrees
    with pytest.raises(ConfigError, match="says tp2 but --tensor-model-parallel-size is 4"):
        flat_flags({**base, "tensor_model_parallel_size": 4})


def test_a_layout_that_does_not_fit_says_so(capsys):
    """`--layout` with `--device-memory` (or `--device`'s memory) compares the largest rank with it: a layout that
    does not fit is named so before any speed is read."""
    from omnitron.commands.plan import settings_of
    from omnitron.plan.memory import estimate

    flags = {"model": "gpt2_tiny", "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 200,
             "layout": "tp2", "global_batch_size": 8}
    need = max(st.total for st in estimate(settings_of(flags)))
    for memory, word in ((need - 1, "DOES NOT FIT"), (need + 1, "fits")):
        assert main(["plan", *TINY, "--layout", "tp2", "--global-batch-size", "8", "--device-memory",
                     str(memory)]) == 0
        line = capsys.readouterr().out.splitlines()[-1]
        assert line.startswith(word) and f"{need / 2**30:.3f} GiB" in line, line


def test_train_without_a_model_the_planner_prices_logs_why_and_trains(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="omnitron.train")
    argv = ["train", "--model", "bert_tiny", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--train-iters", "1", "--no-tensorboard", "--log-memory-estimate", "--num-workers", "0",
            "--data-cache-path", str(tmp_path / "cache"), "--log-dir", str(tmp_path / "log")]
    assert main(argv) == 0
    assert "--log-memory-estimate: no prediction (omnitron plan prices GPT-family decoders" in caplog.text


def _priced(out: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.startswith("vocabulary priced: ")]
    assert len(lines) == 1, out
    return lines[0]


def test_plan_says_which_vocabulary_it_priced(capsys):
    """``--model llama3_8b`` without ``--tokenizer-type`` prices the default tokenizer's vocabulary, GPT-2's 50257
    (as ``omnitron train`` builds it), not the preset's 128256 (Llama 3's, from its release): one line says so and
    how to change it. A NullTokenizer of a fresh random size V prices V + 1 rows (its end-of-document token, as
    Megatron's NullTokenizer adds), with no hint, the tokenizer being named."""
    import random

    small = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
             "--ffn-hidden-size", "128", "--seq-length", "16", "--max-position-embeddings", "16",
             "--micro-batch-size", "1", "--global-batch-size", "1"]
    assert main(["plan", "--model", "llama3_8b", *small]) == 0
    line = _priced(capsys.readouterr().out)
    assert line.startswith("vocabulary priced: 50,257 rows from --tokenizer-type GPT2BPETokenizer (default); "
                           "the llama3_8b preset's own is 128,256; --tokenizer-type"), line
    v = random.randint(100, 5000)
    assert main(["plan", "--model", "llama3_8b", *small, "--tokenizer-type", "NullTokenizer",
                 "--vocab-size", str(v)]) == 0
    line = _priced(capsys.readouterr().out)
    assert line == f"vocabulary priced: {v + 1:,} rows from --tokenizer-type NullTokenizer; the llama3_8b preset's " \
                   f"own is 128,256", line
