"""The plan's FP8 pricing beyond the per-tensor GEMM curve (:mod:`omnitron.plan.fp8`), worked by hand on the H200
profile: the layers ``--first-last-layers-bf16`` keeps wide, priced on the stages that hold them; the block-wise
recipe's quantizations and its emulated GEMMs (against the H200's recorded block-wise GEMM rows); the per-tensor
casts as the kernels the compiled layer runs."""
from __future__ import annotations

import json
import math
import pathlib
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
    instead of bf16's, plus the casts (input and weight forward, output gradient backward), each an amax kernel
    (the 2-byte source read) and a cast-transpose kernel (2 read, 1 + 1 written: the operand and its transpose) at
    the memory-bound rate of its own bytes (the cast-transpose at the profile's measured fraction of it)."""
    def gemm(peak, curve, elem, m, n, k):
        flops, nbytes = 2.0 * m * n * k, elem * (m * k + k * n + m * n)
        return max(flops / (peak * curve(flops)), nbytes / (p.memory_bw * p.memory(nbytes)))

    def stream(nbytes):
        return nbytes / (p.memory_bw * p.memory(nbytes))

    def cast(elements):
        return stream(2 * elements) + stream(4 * elements) / (p.fp8_cast_transpose or 1.0)

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
    """pp2, 3-6 layers a stage, random unequal start / end counts below it: each stage's micro-batch is the all-FP8
    stage's less (its wide layers) x the hand-worked FP8 saving of a layer; the step's busiest-rank bound follows the
    slower stage (the one with more wide layers, when the flag moves the bottleneck); at pp1 the whole step moves by
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
    # a wide layer changes its stage's time; the sign is the profile's (at the copy rate an FP8 layer of these shapes
    # is 1.0 ms faster than bf16; at the eager Triton kernel's 0.208 of it, 0.5 ms slower)
    assert abs(extra) > 1e-4

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


GEMMS = pathlib.Path(__file__).parents[2] / "benchmarks" / "results" / "h200-2026-12-04" / "bench" / "gemm.json"
EMULATED_BOUND = 0.12
"""Bound of a recorded block-wise row against the emulated price: the fp32 GEMM term on the profile's curve lies
within 3.5% of the same run's fp32 rows at these shapes (4.3e10-1.1e12 FLOPs), and the dequantization is priced as
the compiled layer runs it (5 bytes an operand element) while the bench ran it eager (13: an fp32 copy, then the
scale's multiply in place; its strided copy of the right operand besides): that unpriced part was 4-11% of the
recorded rows (each row less its fp32 row). The price is expected under the row, by at most the sum."""


def test_emulated_block_gemm_against_the_recorded_h200_rows():
    """The H200 profile says block-scaled GEMMs run emulated; each ``fp8-block`` row of ``omnitron bench gemm`` on
    the H200 (2026-12-04, above 1e10 FLOPs, 7 rows) is priced at or under its time, within
    :data:`EMULATED_BOUND`; the same GEMM priced at the FP8 rate (native) is far faster than any row."""
    from omnitron.plan.device_rates import DeviceRates

    p = load("h200")
    assert p.fp8_block_gemm == "emulated"
    rates = DeviceRates(p, 8)
    rows = [r for r in json.loads(GEMMS.read_text())["rows"] if r["dtype"] == "fp8-block"
            and 2.0 * r["m"] * r["n"] * r["k"] > 1e10]
    assert len(rows) == 7 and all(r["note"] == "FP8 path: emulated" for r in rows)
    for r in rows:
        priced, measured = rates.gemm_s("fp8-block", r["m"], r["n"], r["k"]), r["ms"] * 1e-3
        assert 1 - EMULATED_BOUND <= priced / measured <= 1.0, r
        assert rates.gemm_s("fp8", r["m"], r["n"], r["k"]) < 0.2 * measured


def test_blockwise_step_worked_by_hand():
    """pp1 on the H200 profile: the block-wise FP8 step less the bf16 step is, per layer and micro-batch, for each
    linear GEMM three emulated block GEMMs (both operands dequantized at 5 bytes an element, an fp32 GEMM at the
    non-tensor peak on the GEMM curve, its fp32 result cast at 6 bytes; priced at the forward's shape as the model
    prices every backward GEMM) less three bf16 ones, plus the quantizations: the input and the weight forward,
    the output gradient twice and the input again backward, each an amax kernel (2 bytes an element) and a cast
    writing FP8 and a 4-byte scale per 128 (3 + 4 / 128 bytes), no transpose."""
    from omnitron.commands.plan import settings_of
    from omnitron.plan.device_rates import DeviceRates
    from omnitron.plan.speed import predict

    p = load("h200")
    rates = DeviceRates(p, 8)
    layers = random.randint(1, 4)
    base = {"model": "gpt2_tiny", "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 256,
            "seq_length": 2048, "max_position_embeddings": 2048, "global_batch_size": 8, "micro_batch_size": 4,
            "bf16": True, "hidden_size": HIDDEN, "num_attention_heads": 16, "ffn_hidden_size": FFN,
            "num_layers": layers}
    bf16 = predict(settings_of(base), rates)
    block = predict(settings_of(base | {"fp8_format": "e4m3", "fp8_recipe": "blockwise"}), rates)

    def stream(nbytes):
        return nbytes / (p.memory_bw * p.memory(nbytes))

    def bf16_gemm(m, n, k):
        flops, nbytes = 2.0 * m * n * k, 2 * (m * k + k * n + m * n)
        return max(flops / (p.peak["bf16"] * p.gemm(flops)), stream(nbytes))

    def emulated(m, n, k):
        flops = 2.0 * m * n * k
        fp32 = max(flops / (p.peak["fp32"] * p.gemm(flops)), stream(4 * (m * k + k * n + m * n)))
        return fp32 + stream(5 * m * k) + stream(5 * k * n) + stream(6 * m * n)

    def quantize(elements):
        return stream(2 * elements) + stream((3 + 4 / 128) * elements)

    t, h, f = TOKENS, HIDDEN, FFN
    shapes = [(t, 3 * h, h), (t, h, h), (t, f, h), (t, h, f)]
    per_layer = sum(3 * (emulated(m, n, k) - bf16_gemm(m, n, k)) + 2 * quantize(m * k) + quantize(k * n) +
                    2 * quantize(m * n) for m, n, k in shapes)
    assert math.isclose(block.total - bf16.total, layers * 2 * per_layer, rel_tol=1e-9)  # 2 micro-batches
    assert any(a.startswith("FP8 (e4m3, blockwise)") for a in block.assumptions)


def test_mi300x_fp8_curve_is_amds_published_maximum():
    """MI300X's FP8 GEMM curve: at the shape of AMD's published max-achievable FP8 figure (ROCm blog "Measuring
    Max-Achievable FLOPs - Part 2", Table 1: 1,273 TFLOP/s at M=4096 N=3648 K=32896; its footnote prints 1,223.6)
    it gives that figure within the source's own 4% disagreement, never more at any size (a maximum), and at every
    size at most the bf16 curve's fraction (FP8 never reached twice bf16's rate there: 1,273 against 708); the plan
    names no bf16-curve fallback for it."""
    from omnitron.plan.device_rates import DeviceRates

    p = load("mi300x")
    flops = 2.0 * 4096 * 3648 * 32896
    published = 1273e12
    assert abs(p.peak["fp8"] * p.gemm_fp8(flops) / published - 1) <= 1 - 1223.6 / 1273  # table against footnote
    sizes = [10 ** (e / 4) for e in range(28, 60)]
    assert all(p.peak["fp8"] * p.gemm_fp8(f) <= published * 1.001 for f in sizes)
    assert all(p.gemm_fp8(f) <= p.gemm(f) for f in sizes)
    rates = DeviceRates(p, 8)
    rates.gemm_s("fp8", 8192, 8192, 8192)
    assert not any("no measured FP8 GEMM curve" in n for n in rates.notes)


def test_quantization_bytes_follow_the_model_dtype():
    """The quantization kernels read their source in the model's dtype (2 bytes under ``--bf16``, 4 without: the
    linears' inputs, weights and gradients are then fp32) and write FP8 whatever it is: per element, the amax
    reads the source; the per-tensor cast-transpose also writes the FP8 operand and its transpose (2 bytes); the
    block-wise cast the FP8 tensor and a 4-byte scale per 128 elements. Each priced at the H200's memory-bound rate
    of its own bytes, forward and backward (the per-tensor cast-transpose at the profile's fraction of it)."""
    from omnitron.commands.plan import settings_of
    from omnitron.plan.device_rates import DeviceRates
    from omnitron.plan.fp8 import AMAX, CAST, CAST_BLOCK

    p = load("h200")
    rates = DeviceRates(p, 8)
    n = random.randint(10**5, 10**8)
    base = {"model": "gpt2_tiny", "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 256,
            "fp8_format": "hybrid", "fp8_recipe": "tensorwise"}
    for wide, elem in (({"bf16": True}, 2), ({}, 4)):
        rates.bind(settings_of(base | wide))
        for op, written, rate in ((AMAX, 0, 1), (CAST, 2, p.fp8_cast_transpose or 1.0), (CAST_BLOCK, 1 + 4 / 128, 1)):
            nbytes = (elem + written) * n
            for mode in ("fwd", "bwd"):
                assert math.isclose(rates.elementwise_s(op, mode, n), nbytes / (p.memory_bw * p.memory(nbytes) * rate),
                                    rel_tol=1e-12), (op, mode, elem)


def test_b200_fp8_curve_keeps_the_h200_margin_to_the_published_maximum():
    """B200's FP8 GEMM curve (the H200's measured one moved to B200's rate) against the maximum-achievable FP8
    matmul rates in Bekman's ML Engineering Open Book (B200 SXM 3,432.5 TFLOP/s at 15360x4096x3072, H200 SXM
    1,453.4 at 1280x4096x12032): at B200's best shape it never exceeds the published maximum, and falls below it
    by no more than the H200's measured curve falls below the H200's maximum, widened by the 7% spread of the
    H200's measured shapes at one FLOP count (0.60-0.68 around 0.63); at no size is an FP8 GEMM slower than the
    bf16 one of the same FLOPs; the plan names no bf16-curve fallback for B200."""
    from omnitron.plan.device_rates import DeviceRates

    b200, h200 = load("b200"), load("h200")
    margin_h200 = h200.peak["fp8"] * h200.gemm_fp8(2.0 * 1280 * 4096 * 12032) / 1453.4e12
    assert 0.85 < margin_h200 < 1.0  # the H200's measured curve is itself under its published maximum
    margin_b200 = b200.peak["fp8"] * b200.gemm_fp8(2.0 * 15360 * 4096 * 3072) / 3432.5e12
    assert margin_h200 - 0.07 <= margin_b200 <= 1.0
    sizes = [10 ** (e / 4) for e in range(28, 60)]
    assert all(b200.peak["fp8"] * b200.gemm_fp8(f) <= 3432.5e12 for f in sizes)
    assert all(b200.peak["fp8"] * b200.gemm_fp8(f) >= 0.999 * b200.peak["bf16"] * b200.gemm(f) for f in sizes)
    rates = DeviceRates(b200, 8)
    rates.gemm_s("fp8", 8192, 8192, 8192)
    assert not any("no measured FP8 GEMM curve" in n for n in rates.notes)
