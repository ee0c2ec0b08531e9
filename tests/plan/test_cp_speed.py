"""The speed model's ring-attention terms: each ring step's block (:func:`omnitron.plan.work.cp_blocks`) against
the blocks the ring itself computes (its own ``_step_slices`` on every rank: the busiest rank's block of each
step), and the ``ring_block`` rate lookup against report rows of known rates."""
from __future__ import annotations

import random

import pytest

from omnitron.plan import work


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_ring_blocks_are_the_busiest_ranks_blocks(cp):
    """FLOPs of step i = max over ranks of 3 x 4 b h rows cols d (x 1/2 when the block is causal), rows and cols
    from the ring's slices of the load-balanced layout (each rank holds 2 chunks of c = s / (2 cp) rows)."""
    from omnitron.core.models.gpt.presets import gpt2_tiny
    from omnitron.core.parallel.context.ring import _step_slices

    rng = random.Random()
    cfg = gpt2_tiny(seq_length=2 * cp * rng.choice([4, 8, 16]), num_attention_heads=4, hidden_size=64)
    b = rng.choice([1, 2, 3])
    x = work.local_shapes(cfg, 1, cp, b)
    local, c = cfg.seq_length // cp, cfg.seq_length // (2 * cp)
    d = cfg.hidden_size // cfg.num_attention_heads
    want = []
    for step in range(cp):
        per_rank = []
        for rank in range(cp):
            rows, cols, causal = _step_slices(step, (rank - step) % cp, rank, c, True)
            n_r, n_c = len(range(local)[rows]), len(range(local)[cols])
            per_rank.append((3 * 4.0 * b * x.heads * n_r * n_c * d * (0.5 if causal else 1.0), causal))
        want.append(max(per_rank))
    assert work.cp_blocks(x) == want


def test_ring_block_rate_reads_its_rows(tmp_path):
    """Rows of a known rate per (causal, dropout): the lookup returns FLOPs / that rate, never another kind's."""
    from omnitron.plan.rates import Rates

    rows, rate = [], {}
    for causal in (True, False):
        for p in (0.0, 0.1):
            rate[causal, p > 0] = random.uniform(0.01, 1.0)  # TFLOP/s
            for s in (64, 256):
                fl = 3 * 4 * 2 * 4 * s * s * 32 * (0.5 if causal else 1.0)
                rows.append({"impl": "ring_block", "dtype": "float32", "seq": s, "heads": 4, "head_dim": 32,
                             "batch": 2, "causal": causal, "dropout": p, "ms": fl / (rate[causal, p > 0] * 1e9),
                             "tflops": rate[causal, p > 0]})
    rows.append({"impl": "math", "dtype": "float32", "seq": 64, "heads": 4, "head_dim": 32, "batch": 2,
                 "causal": True, "ms": 1.0, "tflops": 5.0})
    gemm = [{"dtype": "fp32", "shape": "square", "m": 64, "n": 64, "k": 64, "ms": 1.0, "tflops": 1.0}]
    from tests.plan.conftest import _report

    rates = Rates.from_reports([_report(tmp_path, "attention", rows), _report(tmp_path, "gemm", gemm)])
    flops = random.uniform(1e6, 1e8)
    for (causal, drop), tf in rate.items():
        assert rates.ring_block_s("fp32", flops, causal, drop) == pytest.approx(flops / (tf * 1e12), rel=1e-9)
    # the fused / math lookups never read ring rows
    assert rates.attention_s("fp32", flops, True) == pytest.approx(flops / 5e12, rel=1e-9)


@pytest.mark.parametrize("cp", [2, 4])
def test_device_ring_blocks_price_the_hash_of_their_visible_scores(cp):
    """On a device profile without a bench report, one layer's ring attention with attention dropout costs the same
    blocks without it plus the fused flash block's hash: HASH_INT_OPS int32 operations per visible score at a
    quarter of the profile's fp32 peak (no mask bytes), the scores counted here from the ring's own slices (the
    busiest rank's block of each step; a causal block's visible half, as the FLOP count takes it). A plan with
    the hash says so in its notes."""
    from dataclasses import replace

    from omnitron.core.models.gpt.presets import gpt2_tiny
    from omnitron.core.parallel.context.ring import _step_slices
    from omnitron.plan import speed
    from omnitron.plan.device_rates import DeviceRates
    from omnitron.plan.profile import load

    rng = random.Random()
    heads, b = rng.choice([4, 8]), rng.choice([1, 2])
    cfg = gpt2_tiny(seq_length=2 * cp * rng.choice([256, 1024]), num_attention_heads=heads, hidden_size=64 * heads)
    x = work.local_shapes(cfg, 1, cp, b)
    local, c = cfg.seq_length // cp, cfg.seq_length // (2 * cp)
    scores = 0.0
    for step in range(cp):
        per_rank = []
        for rank in range(cp):
            rows, cols, causal = _step_slices(step, (rank - step) % cp, rank, c, True)
            per_rank.append(b * heads * len(range(local)[rows]) * len(range(local)[cols]) * (0.5 if causal else 1.0))
        scores += max(per_rank)
    prof = load("h200")
    rates = DeviceRates(prof, 8)
    plain = speed._attention(replace(cfg, attention_dropout=0.0), x, rates, "bf16", 1)
    assert not rates.notes
    dropped = speed._attention(replace(cfg, attention_dropout=0.1), x, rates, "bf16", 1)
    hash_s = 38 * scores / (0.25 * prof.peak["fp32"])
    assert dropped - plain == pytest.approx(hash_s, rel=1e-9)
    assert any("hash" in n for n in rates.notes)
