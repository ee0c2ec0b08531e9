"""The plan's FP8 pricing beyond the per-tensor GEMM curve (:mod:`omnitron.plan.fp8`): the layers
``--first-last-layers-bf16`` keeps wide, priced on the stages that hold them, worked by hand on the H200 profile."""
from __future__ import annotations

import math
import random

from omnitron.plan.profile import load

TOKENS, HIDDEN, FFN = 4 * 2048, 2048, 8192
"""One micro-batch of the test model: the 1.3B's layer (4 sequences of 2048 tokens, hidden 2048, MLP 8192; GEMMs of
6.9e10-2.7e11 FLOPs, where FP8 is faster than bf16 on the H200's curves, so a wide layer is a slower one)."""


def _settings(layers: int, pp: int, fp8: bool, wide: tuple[int, int] | None = None):
    from omnitron.commands.plan import settings_of

    given = {"model": "gpt2_tiny", "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 256,
             "seq_length": 2048, "max_position_embeddings": 2048, "global_batch_size": 16, "micro_batch_size": 4,
             "bf16": True, "hidden_size": HIDDEN, "num_attention_heads": 16, "ffn_hidden_size": FFN,
             "num_layers": layers, "layout": f"pp{pp}"}
    if fp8:
        given |= {"fp8_format": "hybrid", "fp8_recipe": "tensorwise"}
    if wide is not None:
        given |= {"first_last_layers_bf16": True, "num_layers_at_start_in_bf16": wide[0],
                  "num_layers_at_end_in_bf16": wide[1]}
    return settings_of(given)


def _fp8_layer_extra(p) -> float:
    """Seconds one layer and micro-batch takes in FP8 beyond bf16 (negative: faster), by hand from the profile's
    tables: each of the four linear GEMMs three times (forward, input and weight gradient) at the FP8 roofline
    instead of bf16's, plus the casts (input and weight forward, output gradient backward), 6 bytes an element
    at the memory-bound rate."""
    def gemm(peak, curve, elem, m, n, k):
        flops, nbytes = 2.0 * m * n * k, elem * (m * k + k * n + m * n)
        return max(flops / (peak * curve(flops)), nbytes / (p.memory_bw * p.memory(nbytes)))

    def stream(nbytes):
        return nbytes / (p.memory_bw * p.memory(nbytes))

    def cast(elements):
        return stream(6 * elements)

    t, h, f = TOKENS, HIDDEN, FFN
    shapes = [(t, 3 * h, h), (t, h, h), (t, f, h), (t, h, f)]  # qkv, proj, fc1, fc2: (m, n, k)
    return sum(3 * (gemm(p.peak["fp8"], p.gemm_fp8, 1, *s) - gemm(p.peak["bf16"], p.gemm, 2, *s)) +
               cast(s[0] * s[2]) + cast(s[2] * s[1]) + cast(s[0] * s[1]) for s in shapes)


def _per_rank(settings, rates) -> dict[int, float]:
    """Seconds of one micro-batch's forward + backward on each pipeline rank (no overlap)."""
    from omnitron.plan.speed import _stage_costs

    _, _, costs = _stage_costs(settings, rates, "none")
    return {k: c.total("F", "none") + c.total("B", "none") for k, c in costs.items()}


def test_first_last_layers_bf16_priced_wide_on_the_stages_holding_them():
    """pp2, 3-6 layers a stage, random unequal start / end counts below it: each stage's micro-batch is the all-FP8 stage's less
    (its wide layers) x the hand-worked FP8 saving of a layer; the step's busiest-rank bound follows the slower
    stage (the one with more wide layers, when the flag moves the bottleneck); at pp1 the whole step moves by
    (start + end) x micro-batches x that saving. The printed note says what was priced."""
    from omnitron.plan.device_rates import DeviceRates
    from omnitron.plan.speed import predict, step_lower_bound

    rng = random.Random()
    per_stage = rng.randint(3, 6)
    layers = 2 * per_stage
    # fewer wide layers than a stage holds, and unequal counts: a count off by one, or taken from the stage's
    # own numbering instead of the model's, shows
    start, end = rng.sample(range(per_stage), 2)
    p = load("h200")
    rates = DeviceRates(p, 8)
    extra = _fp8_layer_extra(p)
    assert extra < 0  # FP8 is faster at these shapes: the wide layers slow their stages

    plain, flagged = _settings(layers, 2, True), _settings(layers, 2, True, (start, end))
    base, mine = _per_rank(plain, rates), _per_rank(flagged, rates)
    wide = {0: start, 1: end}
    for k in (0, 1):
        assert math.isclose(mine[k] - base[k], -wide[k] * extra, rel_tol=1e-6, abs_tol=1e-12), (k, start, end)
    m = flagged.num_microbatches
    assert math.isclose(step_lower_bound(flagged, rates), m * max(mine.values()), rel_tol=1e-9)
    assert math.isclose(max(mine.values()), max(base[k] - wide[k] * extra for k in (0, 1)), rel_tol=1e-6)

    one, one_wide = _settings(layers, 1, True), _settings(layers, 1, True, (start, end))
    got = predict(one_wide, rates).total - predict(one, rates).total
    assert math.isclose(got, -(start + end) * m * extra, rel_tol=1e-6)
    note = next(a for a in predict(one_wide, rates).assumptions if a.startswith("FP8"))
    assert f"first {start} and last {end} layer(s) priced wide" in note
