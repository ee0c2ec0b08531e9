"""``omnitron bench attention``'s TFLOP/s from their definitions, on fresh random shapes: ``tflops`` the model's
count (two GEMMs of ``2 b h s^2 d`` forward, twice that backward, causal halved) and ``tflops_fa``
FlashAttention's (its benchmarks/benchmark_flash_attention.py ``flops(..., mode="fwd_bwd")``, transcribed
below: the backward 2.5x the forward)."""
from __future__ import annotations

import random

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.bench import attention


def _flash_attention_flops(batch, seqlen, headdim, nheads, causal, mode="fwd"):
    """FlashAttention's benchmark count (Dao-AILab/flash-attention, benchmarks/benchmark_flash_attention.py)."""
    f = 4 * batch * seqlen**2 * nheads * headdim // (2 if causal else 1)
    return f if mode == "fwd" else (2.5 * f if mode == "bwd" else 3.5 * f)


def test_attention_rows_count_the_models_flops_and_flashattentions():
    rng = random.Random()
    seq, heads, head_dim, batch = rng.choice([8, 16, 24]), rng.randint(1, 3), rng.choice([8, 16]), rng.randint(1, 2)
    rows = attention.run(get_backend("cpu"), seqs=[seq], heads=heads, head_dim=head_dim, batch=batch,
                         dtype=torch.float32, causal=rng.random() < 0.5, rounds=3, budget_s=0.05, log=lambda *_: None)
    assert {r["impl"] for r in rows} >= {"math", "ring_block"}
    for r in rows:
        fwd = 2 * (2 * batch * heads * seq * seq * head_dim) * (0.5 if r["causal"] else 1.0)  # QK^T and PV
        seconds = r["ms"] * 1e-3
        # float64 products of small integers and one division each: equal to ~1e-15
        assert r["tflops"] == pytest.approx(3 * fwd / seconds / 1e12, rel=1e-12)
        fa = _flash_attention_flops(batch, seq, head_dim, heads, r["causal"], mode="fwd_bwd")
        assert r["tflops_fa"] == pytest.approx(fa / seconds / 1e12, rel=1e-12)
