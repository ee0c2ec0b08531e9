"""The speed model's host term, the engine's attention with dropout and the MoE dispatch rows.

* a report's ``host_layer`` rows add, per layer and micro-batch, what they exceed the small layer's priced work
  by: on a CPU to the step; on an accelerator the host runs ahead and a layer takes the longer of the two;
* with the engine's attention measured with dropout, attention with ``--attention-dropout`` is priced from those
  rows and its probabilities' dropout is not priced again as an element-wise op; older reports keep the math
  path plus the separate dropout;
* ``moe_dispatch`` rows price the MoE dispatch; older reports price it as three ``add`` passes (noted).
"""
from __future__ import annotations

import random

import pytest


def _settings(**model):
    from omnitron.core.training.arguments import parse_settings

    flags = ["--model", "gpt2_tiny", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
             "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
             "--global-batch-size", "8", "--threads-per-process", "1"]
    for k, v in model.items():
        flags += [f"--{k.replace('_', '-')}", str(v)]
    return parse_settings(flags, 1)


def _elementwise(rng, host_f: float | None, host_b: float | None) -> list[dict]:
    """Random linear element-wise rows of every op, and ``host_layer`` rows of the given ms."""
    from omnitron.bench.elementwise import HOST_LAYER, OPS

    rows = []
    for op in OPS:
        if op == "host_layer":
            continue
        per = rng.uniform(1e-7, 1e-6)  # ms per element
        for n in (1024, 1 << 20):
            for mode in ("fwd", "bwd", "step"):
                rows.append({"op": op, "mode": mode, "elements": n, "ms": per * n, "width": 256, "dtype": "float32"})
    n = HOST_LAYER["tokens"] * HOST_LAYER["hidden"]
    for mode, ms in (("fwd", host_f), ("bwd", host_b)):
        if ms is not None:
            rows.append({"op": "host_layer", "mode": mode, "elements": n, "ms": ms, "width": 256, "dtype": "float32"})
    return rows


def _rates(tmp_path, constant_reports, bench_report, rows, device="cpu"):
    import json

    from omnitron.plan.rates import Rates

    paths = constant_reports(tmp_path, 1.0, 0.1) + [bench_report(tmp_path, "elementwise", rows)]
    if device != "cpu":
        for p in paths:
            rep = json.load(open(p))
            rep["machine"]["device_type"] = device
            json.dump(rep, open(p, "w"))
    return Rates.from_reports(paths)


def test_host_rows_add_their_excess_per_layer_and_micro_batch(tmp_path, constant_reports, bench_report):
    from omnitron.plan.speed import host_layer, predict

    rng = random.Random()
    seed = rng.randrange(1 << 30)
    s = _settings()
    base = _rates(tmp_path, constant_reports, bench_report, _elementwise(random.Random(seed), None, None))
    assert host_layer(base, 1) == (0.0, 0.0)
    assert any("host_layer" in n for n in base.notes)
    # rows far above the small layer's priced work (constant 1 TFLOP/s GEMMs: microseconds)
    f, b = rng.uniform(5, 20), rng.uniform(5, 20)
    rates = _rates(tmp_path, constant_reports, bench_report, _elementwise(random.Random(seed), f, b))
    hf, hb = host_layer(rates, 1)
    priced_f, priced_b = f * 1e-3 - hf, b * 1e-3 - hb  # what the rates price the small layer's work at
    assert 0 < priced_f < 1e-3 * f and 0 < priced_b < 1e-3 * b
    # the same rows a known amount higher: the excess moves by exactly that amount
    d = rng.uniform(1, 3)
    more = _rates(tmp_path, constant_reports, bench_report, _elementwise(random.Random(seed), f + d, b + d))
    assert host_layer(more, 1) == pytest.approx((hf + d * 1e-3, hb + d * 1e-3), rel=1e-9)
    # every layer of every micro-batch pays it once forward and once backward (one process: no bubble, no dp)
    cfg_layers, m = s.model.num_layers, s.num_microbatches
    step = predict(s, more).total - predict(s, rates).total
    assert step == pytest.approx(cfg_layers * m * 2 * d * 1e-3, rel=1e-6)
    assert predict(s, more).host == pytest.approx(cfg_layers * m * (hf + hb + 2 * d * 1e-3), rel=1e-6)


def test_an_accelerator_runs_the_host_ahead(tmp_path, constant_reports, bench_report):
    """A host cost under the device's work is hidden; one above it sets the layer's time."""
    from omnitron.plan.speed import host_layer, predict

    seed = random.randrange(1 << 30)
    s = _settings()
    # 30 us a layer each way: above the small layer's priced work, below a gpt2_tiny layer's ~50 us of GEMMs
    # forward at the constant 1 TFLOP/s (2 x 128 tokens x 128 x 1536 weights)
    small = _rates(tmp_path, constant_reports, bench_report, _elementwise(random.Random(seed), 0.03, 0.03), "cuda")
    none = _rates(tmp_path, constant_reports, bench_report, _elementwise(random.Random(seed), None, None), "cuda")
    assert min(host_layer(small, 1)) > 0
    assert predict(s, small).total == pytest.approx(predict(s, none).total, rel=1e-9)
    huge = _rates(tmp_path, constant_reports, bench_report, _elementwise(random.Random(seed), 1e4, 1e4), "cuda")
    layers, m = s.model.num_layers, s.num_microbatches
    assert predict(s, huge).total > layers * m * 2 * 9.9  # seconds: the host's 10 s a layer each way


def test_attention_dropout_rows_replace_the_separate_dropout(tmp_path, constant_reports, bench_report):
    """The engine's op measured with dropout at rate R: attention with dropout costs flops / R, and the
    probabilities' dropout is not priced again (doubling the dropout rate moves only the hidden dropouts)."""
    from omnitron.plan import work
    from omnitron.plan.memory import model_config
    from omnitron.plan.rates import Rates
    from omnitron.plan.speed import _layer

    rng = random.Random()
    r_drop, r_plain = rng.uniform(0.5, 2.0), rng.uniform(3.0, 6.0)  # TFLOP/s
    att = [{"impl": "op:reference", "dtype": "float32", "seq": sq, "heads": 2, "head_dim": 8, "causal": True,
            "batch": 1, "dropout": p, "ms": 1.0, "tflops": r_drop if p else r_plain}
           for sq in (16, 256) for p in (0.0, 0.1)]
    att += [{"impl": "math", "dtype": "float32", "seq": sq, "heads": 2, "head_dim": 8, "causal": True, "batch": 1,
             "dropout": 0.0, "ms": 1.0, "tflops": 9.0} for sq in (16, 256)]
    gemm = [{"dtype": "fp32", "shape": "square", "m": q, "n": q, "k": q, "ms": 1.0, "tflops": 1.0} for q in (64, 512)]
    ew = _elementwise(rng, None, None)
    paths = [bench_report(tmp_path, "gemm", gemm), bench_report(tmp_path, "attention", att)]
    rates = Rates.from_reports(paths + [bench_report(tmp_path, "elementwise", ew)])
    flops = rng.uniform(1e6, 1e9)
    assert rates.fused_attention_dropout()
    assert rates.attention_s("fp32", flops, True) == pytest.approx(flops / (r_drop * 1e12), rel=1e-9)
    assert rates.attention_s("fp32", flops, False) == pytest.approx(flops / (r_plain * 1e12), rel=1e-9)
    s = _settings(attention_dropout=0.1, hidden_dropout=0.1)
    cfg = model_config(s)
    x = work.local_shapes(cfg, 1, 1, s.training.micro_batch_size)
    twice = [dict(r, ms=2 * r["ms"]) if r["op"] == "dropout" else r for r in ew]
    again = Rates.from_reports(paths + [bench_report(tmp_path, "elementwise", twice)])
    stream = x.tokens * x.hidden
    hidden = 2 * sum(rates.elementwise_s("dropout", mode, stream) for mode in ("fwd", "bwd"))
    moved = sum(_layer(s, cfg, again, False).f.values()) + sum(_layer(s, cfg, again, False).b.values()) - (
        sum(_layer(s, cfg, rates, False).f.values()) + sum(_layer(s, cfg, rates, False).b.values()))
    assert moved == pytest.approx(hidden, rel=1e-9)  # the two hidden dropouts' cost again, nothing more
    # an older report (no dropout rows): the math path, and its dropout priced separately
    old = [dict(r) for r in att if not r["dropout"]]
    for r in old:
        r.pop("dropout")
    older = Rates.from_reports([paths[0], bench_report(tmp_path, "attention", old),
                                bench_report(tmp_path, "elementwise", ew)])
    assert not older.fused_attention_dropout()
    assert older.attention_s("fp32", flops, True) == pytest.approx(flops / 9e12, rel=1e-9)


def test_moe_dispatch_rows_and_their_stand_in(tmp_path, bench_report):
    from omnitron.plan.rates import Rates

    rng = random.Random()
    ew = _elementwise(rng, None, None)
    rates = Rates.from_reports([bench_report(tmp_path, "gemm", [{"dtype": "fp32", "shape": "square", "m": 64,
                                                                 "n": 64, "k": 64, "ms": 1.0, "tflops": 1.0}]),
                                bench_report(tmp_path, "elementwise", ew)])
    n = rng.uniform(1e4, 1e6)
    per = {r["op"]: r["ms"] / r["elements"] for r in ew if r["mode"] == "fwd"}
    assert rates.elementwise_s("moe_dispatch", "fwd", n) == pytest.approx(per["moe_dispatch"] * n * 1e-3, rel=1e-9)
    older = Rates.from_reports([bench_report(tmp_path, "gemm", [{"dtype": "fp32", "shape": "square", "m": 64, "n": 64,
                                                                 "k": 64, "ms": 1.0, "tflops": 1.0}]),
                                bench_report(tmp_path, "elementwise", [r for r in ew if r["op"] != "moe_dispatch"])])
    assert older.elementwise_s("moe_dispatch", "fwd", n) == pytest.approx(3 * per["add"] * n * 1e-3, rel=1e-9)
    assert any("moe_dispatch" in note for note in older.notes)


def test_measured_core_sharing_slows_each_rank(tmp_path, constant_reports, bench_report):
    """``host_gemm`` / ``host_stream`` rows set the slow-down of each rank's GEMMs / element-wise work: linear
    between the measured rank counts from 1.0 at one rank, times the further time-sharing past the largest."""
    import json

    from omnitron.plan.rates import Rates
    from omnitron.plan.speed import _threads

    rng = random.Random()
    g2, g4, s2 = rng.uniform(1.1, 1.9), rng.uniform(2.0, 3.0), rng.uniform(1.1, 1.9)
    paths = constant_reports(tmp_path, 1.0, 0.1)
    comm = json.load(open(paths[2]))
    comm["rows"] += [{"op": "host_gemm", "bytes": 0, "ranks": n, "ms": 1.0, "alone_ms": 1.0, "slowdown": v,
                      "algbw_gbs": 0.0, "busbw_gbs": 0.0}
                     for n, v in ((2, g2), (4, g4))]
    comm["rows"].append({"op": "host_stream", "bytes": 0, "ranks": 2, "ms": 1.0, "alone_ms": 1.0, "slowdown": s2,
                         "algbw_gbs": 0.0, "busbw_gbs": 0.0})
    json.dump(comm, open(paths[2], "w"))
    rates = Rates.from_reports(paths)  # 8 cores
    assert rates.host_slowdown("host_gemm", 1) == 1.0
    assert rates.host_slowdown("host_gemm", 3) == pytest.approx((g2 + g4) / 2, rel=1e-12)
    assert rates.host_slowdown("host_gemm", 16) == pytest.approx(g4 * 2, rel=1e-12)  # 16 threads on 8 cores
    assert rates.host_slowdown("host_stream", 2) == pytest.approx(s2, rel=1e-12)
    s = _settings()
    s2_settings = dataclass_replace_world(s, 2)
    assert _threads(s2_settings, rates)[1] == pytest.approx(g2, rel=1e-12)
    assert _threads(s2_settings, rates, "host_stream")[1] == pytest.approx(s2, rel=1e-12)
    assert Rates.from_reports(constant_reports(tmp_path, 1.0, 0.1)).host_slowdown("host_gemm", 2) is None


def dataclass_replace_world(settings, world: int):
    """``settings`` re-parsed for ``world`` ranks (data parallel), one intra-op thread a rank."""
    from omnitron.core.training.arguments import parse_settings

    flags = ["--model", "gpt2_tiny", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
             "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
             "--global-batch-size", "8", "--threads-per-process", "1"]
    return parse_settings(flags, world)
