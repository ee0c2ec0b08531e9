"""The loop in one process: metrics.jsonl fields, validation, fp16 loss-scale skipping, --finetune,
--load compatibility errors, omnitron plot's clear message."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from omnitron.backends import get_backend
from omnitron.core.checkpoint import CheckpointError
from omnitron.core.training.arguments import parse_settings
from omnitron.core.training.loop import train


def _args(tmp_path, *extra):
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
            "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "100",
            "--num-workers", "0", "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1",
            "--no-tensorboard", "--data-cache-path", str(tmp_path / "cache"), "--lr", "1e-2", *extra]


def test_metrics_and_validation(tmp_path):
    log_dir = tmp_path / "logs"
    res = train(parse_settings(_args(tmp_path, "--train-iters", "4", "--eval-interval", "2", "--eval-iters", "2",
                                     "--log-dir", str(log_dir)), 1), get_backend("cpu"))
    recs = [json.loads(line) for line in open(log_dir / "metrics.jsonl")]
    train_recs = [r for r in recs if "lm_loss" in r]
    val = [r for r in recs if "val_loss" in r]
    # Megatron's evaluations: every --eval-interval and once more after training, each on new validation batches
    # of one stream over (4 // 2 + 1) * 2 * 4 samples; then the test split once (2 x 4 samples)
    assert [r["iteration"] for r in train_recs] == [1, 2, 3, 4] and [r["iteration"] for r in val] == [2, 4, 4]
    assert len(res["components"].valid_data) == 24 and len(res["components"].test_data) == 8
    assert val[1]["val_loss"] != val[2]["val_loss"]  # the same weights, the next batches
    test = [r for r in recs if "test_loss" in r]
    assert [r["iteration"] for r in test] == [4] and test[0]["test_loss"] == res["test"]["test_loss"]
    for r in train_recs:
        for key in ("lm_loss", "lr", "grad_norm", "loss_scale", "tokens_per_sec", "step_time_s", "skipped_iters"):
            assert key in r
        assert r["lm_loss"] == res["losses"][r["iteration"]]  # full precision round trip
        assert r["tokens_per_sec"] > 0 and r["grad_norm"] > 0
    assert val[0]["val_ppl"] == pytest.approx(__import__("math").exp(val[0]["val_loss"]))
    proc = subprocess.run([sys.executable, "-m", "omnitron", "plot", str(log_dir)], capture_output=True, text=True,
                          timeout=120)
    try:
        import matplotlib  # noqa: F401
        assert proc.returncode == 0 and os.path.exists(log_dir / "loss.png")
    except ImportError:
        assert proc.returncode == 2 and "matplotlib is not installed" in proc.stderr


def test_fp16_dynamic_loss_scale_skips_then_trains(tmp_path):
    log_dir = tmp_path / "logs"
    res = train(parse_settings(_args(tmp_path, "--fp16", "--initial-loss-scale", str(2.0 ** 22), "--hysteresis", "1",
                                     "--train-iters", "6", "--log-dir", str(log_dir)), 1), get_backend("cpu"))
    recs = [json.loads(line) for line in open(log_dir / "metrics.jsonl")]
    skipped = [r["skipped_iters"] for r in recs]
    scales = [r["loss_scale"] for r in recs]
    assert skipped[0] == 1 and sum(skipped) < 6  # overflowing steps skipped, then it trains
    assert scales == sorted(scales, reverse=True) and scales[-1] < 2.0 ** 22
    assert all(r["grad_norm"] is None for r in recs if r["skipped_iters"])
    assert all(v == v for v in res["losses"].values())  # no NaN loss reported


def test_finetune_and_incompatible_load(tmp_path):
    save = str(tmp_path / "ck")
    first = train(parse_settings(_args(tmp_path, "--train-iters", "2", "--save", save), 1), get_backend("cpu"))
    # resuming past the checkpoint keeps metrics.jsonl consistent: records 1-2, then 3-4 appended
    with open(os.path.join(save, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"iteration": 3, "lm_loss": 0.0}) + "\n")  # written by a run killed before saving
    train(parse_settings(_args(tmp_path, "--train-iters", "4", "--use-checkpoint-opt_param-scheduler", "--load", save,
                               "--save", str(tmp_path / "ck2"),
                               "--log-dir", save), 1), get_backend("cpu"))
    its = [json.loads(line)["iteration"] for line in open(os.path.join(save, "metrics.jsonl"))]
    assert its == [1, 2, 3, 4]
    train(parse_settings(_args(tmp_path, "--train-iters", "1", "--log-dir", save), 1), get_backend("cpu"))
    assert [json.loads(line)["iteration"] for line in open(os.path.join(save, "metrics.jsonl"))] == [1]  # fresh run
    c0 = first["components"]
    ft = train(parse_settings(_args(tmp_path, "--train-iters", "1", "--load", save, "--finetune", "--lr", "0.0",
                                    "--weight-decay", "0"), 1), get_backend("cpu"))
    c1 = ft["components"]
    assert list(ft["losses"]) == [1] and c1.optimizer.step_count == 1  # iteration 0, fresh optimizer
    for a, b in zip(c0.modules[0].parameters(), c1.modules[0].parameters()):
        assert a.detach().equal(b.detach())  # weights loaded (lr 0 keeps them)
    with pytest.raises(CheckpointError, match="--hidden-size 32, this run 64"):
        train(parse_settings(_args(tmp_path, "--train-iters", "3", "--load", save, "--hidden-size", "64"), 1),
              get_backend("cpu"))
    # from the command line the same mismatch is one line on stderr and exit code 2, before any worker starts
    # (another parallel layout is not an error: --load reshards, see tests/checkpoint/test_reshard.py)
    proc = subprocess.run([sys.executable, "-m", "omnitron", "train", *_args(tmp_path, "--load", save,
                           "--hidden-size", "64", "--tensor-model-parallel-size", "2", "--nproc-per-node", "2")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--hidden-size 32, this run 64" in proc.stderr


def test_start_log_counts_parameters_by_model_family():
    """The start-of-run parameter count is each family's own (BERT, T5 and LLaVA add what GPT's formula lacks)."""
    from omnitron.core.models.gpt.config import num_parameters as gpt_count
    from omnitron.core.training.loop import model_parameters

    for preset, module in (("bert_tiny", "bert"), ("t5_tiny", "t5"), ("llava_tiny", "multimodal")):
        cfg = parse_settings(["--model", preset, "--mock-data"], 1).model
        family = __import__(f"omnitron.core.models.{module}.config", fromlist=["num_parameters"])
        assert model_parameters(cfg) == family.num_parameters(cfg) != gpt_count(cfg), preset
    gpt = parse_settings(["--model", "gpt2_tiny", "--mock-data"], 1).model
    assert model_parameters(gpt) == gpt_count(gpt)


@pytest.mark.parametrize("matplotlib", ["as installed", "absent"])
def test_plot_drops_a_last_line_cut_short_and_names_a_bad_one(tmp_path, capsys, monkeypatch, matplotlib):
    """`omnitron plot` on a run being written (its last line cut short) plots the complete records; a bad line
    before the last is one line naming it (it was a JSONDecodeError traceback), with or without matplotlib (the
    file is read first: without matplotlib the bad line went unnamed behind the install hint)."""
    import random

    from omnitron.cli import main

    losses = [random.uniform(1, 9) for _ in range(4)]
    whole = "".join(json.dumps({"iteration": i + 1, "lm_loss": v}) + "\n" for i, v in enumerate(losses))
    (tmp_path / "metrics.jsonl").write_text(whole + '{"iteration": 5, "lm_lo')
    from omnitron.commands.plot import read_metrics

    train_recs, _ = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["lm_loss"] for r in train_recs] == losses
    lines = whole.splitlines(keepends=True)
    (tmp_path / "metrics.jsonl").write_text(lines[0] + '{"iter\n' + "".join(lines[1:]))
    if matplotlib == "absent":
        monkeypatch.setitem(sys.modules, "matplotlib", None)  # its import raises ImportError
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "png")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "line 2 is not JSON" in err, err


def _megatron_scales(skipped: list[bool], scale: float, window: int, hysteresis: int) -> list[float]:
    """The scale each step used under Megatron's DynamicGradScaler.update (d98e8a6, transcribed; min scale 1)."""
    growth, hyst, out = 0, hysteresis, []
    for found_inf in skipped:
        out.append(scale)
        if found_inf:
            growth, hyst = 0, hyst - 1
            scale = max(scale * 0.5, 1.0) if hyst <= 0 else scale
        else:
            growth += 1
            if growth == window:
                growth, hyst, scale = 0, hysteresis, scale * 2.0
    return out


def test_fp16_resume_restores_the_scale_and_both_trackers(tmp_path):
    """Stopping after iteration 3 (hysteresis tracker run down to -1) and 5 (growth tracker at 1) and resuming gives the
    uninterrupted run's records; the scales are Megatron's rule over the run's own skips."""
    flags = ("--fp16", "--initial-loss-scale", str(2.0 ** 20), "--loss-scale-window", "2", "--train-iters", "7")

    def run(name, *extra):
        train(parse_settings(_args(tmp_path / name, *flags, "--log-dir", str(tmp_path / name / "logs"), *extra), 1),
              get_backend("cpu"))
        recs = [json.loads(line) for line in open(tmp_path / name / "logs" / "metrics.jsonl")]
        return [(r["iteration"], r["loss_scale"], r["skipped_iters"], r["lm_loss"]) for r in recs if "lm_loss" in r]
    full = run("full")
    save = str(tmp_path / "ck")
    for stop in ("3", "5"):
        run("parts", "--save", save, "--load", save, "--save-interval", stop, "--exit-interval", stop)
    assert run("parts", "--save", save, "--load", save) == full
    skipped = [bool(r[2]) for r in full]
    assert skipped[:3] == [True] * 3 and not skipped[4] and not skipped[5]  # the trackers the resumes carry matter
    assert [r[1] for r in full] == _megatron_scales(skipped, 2.0 ** 20, window=2, hysteresis=2)
