"""--use-checkpoint-args takes the model and tokenizer from the checkpoint (overriding the command line, each
change logged) and resumes; --exit-on-missing-checkpoint stops when --load holds nothing; --load refuses a run
whose model computes otherwise than the checkpoint's where no weight shape shows it (window, RoPE base, routing...),
naming each flag with both values, and lets the run's own choices (dropout, recomputation, ...) change."""
from __future__ import annotations

import dataclasses
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


_SHAPE = ("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
          "--vocab-size", "90", "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear")


def test_resume_with_other_model_maths_is_refused_naming_the_flags(tmp_path):
    """A window and a RoPE base leave every weight's shape alone: a resume (or --finetune) without the checkpoint's
    values is refused before any step, in one line naming each flag with both values and the flags to give; the
    same line again resumes, and --finetune with other dropout, recomputation and init trains."""
    first = _run(tmp_path, *_SHAPE, "--window-size", "3,0", "--rotary-base", "500000", "--lr-decay-iters", "10",
                 "--train-iters", "2")
    train(parse_settings(first, 1), get_backend("cpu"))
    load = ["--load", str(tmp_path / "ckpt")]
    for extra in ([], ["--finetune"]):
        other = parse_settings(_run(tmp_path, *_SHAPE, "--rotary-base", "10000", "--train-iters", "3", *load,
                                    *extra), 1)
        for check in (check_resume, lambda s: train(s, get_backend("cpu"))):  # before launch, and in the worker
            with pytest.raises(CheckpointError) as err:
                check(other)
            text = str(err.value)
            assert "\n" not in text and "--window-size checkpoint 3,0, this run none" in text
            if extra:  # a finetune may change the position encoding (context extension): only the window is named
                assert "rotary" not in text and "give --window-size 3,0" in text
            else:
                assert "--rotary-base checkpoint 500000.0, this run 10000.0" in text
                assert "give --rotary-base 500000.0 --window-size 3,0" in text
    again = parse_settings(first[:-1] + ["3", *load], 1)
    check_resume(again)
    assert sorted(train(again, get_backend("cpu"))["losses"]) == [3]  # resumed at iteration 2
    tuned = parse_settings(_run(tmp_path / "ft", *_SHAPE, "--window-size", "3,0", "--rotary-base", "1000000",
                                "--train-iters", "1", "--finetune", *load, "--hidden-dropout", "0.3",
                                "--attention-dropout", "0.2", "--recompute-granularity", "full",
                                "--recompute-method", "uniform", "--recompute-num-layers", "1",
                                "--init-method-std", "0.01"), 1)
    check_resume(tuned)
    assert sorted(train(tuned, get_backend("cpu"))["losses"]) == [1]


def test_model_settings_are_compared_as_the_model_uses_them():
    """Values that mean the same (a pattern spelled two ways, YaRN's default written out, the settings a model does
    not read) pass; a different top-k, softmax or norm epsilon is refused; the run's choices are free."""
    from dataclasses import replace

    from omnitron.core.models.gpt.config import GPTConfig
    from omnitron.core.training.model_check import check_model_settings
    from omnitron.core.training.checkpointing import model_dict

    base = GPTConfig(num_layers=2, hidden_size=8, num_attention_heads=2, position_embedding_type="rope",
                     num_experts=2, window_size="3,0", window_attn_skip_freq="2")
    same = [dict(moe_layer_freq="[1,1]", window_attn_skip_freq="[1,0]", yarn_beta_fast=32.0, kv_lora_rank=64),
            dict(hidden_dropout=0.0, recompute_granularity="full", cpu_offloading=True, moe_aux_loss_coeff=1e-2,
                 moe_grouped_gemm=True, moe_expert_capacity_factor=1.0, seq_length=64, init_method_std=0.1)]
    for kw in same:
        check_model_settings(model_dict(base), model_dict(replace(base, **kw)), "D")
    extended = replace(base, rotary_base=40000, rotary_scaling_factor=8.0,  # context extension by --finetune
                       position_embedding_type="yarn")
    notes = check_model_settings(model_dict(base), model_dict(extended), "D", finetune=True)
    assert len(notes) == 3 and all(any(want in n for n in notes) for want in (
        "--rotary-base 40000 (the checkpoint's: 10000.0)", "--position-embedding-type yarn (the checkpoint's: rope)"))
    with pytest.raises(CheckpointError, match="--rotary-base checkpoint 10000.0, this run 40000"):
        check_model_settings(model_dict(base), model_dict(extended), "D")  # a resume continues the same model
    for kw, flag in ((dict(moe_router_topk=1), "--moe-router-topk checkpoint 2, this run 1"),
                     (dict(softmax_type="off-by-one"), "--softmax-type checkpoint vanilla, this run off-by-one"),
                     (dict(layernorm_epsilon=1e-6), "--layernorm-epsilon checkpoint 1e-05, this run 1e-06"),
                     (dict(window_attn_skip_freq=None), "--window-attn-skip-freq checkpoint 2, this run none")):
        with pytest.raises(CheckpointError, match=flag):
            check_model_settings(model_dict(base), model_dict(replace(base, **kw)), "D")


def test_a_checkpoint_of_routers_without_bias_keeps_them(tmp_path):
    """An MoE checkpoint written before the router bias followed --add-bias-linear records ``moe_router_bias``
    False (no flag sets it): a run loading it takes that and trains on; a fresh run has the bias (Megatron's)."""
    from omnitron.core.checkpoint.hf import write_weights_checkpoint
    from omnitron.core.checkpoint.reshard import Layout
    from tests.checkpoint.test_megatron_dist import _weights

    flags = _run(tmp_path, "--model", "gpt2_tiny", "--num-experts", "4", "--vocab-size", "90", "--train-iters", "1")
    cfg = parse_settings(flags, 1).model
    assert cfg.moe_router_bias is None and cfg.add_bias_linear  # fresh: Megatron's rule, a router bias
    old = dataclasses.replace(cfg, moe_router_bias=False, vocab_size=91)  # NullTokenizer: 90 + its eod
    write_weights_checkpoint(_weights(old, seed=3), old, str(tmp_path / "old"), Layout(),
                             config={"tokenizer_type": "NullTokenizer"})
    again = parse_settings(flags + ["--load", str(tmp_path / "old")], 1)
    assert again.model.moe_router_bias is False
    check_resume(again)
    assert train(again, get_backend("cpu"))["losses"]
