"""The train command line: Megatron flags, config-file precedence, one-line errors with exit code 2."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from omnitron.core.config.parallel import ConfigError
from omnitron.core.training.arguments import parse_settings


def test_flags_config_file_and_precedence(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: gpt2_tiny\ntensor-model-parallel-size: 2\nmicro_batch_size: 2\nlr: 0.5\nbf16: true\n"
                   "data-path: [0.3, A, 0.7, B]\n")
    s = parse_settings(["--config", str(cfg), "--lr", "0.25", "--seq-length", "64", "--num-layers", "2",
                        "--global-batch-size", "8"], world_size=4)
    assert s.parallel.tensor_model_parallel_size == 2 and s.dp == 2 and s.num_microbatches == 2
    assert s.optim.lr == 0.25  # the command line wins
    assert s.precision.bf16 and str(s.model.params_dtype) == "torch.bfloat16"
    assert s.model.seq_length == 64 and s.data.seq_length == 64 and s.model.num_layers == 2
    assert s.model.hidden_size == 128  # from the preset
    assert s.data.data_path == ["0.3", "A", "0.7", "B"]
    j = tmp_path / "run.json"
    j.write_text(json.dumps({"model": "gpt2_tiny", "lr": "x"}))
    with pytest.raises(ConfigError, match="--lr expects float"):
        parse_settings(["--config", str(j)], world_size=1)
    j.write_text(json.dumps({"model": "gpt2_tiny", "not-a-flag": 1}))
    with pytest.raises(ConfigError, match="unknown setting 'not_a_flag'"):
        parse_settings(["--config", str(j)], world_size=1)


@pytest.mark.parametrize("argv,world,message", [
    (["--model", "gpt2_tiny", "--global-batch-size", "3"], 2, "--global-batch-size 3 is not a multiple"),
    (["--model", "gpt2_tiny", "--pipeline-model-parallel-size", "3"], 3, "--num-layers 4 is not divisible"),
    (["--model", "gpt2_tiny", "--tensor-model-parallel-size", "2"], 3, "world size 3 is not a multiple"),
    (["--num-layers", "2"], 1, "give --hidden-size, --num-attention-heads"),
    (["--model", "gpt2_tiny", "--lr", "1", "--min-lr", "2"], 1, "--min-lr"),
    (["--model", "gpt2_tiny", "--finetune"], 1, "--finetune needs --load"),
    (["--model", "nope"], 1, "not a preset"),
    (["--model", "gpt2_tiny", "--fp8-recipe", "blockwise"], 1, "need --fp8-format"),
    (["--model", "gpt2_tiny", "--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"], 1, "mxfp8 is not supported"),
    (["--model", "gpt2_tiny", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--first-last-layers-bf16",
      "--num-layers-at-end-in-bf16", "3", "--pipeline-model-parallel-size", "2"], 2,
     "--num-layers-at-end-in-bf16 3 is more than the 2 layers of a pipeline stage"),  # Megatron's bound
    (["--model", "gpt2_tiny", "--reset-attention-mask", "--context-parallel-size", "2"], 2,
     "ring attention has no per-document mask"),
    (["--model", "gpt2_tiny", "--sample-temperature", "0"], 1, "--sample-temperature 0.0 must be positive"),
    (["--model", "gpt2_tiny", "--sample-tokens", "-1"], 1, "--sample-tokens -1 must be 0 or more"),
    (["--model", "gpt2_tiny", "--sample-top-k", "-2"], 1, "--sample-top-k -2 must be 0 or more"),
    (["--model", "gpt2_tiny", "--nproc-per-node", "0"], 1, "--nproc-per-node must be >= 1 .*, got 0$"),
])
def test_cross_checks(argv, world, message):
    with pytest.raises(ConfigError, match=message):
        parse_settings(argv, world_size=world)


def test_sample_temperature_reaches_the_settings():
    import random

    t = round(random.uniform(0.1, 2.0), 3)
    assert parse_settings(["--model", "gpt2_tiny", "--sample-temperature", str(t)],
                          world_size=1).sample_temperature == t
    assert parse_settings(["--model", "gpt2_tiny"], world_size=1).sample_temperature == 0.8


def test_sample_counts_keep_a_given_zero():
    """--sample-tokens 0 turns the sample off and --sample-top-k 0 the top-k filter (a given 0 once became the
    default 40 / 20); absent, the defaults."""
    import random

    n, k = random.randint(1, 99), random.randint(1, 50)
    argv = ["--model", "gpt2_tiny"]
    s = parse_settings(argv + ["--sample-tokens", "0", "--sample-top-k", "0"], world_size=1)
    assert (s.sample_tokens, s.sample_top_k) == (0, 0)
    s = parse_settings(argv + ["--sample-tokens", str(n), "--sample-top-k", str(k)], world_size=1)
    assert (s.sample_tokens, s.sample_top_k) == (n, k)
    s = parse_settings(argv, world_size=1)
    assert (s.sample_tokens, s.sample_top_k) == (40, 20)


def test_missing_data_path_is_caught_before_launch(tmp_path):
    from omnitron.core.training.launch import precheck

    s = parse_settings(["--model", "gpt2_tiny", "--data-path", str(tmp_path / "nope_text_document")], world_size=1)
    with pytest.raises(ConfigError, match="nope_text_document.bin not found"):
        precheck(s)
    s = parse_settings(["--model", "gpt2_tiny", "--vocab-file", str(tmp_path / "v.json")], world_size=1)
    with pytest.raises(ConfigError, match="--vocab-file .* not found"):
        precheck(s)


def test_bad_tensor_parallel_size_is_one_line_exit_2():
    proc = subprocess.run([sys.executable, "-m", "omnitron", "train", "--model", "gpt2_tiny", "--mock-data",
                           "--tensor-model-parallel-size", "3", "--nproc-per-node", "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3" in lines[0]
    helptext = subprocess.run([sys.executable, "-m", "omnitron", "train", "--help"], capture_output=True, text=True,
                              timeout=120).stdout
    for flag in ("--tensor-model-parallel-size", "--micro-batch-size", "--lr-decay-style", "--bf16", "--save",
                 "--nproc-per-node", "--config", "--eval-interval", "--keep-last-n"):
        assert flag in helptext


def test_bf16_accumulates_gradients_in_fp32_as_megatron():
    base = ["--model", "gpt2_tiny", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    assert parse_settings(base + ["--bf16"], world_size=1).ddp.accumulate_allreduce_grads_in_fp32
    assert not parse_settings(base, world_size=1).ddp.accumulate_allreduce_grads_in_fp32
    assert parse_settings(base + ["--accumulate-allreduce-grads-in-fp32"],
                          world_size=1).ddp.accumulate_allreduce_grads_in_fp32


def test_auto_backend_choice_is_probed_once(monkeypatch):
    from omnitron.backends import registry

    monkeypatch.delenv("OMNITRON_BACKEND", raising=False)
    registry.reset_cache()
    calls = []
    real = registry.probe_all
    monkeypatch.setattr(registry, "probe_all", lambda: calls.append(1) or real())
    try:
        first = registry.get_backend()
        assert registry.get_backend() is first and len(calls) == 1
    finally:
        registry.reset_cache()


@pytest.mark.parametrize("env,flag,noted", [("sim", [], True), ("sim", ["--backend", "sim"], False),
                                            ("cpu", [], False), (None, [], False)])
def test_a_config_files_backend_over_the_environments_is_said(env, flag, noted, tmp_path, monkeypatch, caplog):
    """`OMNITRON_BACKEND=cuda omnitron train --config FILE` with `backend: cpu` in FILE runs on cpu (file < command
    line; the variable is only --backend's default): the README gave such GPU lines. One log line says so where the
    variable and the file differ and --backend does not decide; the file's backend still stands."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: gpt2_tiny\nbackend: cpu\n")
    if env is None:
        monkeypatch.delenv("OMNITRON_BACKEND", raising=False)
    else:
        monkeypatch.setenv("OMNITRON_BACKEND", env)
    with caplog.at_level("INFO", logger="omnitron.train"):
        s = parse_settings(["--config", str(cfg), *flag], world_size=1)
    assert s.backend == (flag[1] if flag else "cpu")
    lines = [r.getMessage() for r in caplog.records if "OMNITRON_BACKEND" in r.getMessage()]
    assert lines == (["backend cpu: the config file's backend wins over OMNITRON_BACKEND=sim; give --backend sim "
                      "to run on sim"] if noted else [])


def test_slurm_example_parses_for_its_world():
    """examples/slurm_gpt_1p3b.sh: its omnitron flags (shell variables filled in) make a valid 16-rank layout."""
    import pathlib
    import shlex

    from omnitron.core.training.arguments import parse_settings

    text = (pathlib.Path(__file__).resolve().parents[2] / "examples" / "slurm_gpt_1p3b.sh").read_text()
    line = text.split("-m omnitron.train", 1)[1].replace("\\\n", " ")
    for var, value in (('"$DATA"', "data/corpus"), ('"$SAVE/tensorboard"', "/tmp/s/tb"), ('"$SAVE"', "/tmp/s")):
        line = line.replace(var, value)
    s = parse_settings(shlex.split(line), world_size=16)
    assert (s.parallel.tensor_model_parallel_size, s.parallel.pipeline_model_parallel_size, s.dp) == (2, 2, 4)
    assert s.checkpoint.async_save and s.checkpoint.ckpt_format == "torch_dist" and s.num_microbatches == 16


@pytest.mark.parametrize("seed", [1, 2**32 - 1, 2**32, 2**63])
def test_seed_outside_the_data_orders_range_is_refused_up_front(seed):
    """--seed reaches numpy's RandomState(seed) (the data order, Megatron's shuffle): a seed it refuses used to
    train until the data loader raised (one of 2**63 or more in the generators' seeding); now it is one ConfigError
    before any work, and every positive seed numpy takes runs (<= 0: tests/training/test_seed_megatron.py)."""
    import numpy as np

    try:
        np.random.RandomState(seed)
        numpy_takes = True
    except ValueError:
        numpy_takes = False
    argv = ["--model", "gpt2_tiny", "--seed", str(seed)]
    if numpy_takes:
        assert parse_settings(argv, world_size=1).training.seed == seed
    else:
        with pytest.raises(ConfigError, match=rf"^--seed {seed} is above 4294967295: .*give a smaller seed"):
            parse_settings(argv, world_size=1)
