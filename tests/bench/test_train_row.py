"""``omnitron bench train``'s row from the run's records, against the definitions in its docstring: the step time
and tokens/s the medians of the iterations after the first, the TFLOP/s and MFU the log's over the causal ratio,
and the peak memory the largest over ranks (the run's ``mem_max_allocated_bytes``), not rank 0's alone. The run
is stubbed (its records drawn at random here); the flags it was given are checked."""
from __future__ import annotations

import json
import os
import random
import statistics
import subprocess

import pytest

from omnitron.bench import train


@pytest.mark.parametrize("layout,vocab,padded", [("pp2", 500, 512), ("tp2", 600, 768)])
def test_row_from_the_records(monkeypatch, layout, vocab, padded):
    """``padded``: ``vocab`` rounded up to a multiple of 128 x tp, as the log's count pads it (the tp2 case pads
    600 to 768 where tp 1 pads to 640: the ratio was taken at 640 before)."""
    rng = random.Random()
    n = rng.randint(3, 7)
    recs = [{"iteration": i + 1, "lm_loss": 5.0, "step_time_s": rng.uniform(0.01, 1.0),
             "tokens_per_sec": rng.uniform(1e3, 1e5), "tflops_per_device": rng.uniform(0.1, 100.0),
             "mfu": rng.uniform(0.05, 0.6), "peak_memory_bytes": rng.randint(1 << 20, 1 << 30)} for i in range(n)]
    for r in recs:  # the largest over ranks: another stage's peak may be above rank 0's
        r["mem_max_allocated_bytes"] = r["peak_memory_bytes"] + rng.randint(0, 1 << 30)
    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        with open(os.path.join(cmd[cmd.index("--log-dir") + 1], "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(train.subprocess, "run", fake_run)
    row = train.run(model="gpt2_tiny", layout=layout, iterations=n, extra=[
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab), "--seq-length", "32",
        "--max-position-embeddings", "32"])
    assert "--log-memory-to-tensorboard" in seen["cmd"] and "--log-dir" in seen["cmd"]
    steady = recs[1:]  # the first iteration builds caches: left out
    assert row["step_ms"] == pytest.approx(statistics.median(r["step_time_s"] for r in steady) * 1e3, rel=1e-12)
    assert row["tokens_per_s"] == pytest.approx(statistics.median(r["tokens_per_sec"] for r in steady), rel=1e-12)
    log_tflops = statistics.median(r["tflops_per_device"] for r in steady)
    assert row["tflops_per_device_causal"] == pytest.approx(log_tflops, rel=1e-12)  # the log's count is causal
    assert row["mfu_causal"] == pytest.approx(statistics.median(r["mfu"] for r in steady), rel=1e-12)
    assert row["peak_memory_bytes"] == max(r["mem_max_allocated_bytes"] for r in recs)
    # Megatron's formula as it was (Narayanan et al. 2021, GPT with a 4h MLP): 72 B s L h^2 (1 + s / 6h + V / 12hL),
    # the scores non-causal; the causal count takes half of their 12 B s^2 L h off. gpt2_tiny: L 4, h 128, V the
    # padded vocabulary, s 32; exact in float64 up to ~1e-15
    b, s, L, h, V = 1, 32, 4, 128, padded
    old = 72 * b * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))
    assert row["tflops_per_device"] == pytest.approx(log_tflops * old / (old - 6 * b * s * s * L * h), rel=1e-12)
