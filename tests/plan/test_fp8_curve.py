"""FP8 in the planner: the H200 profile's FP8 GEMM curve against this project's recorded H200 measurements, the
speed model's FP8 step (its GEMMs at that curve, its casts as element-wise passes), and ``omnitron bench gemm``'s
FP8 rows timing the GEMM alone (they fed ``bench calibrate``'s ~2x "optimistic" reading)."""
from __future__ import annotations

import json
import math
import pathlib

import pytest
import torch

from omnitron.plan.profile import load

RESULTS = pathlib.Path(__file__).parents[2] / "benchmarks" / "results"
GEMMS = RESULTS / "h200-2026-12-04" / "fp8_gemm.json"
STEP_PROFILE = RESULTS / "h200-2026-12-04-s2" / "run1" / "profile-fp8-step-profile.json"
SHAPE_SPREAD = 0.08
"""Bound of one recorded GEMM against the curve: a curve by FLOPs gives one rate to every shape of equal FLOPs,
and the three recorded 6.87e10-FLOP shapes (fc1, fc2, fc1's weight gradient) lie within 7.4% of their mean."""
STEP_BOUND = 0.02
"""Bound of the whole step's FP8 GEMM time: the curve's last point was set to reproduce it (rounded to 3 places:
0.3% of the time), kept at 2% so a moved point shows."""


def _fp8_peak_rate(p, flops: float) -> float:
    return p.peak["fp8"] * p.gemm_fp8(flops)


def test_h200_fp8_curve_reproduces_the_recorded_gemms():
    """Each per-tensor ``torch._scaled_mm`` of ``benchmarks/fp8_gemm.py``'s 2026-12-04 H200 run (its JSON) within
    :data:`SHAPE_SPREAD` of the curve's rate at its FLOPs."""
    p = load("h200")
    rows = json.loads(GEMMS.read_text())["gemms"]
    assert len(rows) == 5
    for r in rows:
        flops = 2.0 * r["m"] * r["k"] * r["n"]
        measured = r["fp8_tensor_tflops"] * 1e12
        assert abs(_fp8_peak_rate(p, flops) / measured - 1) <= SHAPE_SPREAD, r["gemm"]


def test_h200_fp8_curve_reproduces_the_recorded_step():
    """The 1.3B compiled FP8 step's GEMMs (the recorded H200 profile: the FP8 ``nvjet_sm90_q*`` kernels over its
    two traced iterations) take the time the curve gives the step's GEMMs, listed from the model: per layer and
    micro-batch the four linear GEMMs forward and twice backward, at 8192 tokens."""
    from omnitron.core.models.family import get_family
    from omnitron.plan import work

    rec = json.loads(STEP_PROFILE.read_text())
    fp8 = [k for k in rec["top_kernels"] if k["name"].startswith("nvjet_sm90_q")]
    layers, micro_batches, iterations = 24, 4, len(rec["iterations"])
    cfg = get_family("gpt").presets["gpt_1p3b"]()
    assert cfg.num_layers == layers
    gemms = work.layer_gemms(work.local_shapes(cfg, 1, 1, 4))
    assert sum(k["calls"] for k in fp8) == iterations * layers * micro_batches * 3 * len(gemms)  # all of them listed
    measured = sum(k["total_ms"] for k in fp8) * 1e-3 / iterations
    p = load("h200")
    want = layers * micro_batches * 3 * sum(2.0 * m * n * k / _fp8_peak_rate(p, 2.0 * m * n * k)
                                            for _, m, n, k in gemms)
    assert abs(want / measured - 1) <= STEP_BOUND


@pytest.mark.parametrize("name", ["h200", "h100-sxm"])
def test_hopper_fp8_curve_stays_under_the_bf16_one(name):
    """At every size the FP8 curve's fraction of its doubled peak is at most the bf16 curve's (the measured FP8
    GEMMs never reached twice bf16's rate), and H100 carries H200's curve (its profile says why)."""
    p = load(name)
    sizes = [10 ** (e / 4) for e in range(28, 56)]
    assert all(p.gemm_fp8(f) <= p.gemm(f) for f in sizes)
    assert p.gemm_fp8 == load("h200").gemm_fp8


def _settings(fp8: bool):
    from omnitron.commands.plan import settings_of

    given = {"model": "gpt2_tiny", "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 256,
             "seq_length": 128, "max_position_embeddings": 128, "global_batch_size": 8, "micro_batch_size": 2,
             "bf16": True, "hidden_size": 512, "num_attention_heads": 8, "ffn_hidden_size": 2048, "num_layers": 3}
    if fp8:
        given |= {"fp8_format": "hybrid", "fp8_recipe": "tensorwise"}
    return settings_of(given)


def test_fp8_step_is_the_bf16_step_with_fp8_gemms_and_their_casts():
    """One stage on the H200's profile: the FP8 step less the bf16 step is, per layer and micro-batch, three times
    each linear GEMM's (FP8 - bf16) time (forward, input and weight gradient) plus the casts (input and weight
    forward, output gradient backward; each an amax kernel of 2 bytes an element and a cast-transpose of 4, at the
    memory-bound rate of its own bytes, the cast-transpose at the profile's measured fraction of it), worked here
    from the profile's tables; the output layer's GEMM stays bf16. One rates object prices both (its per-layer
    memo must tell them apart)."""
    from omnitron.plan.device_rates import DeviceRates
    from omnitron.plan.speed import predict

    p = load("h200")
    rates = DeviceRates(p, 8)
    bf16, fp8 = predict(_settings(False), rates), predict(_settings(True), rates)

    def gemm(peak, curve, elem, m, n, k):  # the roofline, by hand
        flops, nbytes = 2.0 * m * n * k, elem * (m * k + k * n + m * n)
        return max(flops / (peak * curve(flops)), nbytes / (p.memory_bw * p.memory(nbytes)))

    def stream(nbytes):
        return nbytes / (p.memory_bw * p.memory(nbytes))

    t, h, f = 2 * 128, 512, 2048
    shapes = [(t, 3 * h, h), (t, h, h), (t, f, h), (t, h, f)]  # qkv, proj, fc1, fc2: (m, n, k)
    def cast(elements):  # the amax kernel (2 bytes an element), then the cast-transpose (4) at its measured rate
        return stream(2 * elements) + stream(4 * elements) / (p.fp8_cast_transpose or 1.0)

    per_layer = sum(3 * (gemm(p.peak["fp8"], p.gemm_fp8, 1, *s) - gemm(p.peak["bf16"], p.gemm, 2, *s)) +
                    cast(s[0] * s[2]) + cast(s[2] * s[1]) + cast(s[0] * s[1]) for s in shapes)
    want = 3 * 4 * per_layer  # layers x micro-batches
    assert math.isclose(fp8.total - bf16.total, want, rel_tol=1e-9)
    assert any(a.startswith("FP8 (hybrid, tensorwise)") for a in fp8.assumptions)


def _rowwise_scaled_mm_runs() -> bool:
    """Whether ``torch._scaled_mm`` takes row-wise scales on the CPU (a 16x16 e4m3 GEMM, unit scales)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.float32)
        return True
    except RuntimeError:
        return False


def test_bench_gemm_fp8_rows_time_the_gemm_alone():
    """``omnitron bench gemm``'s per-tensor and row-wise FP8 closures dispatch nothing but ``torch._scaled_mm``
    (and views) on the native path: no reciprocal of the scales, no transposing copy of the right operand."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from omnitron.backends import get_backend
    from omnitron.bench.gemm import _fp8_call

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    provider = get_backend("cpu").fp8
    if not hasattr(torch, "_scaled_mm"):
        pytest.skip("no torch._scaled_mm in this torch")
    path, provider.path = provider.path, "scaled_mm"
    try:
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(64, 32, generator=g).bfloat16(), torch.randn(32, 48, generator=g).bfloat16()
        # torch 2.11's CPU _scaled_mm takes per-tensor scales only (row-wise: an internal assert; the provider
        # then runs the emulation, as it should); from 2.13 it takes row-wise scales too
        kinds = ("fp8-tensor", "fp8-row") if _rowwise_scaled_mm_runs() else ("fp8-tensor",)
        for kind in kinds:
            fn = _fp8_call(kind, a, b, provider)
            with Ops() as seen:
                fn()
            assert [o for o in seen.ops if o not in ("view", "t")] == ["_scaled_mm"], (kind, seen.ops)
    finally:
        provider.path = path


def test_calibrate_takes_fp8_rows_over_the_fp8_curve():
    """``omnitron.plan.calibrate`` on the H200 profile: a per-tensor FP8 GEMM row of a random size and rate is
    measured over the FP8 peak times the profile's FP8 curve at its FLOPs (what the plan prices FP8 GEMMs at), a
    bf16 row over the bf16 curve."""
    import random

    from omnitron.plan.calibrate import calibrate

    p = load("h200")
    m, n, k = (random.choice([1024, 2048, 4096, 8192]) for _ in range(3))
    t8, t16 = random.uniform(300, 1500), random.uniform(200, 800)
    rows = [{"dtype": "fp8-tensor", "m": m, "n": n, "k": k, "tflops": t8},
            {"dtype": "bf16", "m": m, "n": n, "k": k, "tflops": t16}]
    got = {r["kind"]: r["of_profile"] for r in calibrate(p, [{"kind": "gemm", "rows": rows}])["rows"]}
    flops = 2.0 * m * n * k
    assert got["gemm fp8-tensor"] == pytest.approx(t8 * 1e12 / (p.peak["fp8"] * p.gemm_fp8(flops)), rel=1e-12)
    assert got["gemm bf16"] == pytest.approx(t16 * 1e12 / (p.peak["bf16"] * p.gemm(flops)), rel=1e-12)
