"""``omnitron plan --device PROFILE``: layouts priced on a device profile without a bench report, the search kept
to tp inside a node, ``--json`` records with Megatron's FLOPs per device, and one-line errors."""
from __future__ import annotations

import json
import math

import pytest

from omnitron.cli import main

ARGV = ["--model", "gpt2_tiny", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
        "--seq-length", "64", "--max-position-embeddings", "64", "--global-batch-size", "16", "--bf16"]


def _megatron_flops(L: int, h: int, s: int, V: int, B: int) -> float:
    """Megatron-LM's model FLOPs of a GPT step (4h MLP, MHA, no recomputation): 72 B s L h^2 (1 + s / 6h + V / 12 L
    h)."""
    return 72.0 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))


def test_search_on_a_profile_writes_json(tmp_path, capsys):
    """8 devices on nodes of 2: every listed layout keeps tp <= 2, the output names the profile, and each JSON
    record's tflops_per_device is Megatron's FLOPs over its step time and the devices."""
    out = tmp_path / "plan.json"
    assert main(["plan", *ARGV, "--devices", "8", "--device", "h100-sxm", "--gpus-per-node", "2", "--top", "3",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "device: h100-sxm" in text and "2 per node" in text
    recs = json.loads(out.read_text())["layouts"]
    assert len(recs) == 3
    speeds = [r["tokens_per_s"] for r in recs]
    assert speeds == sorted(speeds, reverse=True)
    for r in recs:
        assert r["device"] == "h100-sxm" and r["gpus_per_node"] == 2 and r["world"] == 8
        assert "--tensor-model-parallel-size 1 " in r["launch"] or "--tensor-model-parallel-size 2 " in r["launch"]
        # the logits over the padded vocabulary, as Megatron counts them: NullTokenizer's 256 ids + end of
        # document = 257, padded to a multiple of 128 -> 384
        want = _megatron_flops(4, 128, 64, 384, 16) / r["step_s"] / 8 / 1e12
        assert math.isclose(r["tflops_per_device"], want, rel_tol=1e-9)
        assert math.isclose(r["tokens_per_s"], 16 * 64 / r["step_s"], rel_tol=1e-9)
        assert r["memory_per_stage"] and r["peak_gib"] == max(m["gib"] for m in r["memory_per_stage"])


def test_layout_on_a_profile_matches_the_memory_model(tmp_path, capsys):
    """``--layout`` with ``--device``: one record whose memory per stage is the memory model's own estimate."""
    from omnitron.commands.plan import settings_of
    from omnitron.plan.memory import estimate

    out = tmp_path / "one.json"
    assert main(["plan", *ARGV, "--layout", "tp2,pp2,dp2", "--device", "a100-80gb-sxm", "--json", str(out)]) == 0
    assert "device: a100-80gb-sxm" in capsys.readouterr().out
    (rec,) = json.loads(out.read_text())["layouts"]
    given = {"model": "gpt2_tiny", "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 256,
             "seq_length": 64, "max_position_embeddings": 64, "global_batch_size": 16, "bf16": True,
             "layout": "tp2,pp2,dp2"}
    stages = estimate(settings_of(given))
    assert [m["gib"] for m in rec["memory_per_stage"]] == [s.total / 2**30 for s in stages]
    assert rec["step_s"] > 0 and rec["layout"].startswith("tp2 pp2 cp1 dp2")


def test_bad_device_requests_get_one_line(capsys):
    for argv, needle in ((["--device", "h1000", "--layout", "tp2"], "shipped: a100-80gb-sxm"),
                         (["--device", "h200", "--bench", "x.json", "--layout", "tp2"], "x.json"),
                         (["--devices", "8"], "--device PROFILE")):
        assert main(["plan", *ARGV, *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err


@pytest.mark.slow  # ~60 s: every candidate's memory estimated for the exhaustive reference
def test_bounded_search_equals_the_exhaustive_one():
    """The cluster search prices exactly only what its bounds cannot rule out; its list must be the exhaustive
    one: every candidate priced, memory (the full model, backward's transients included) checked fastest first (a
    limit that makes some of the fastest not fit), block recomputations where their layout does not fit without."""
    from omnitron.plan.cluster import device_rates
    from omnitron.plan.memory import estimate
    from omnitron.plan.recommend import _blocks, candidates, recommend
    from omnitron.plan.speed import predict

    given = {"model": "gpt2_tiny", "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 256,
             "seq_length": 64, "max_position_embeddings": 64, "global_batch_size": 16, "bf16": True}
    rates = device_rates("a100-80gb-sxm", 2)
    every = candidates(given | {"nproc_per_node": 4}, 4, cluster=2)
    parent = {b.name(): c.name() for c in every for b in _blocks(c)}  # block recomputations, walked where
    every += [b for c in list(every) for b in _blocks(c)]  # their layout does not fit without
    for c in every:
        c.step = predict(c.settings, rates)
        c.stages = estimate(c.settings)
    every.sort(key=lambda c: -c.step.tokens_per_s)
    limit = sorted(c.peak for c in every[:4])[1]  # some of the four fastest do not fit
    fits = [c.name() for c in every if c.peak <= limit]
    want = [n for n in fits if parent.get(n) not in fits][:3]
    got = [c.name() for c in recommend(given, 4, limit, rates, top=3, cluster=2)]
    assert len(want) == 3
    assert got == want


def _accelerator_report(tmp_path, kind: str, rows: list[dict]) -> str:
    """A report of ``kind`` as if measured on an accelerator (the machine fields of a cpu one, retyped)."""
    from omnitron.backends import get_backend
    from omnitron.bench.report import new_report

    rep = new_report(kind, get_backend("cpu"), rows)
    rep["machine"]["device_type"] = "cuda"
    path = tmp_path / f"{kind}.json"
    path.write_text(json.dumps(rep))
    return str(path)


def test_bench_report_replaces_the_profile_where_it_has_rows(tmp_path, capsys):
    """``--device`` with ``--bench``: a GEMM of a measured dtype costs the report's rate, one of another dtype the
    profile's; a collective inside one node at a measured rank count costs the report's time, one spanning nodes
    the machine model's; a cpu report is refused in one line."""
    import random

    from omnitron.plan.cluster import device_rates
    from omnitron.plan.machine import span

    rng = random.Random()
    tf = rng.uniform(100, 500)  # the measured bf16 TFLOP/s at every size
    gemm = [{"dtype": "bf16", "shape": f"square:{n}", "m": n, "n": n, "k": n, "ms": 2 * n ** 3 / (tf * 1e9),
             "tflops": tf} for n in (1024, 8192)]
    ms = {b: rng.uniform(0.01, 5.0) for b in (1 << 20, 1 << 26)}
    comm = [{"op": "all_reduce", "bytes": b, "ranks": 8, "ms": t, "algbw_gbs": b / t / 1e6, "busbw_gbs": 1.0,
             "group": "intra", "local": 8, "nodes": 1} for b, t in ms.items()]
    paths = [_accelerator_report(tmp_path, "gemm", gemm), _accelerator_report(tmp_path, "comm", comm)]
    r = device_rates("h100-sxm", 8, paths)
    m, n, k = (rng.randint(512, 8192) for _ in range(3))
    assert math.isclose(r.gemm_s("bf16", m, n, k), 2 * m * n * k / (tf * 1e12), rel_tol=1e-9)
    plain = device_rates("h100-sxm", 8)
    assert r.gemm_s("fp16", m, n, k) == plain.gemm_s("fp16", m, n, k)  # not measured: the profile's curve
    r.sizes = plain.sizes = {"tp": 1, "dp": 8}
    assert math.isclose(r.comm_s("all_reduce", 1 << 26, 8, group="tp"), ms[1 << 26] * 1e-3, rel_tol=1e-9)
    across = r.comm_s("all_reduce", 1 << 26, 8, group="dp")  # stride 8: one device on each of 8 nodes
    assert across == r.machine.collective("all_reduce", 1 << 26, span(8, 8, 8))[0]
    assert main(["plan", *ARGV, "--layout", "tp2,dp4", "--device", "h100-sxm", "--bench", *paths]) == 0
    assert "measured rows from the bench report" in capsys.readouterr().out
    cpu = tmp_path / "cpu.json"
    from omnitron.backends import get_backend
    from omnitron.bench.report import new_report

    cpu.write_text(json.dumps(new_report("gemm", get_backend("cpu"), gemm)))
    assert main(["plan", *ARGV, "--layout", "tp2", "--device", "h100-sxm", "--bench", str(cpu)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "measured on a cpu" in err


def test_selective_recompute_repeats_the_attention_dropout():
    """Selective recomputation re-runs core attention with its dropout: on a profile (the scores materialised
    under --attention-dropout) the backward's element-wise time grows by one forward dropout pass over the
    ``[b, a/tp, s, s]`` probabilities, and its compute by the core attention's forward."""
    import random

    from omnitron.commands.plan import settings_of
    from omnitron.plan import speed
    from omnitron.plan.cluster import device_rates
    from omnitron.plan.memory import model_config

    tp, b = random.choice([1, 2, 4]), random.choice([1, 2])
    given = {"num_layers": 2, "hidden_size": 256, "num_attention_heads": 8, "seq_length": 512,
             "max_position_embeddings": 512, "tokenizer_type": "NullTokenizer", "vocab_size": 1000, "bf16": True,
             "attention_dropout": 0.1, "layout": f"tp{tp}", "micro_batch_size": b, "global_batch_size": b}
    costs = {}
    for rec in (None, "selective"):
        s = settings_of(given | ({"recompute_granularity": rec} if rec else {}))
        rates = device_rates("a100-80gb-sxm", 8)
        rates.bind(s)
        costs[rec] = speed.stage_cost(s, model_config(s), rates, [False], False, False, False, False)
        layer = speed._layer(s, model_config(s), rates, False)
    probs = b * (8 // tp) * 512 * 512
    want = rates.elementwise_s("dropout", "fwd", probs)
    assert math.isclose(costs["selective"].b["elementwise"] - costs[None].b["elementwise"], want, rel_tol=1e-9)
    assert layer.attention_f > 0 and layer.attention_ew_f == want
    assert math.isclose(costs["selective"].b["compute"] - costs[None].b["compute"], layer.attention_f, rel_tol=1e-9)
