"""The training log's throughput against Megatron-LM's own: the FLOPs per iteration equal Megatron's
``num_floating_point_operations`` for the same flags (fixtures written by Megatron's code at d98e8a6,
tests/data/megatron_flops/make_fixtures.py: dense, GQA + SwiGLU + untied, kv-channels, tp 2's vocabulary padding,
pp 2 x dp 2, MoE with shared experts and --moe-layer-freq, MLA, MTP), divided by the step time and the whole
world as Megatron's ``training_log`` divides them; and a log line's rates are the interval's work over its time.

Tolerances: both sides compute the same integer-valued products in float64 in a different order (about twenty
roundings of 2^-53 each, all terms positive), so they agree to 1e-12 relative with a wide margin; a one-token
or one-layer mistake moves the count by more than 1e-3.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import types

import pytest

from omnitron.core.training.arguments import parse_settings
from omnitron.core.training.loop import _throughput
from omnitron.core.training.metrics import MetricsLogger

FIXTURES = json.loads((pathlib.Path(__file__).resolve().parents[1] / "data" / "megatron_flops"
                       / "fixtures.json").read_text())
CASES = sorted(k for k in FIXTURES if not k.startswith("_"))
REL = 1e-12  # see the module docstring


def _run_stub(case: dict, peak: float | None = None):
    """What ``_throughput`` reads of a run: the model (the case's flags, the fixtures' tokenizer vocabulary),
    the tensor-parallel and world sizes, the backend's memory statistics and peak."""
    settings = parse_settings(case["flags"], case["world_size"])
    model = dataclasses.replace(settings.model, vocab_size=FIXTURES["_vocab"])
    tp = types.SimpleNamespace(size=settings.parallel.tensor_model_parallel_size)
    caps = types.SimpleNamespace(peak=lambda dtype: peak)
    backend = types.SimpleNamespace(memory_stats=lambda: {}, capabilities=lambda: caps)
    return types.SimpleNamespace(model=model, groups=types.SimpleNamespace(tp=tp, world_size=case["world_size"]),
                                 backend=backend)


@pytest.mark.parametrize("name", CASES)
def test_tflops_per_device_is_megatrons(name):
    """TFLOP/s per device = Megatron's FLOPs of the global batch / (step time x 1e12 x world size); MFU the same
    over the backend's peak. Failed before: dense models were counted with non-causal attention scores (+4% to
    +20% here) and the vocabulary was padded for tp 1 whatever the run's tp."""
    case = FIXTURES[name]
    step_time, peak = 0.37, 5e11
    out = _throughput(_run_stub(case, peak), step_time, case["global_batch_size"])
    want = case["flops"] / (step_time * 1e12 * case["world_size"])
    assert out["tflops_per_device"] == pytest.approx(want, rel=REL)
    assert out["mfu"] == pytest.approx(want * 1e12 / peak, rel=REL)
    seq = int(case["flags"][len(case["flags"]) - 1 - case["flags"][::-1].index("--seq-length") + 1])  # the last one
    tokens = case["global_batch_size"] * seq
    assert out["tokens_per_sec"] == pytest.approx(tokens / step_time, rel=REL)


def test_the_fixtures_cover_what_they_claim():
    """The fixture cases differ where the count must: the tp 2 padding (1280 rows, 1152 at tp 1) and a world of
    four (pp 2 x dp 2) are in them."""
    assert FIXTURES["tp2_vocab_padding"]["padded_vocab_size"] == 1280
    assert FIXTURES["gpt_dense"]["padded_vocab_size"] == 1152
    assert FIXTURES["pp2_dp2"]["world_size"] == 4


def _logger(tmp_path, interval: int, throughput: bool = True) -> MetricsLogger:
    return MetricsLogger(log_dir=str(tmp_path), log_interval=interval, train_iters=100, enabled=True,
                         tensorboard=False, progress_bar=False, start_iteration=0, throughput=throughput)


def _step(seconds: float, tokens: int, flops: float, world: int) -> dict:
    """One step's values as the loop gives them (rates of this step alone)."""
    return {"lm_loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "loss_scale": None, "skipped": False,
            "step_time_s": seconds, "tokens_per_sec": tokens / seconds, "tflops_per_device": flops / seconds / world
            / 1e12, "mfu": flops / seconds / world / 1e15, "tokens_per_sec_per_device": tokens / seconds / world,
            "peak_memory_bytes": None}


def test_interval_rates_are_work_over_time(tmp_path):
    """Over a --log-interval of steps with different times (a slow first step, a ramped batch), each rate is the
    interval's tokens (FLOPs) over its summed step time, Megatron's FLOPs over its interval's elapsed time; the
    mean step time is the line's ms/step. Failed before: the rates' plain mean (here 2.3x the true rate)."""
    import random

    rng = random.Random(7)
    world, log = 4, _logger(tmp_path, 5)
    steps = [(rng.uniform(0.05, 0.2) * (10 if i == 0 else 1), rng.choice([8, 16]) * 48) for i in range(5)]
    flops = [tokens * 1.3e6 for _, tokens in steps]
    for i, ((sec, tokens), f) in enumerate(zip(steps, flops)):
        log.step(i + 1, _step(sec, tokens, f, world))
    log.close()
    rec = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    time = math.fsum(s for s, _ in steps)
    assert rec["step_time_s"] == pytest.approx(time / 5, rel=REL)
    assert rec["tokens_per_sec"] == pytest.approx(sum(t for _, t in steps) / time, rel=REL)
    assert rec["tokens_per_sec_per_device"] == pytest.approx(sum(t for _, t in steps) / time / world, rel=REL)
    assert rec["tflops_per_device"] == pytest.approx(math.fsum(flops) / time / world / 1e12, rel=REL)
    assert rec["mfu"] == pytest.approx(math.fsum(flops) / time / world / 1e15, rel=REL)


def _train_case(name: str, root: str) -> list[dict] | None:
    """Two iterations of fixture ``name``'s flags on mock data (the NullTokenizer's vocabulary pads as the
    fixtures' does), logged each; rank 0's records (None on the other ranks)."""
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.training.loop import train

    case = FIXTURES[name]
    log_dir = os.path.join(root, "logs")
    flags = case["flags"] + ["--train-iters", "2", "--log-interval", "1", "--mock-data", "--tokenizer-type",
                             "NullTokenizer", "--vocab-size", str(FIXTURES["_vocab"] - 1), "--num-workers", "0",
                             "--no-tensorboard", "--log-dir", log_dir, "--data-cache-path", os.path.join(root, "cache")]
    train(parse_settings(flags, case["world_size"]), get_backend())  # the backend under test (--backend)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if "lm_loss" in line]


def _assert_megatrons(recs: list[dict], name: str) -> None:
    """Each logged step's TFLOP/s x its time x 1e12 x the world gives back Megatron's FLOPs of the fixture."""
    case = FIXTURES[name]
    assert [r["iteration"] for r in recs] == [1, 2]
    for r in recs:
        got = r["tflops_per_device"] * r["step_time_s"] * 1e12 * case["world_size"]
        assert got == pytest.approx(case["flops"], rel=REL)


def test_a_run_logs_megatrons_tflops(tmp_path):
    """End to end on one process (GQA, SwiGLU, untied)."""
    _assert_megatrons(_train_case("gqa_swiglu_untied", str(tmp_path)), "gqa_swiglu_untied")


def test_a_tp2_run_logs_megatrons_tflops(tmp_path):
    """End to end at tp 2: the vocabulary the FLOPs count is padded for tp 2 (1280 rows), the world is 2."""
    from omnitron.testing.distributed import run_distributed

    _assert_megatrons(run_distributed(_train_case, 2, "tp2_vocab_padding", str(tmp_path))[0], "tp2_vocab_padding")
