"""The speed model's terms against independent computations: GEMM and attention FLOPs against
``torch.utils.flop_counter`` on a real forward + backward of a random small model, the pipeline term against the
textbook bubble, the rate interpolation against rows of known rates, and the step against a hand sum."""
from __future__ import annotations

import random

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from omnitron.plan import work


def _random_cfg(rng: random.Random, **over):
    from omnitron.core.models.gpt.presets import gpt2_tiny

    heads = rng.choice([2, 4])
    swiglu = rng.random() < 0.5
    return gpt2_tiny(num_layers=rng.choice([1, 2, 3]), hidden_size=heads * rng.choice([8, 16]),
                     num_attention_heads=heads, num_query_groups=rng.choice([None, heads // 2]),
                     ffn_hidden_size=rng.choice([48, 80]), seq_length=rng.choice([16, 32]),
                     vocab_size=rng.choice([50, 77]),
                     swiglu=swiglu, normalization="RMSNorm" if swiglu else "LayerNorm", hidden_dropout=0.0, **over)


def _counted(cfg, b: int) -> dict:
    """FLOPs per aten op of one forward + backward of ``cfg``'s model (one process) at micro-batch ``b``."""
    from omnitron.core.models.gpt import GPTModel
    from omnitron.core.parallel.groups import ParallelGroups

    m = GPTModel(cfg, ParallelGroups.single())
    s = cfg.seq_length
    tokens = torch.randint(0, cfg.vocab_size, (b, s))
    with FlopCounterMode(display=False) as fc:
        loss = m(tokens=tokens, position_ids=torch.arange(s).expand(b, s), labels=tokens)
        loss.float().sum().backward()
    return {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}


def test_gemm_and_attention_flops_match_the_flop_counter():
    """Exact (integer FLOP counts): every linear layer's GEMM appears as mm / addmm, 3x forward; the math
    attention path (attention dropout on) computes the whole score matrix as bmm, twice the causal count."""
    rng = random.Random()
    cfg = _random_cfg(rng, attention_dropout=0.1)
    b = rng.choice([1, 2])
    got = _counted(cfg, b)
    x = work.local_shapes(cfg, 1, 1, b)
    gemm = cfg.num_layers * work.gemm_flops(work.layer_gemms(x)) + work.gemm_flops([work.head_gemm(x)])
    assert got.get("aten.mm", 0) + got.get("aten.addmm", 0) == 3 * gemm, cfg
    assert got["aten.bmm"] == 3 * 2 * cfg.num_layers * work.attention_flops(x), cfg


def test_tp_and_cp_split_the_work_evenly():
    """A tp x cp rank does 1 / (tp cp) of a layer's GEMM and attention FLOPs (heads, groups, ffn divisible)."""
    from omnitron.core.models.gpt.presets import gpt2_tiny

    cfg = gpt2_tiny(num_query_groups=2, swiglu=True)
    one = work.local_shapes(cfg, 1, 1, 2)
    for tp, cp in ((2, 1), (1, 2), (2, 2), (2, 4)):
        x = work.local_shapes(cfg, tp, cp, 2)
        assert work.gemm_flops(work.layer_gemms(x)) * tp * cp == work.gemm_flops(work.layer_gemms(one))
        assert work.attention_flops(x) * tp * cp == work.attention_flops(one)


def test_layer_params_match_the_model():
    """One layer's parameters (tp 1) against the parameters of a real layer module."""
    from omnitron.core.models.gpt import GPTModel
    from omnitron.core.parallel.groups import ParallelGroups

    cfg = _random_cfg(random.Random())
    m = GPTModel(cfg, ParallelGroups.single())
    layer = next(iter(m.decoder.layers.values()))
    assert work.layer_params(cfg, 1) == sum(p.numel() for p in layer.parameters())


def test_interpolation_reads_the_rows(tmp_path, bench_report):
    """Log-log between GEMM rows by FLOPs (a rate doubling per 8x FLOPs gives sqrt(2) at 2^1.5 x), clamped
    outside; collectives piecewise linear in bytes, extrapolated with the last slope."""
    from omnitron.plan.rates import Rates

    gemm = [{"dtype": "fp32", "shape": "s", "m": 64, "n": 64, "k": 64, "ms": 1, "tflops": 1.0},
            {"dtype": "fp32", "shape": "s", "m": 256, "n": 256, "k": 256, "ms": 1, "tflops": 2.0 ** 2}]
    comm = [{"op": "all_reduce", "bytes": nb, "ranks": 2, "ms": ms, "algbw_gbs": 0, "busbw_gbs": 0}
            for nb, ms in ((1000, 0.5), (3000, 1.5))]
    r = Rates.from_reports([bench_report(tmp_path, "gemm", gemm), bench_report(tmp_path, "comm", comm)])
    f = 2.0 * 128 ** 3  # 8x the small row's FLOPs: half way in log space -> rate 2
    assert r.gemm_s("fp32", 128, 128, 128) == pytest.approx(f / 2e12, rel=1e-12)
    assert r.gemm_s("fp32", 32, 32, 32) == pytest.approx(2 * 32 ** 3 / 1e12, rel=1e-12)
    assert r.comm_s("all_reduce", 2000, 2) == pytest.approx(1e-3, rel=1e-12)
    assert r.comm_s("all_reduce", 5000, 2) == pytest.approx(2.5e-3, rel=1e-12)
    assert r.comm_s("all_reduce", 5000, 1) == 0.0


@pytest.mark.parametrize("pp,vp,m", [(2, 1, 4), (4, 1, 8), (4, 1, 5), (2, 2, 4), (4, 2, 8)])
def test_pipeline_bubble_is_the_textbook_one(pp, vp, m):
    """Equal stages: the schedule's makespan is m (F + B) + (pp - 1)(F + B) / vp (1F1B; interleaved with
    each chunk costing 1 / vp), the textbook (pp - 1) / (m vp) bubble; exact up to float sums (1e-9)."""
    from types import SimpleNamespace

    from omnitron.plan.speed import StageCost, pipeline

    rng = random.Random()
    f, b = rng.uniform(1, 2), rng.uniform(2, 4)
    costs = {}
    for k in range(pp * vp):
        costs[k] = StageCost()
        costs[k].f["compute"], costs[k].b["compute"] = f / vp, b / vp
    s = SimpleNamespace(parallel=SimpleNamespace(pipeline_model_parallel_size=pp,
                                                 virtual_pipeline_model_parallel_size=vp if vp > 1 else None),
                        training=SimpleNamespace(pipeline_schedule=None), num_microbatches=m)
    tl, _ = pipeline(s, costs, "none")
    assert tl.makespan == pytest.approx(m * (f + b) + (pp - 1) * (f + b) / vp, rel=1e-9)


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_pipeline_waits_for_overlapped_sends(pp):
    """One micro-batch through pp stages of random costs is one chain. Under ``none`` each stage's send is in its
    own F / B (a blocking send): the makespan is the sum of every stage's F and B. Under ``all`` the send is
    hidden behind the sender's work (max(work, send)) but the receiver starts only when the message is there,
    its transfer time after the sender's work ends: the same sum (every hop's transfer, pp - 1 each way)."""
    from types import SimpleNamespace

    from omnitron.plan.speed import StageCost, pipeline

    rng = random.Random()
    costs = {}
    for k in range(pp):
        costs[k] = c = StageCost()
        c.f["compute"], c.b["compute"] = rng.uniform(1, 2), rng.uniform(2, 4)
        c.f["pp"] = rng.uniform(0.1, 3.0) if k < pp - 1 else 0.0  # some sends outlast their pass's work
        c.b["pp"] = rng.uniform(0.1, 3.0) if k > 0 else 0.0
    s = SimpleNamespace(parallel=SimpleNamespace(pipeline_model_parallel_size=pp,
                                                 virtual_pipeline_model_parallel_size=None),
                        training=SimpleNamespace(pipeline_schedule=None), num_microbatches=1)
    work = sum(c.f["compute"] + c.b["compute"] for c in costs.values())
    hops = sum(c.f["pp"] + c.b["pp"] for c in costs.values())
    # rel 1e-12: the simulation adds the same <= 8 doubles in another order, a few ulps (2^-53 each) apart
    assert pipeline(s, costs, "none")[0].makespan == pytest.approx(work + hops, rel=1e-12)
    assert pipeline(s, costs, "all")[0].makespan == pytest.approx(work + hops, rel=1e-12)
    s.num_microbatches = 2 * pp  # under all the hops also stretch the steady state: never shorter than without
    base = {k: StageCost(f=dict(c.f, pp=0.0), b=dict(c.b, pp=0.0)) for k, c in costs.items()}
    assert pipeline(s, costs, "all")[0].makespan > pipeline(s, base, "all")[0].makespan


@pytest.mark.parametrize("name,pp,m", [("zb-v", 4, 16), ("dualpipe-v", 4, 8), ("dualpipe-v", 2, 4)])
def test_v_schedules_bubble_in_the_plan(name, pp, m):
    """The plan prices the V-shaped schedules on their own placement: chunks of equal cost (F = B = W = u
    per chunk, the plan's B/W halves) give a step of about 6m u plus the start-up of p - 1 forwards:
    theory_bubble within 2 points (ZB-V's table is built for a free stage-0 B, see vshape.py)."""
    from types import SimpleNamespace

    from omnitron.core.parallel.pipeline import theory_bubble
    from omnitron.plan.speed import StageCost, pipeline

    u = random.Random().uniform(1, 2)
    costs = {}
    for k in range(2 * pp):
        costs[k] = StageCost()
        costs[k].f["compute"], costs[k].b["compute"] = u, 2 * u
    s = SimpleNamespace(parallel=SimpleNamespace(pipeline_model_parallel_size=pp,
                                                 virtual_pipeline_model_parallel_size=2),
                        training=SimpleNamespace(pipeline_schedule=name), num_microbatches=m)
    tl, sched = pipeline(s, costs, "none")
    assert sched.style == "v"
    assert abs(1 - 6 * m * u / tl.makespan - theory_bubble(name, pp, m)) < 0.02


def test_step_is_the_sum_of_its_terms(tmp_path, constant_rates):
    """tp2 x pp2 x dp2 on constant rates: compute = 3x the FLOPs counted by hand at the rate, the tp and dp terms
    the bytes of :mod:`work` at the known ms / MB; the total = makespan + dp (no element-wise report)."""
    from omnitron.commands.plan import settings_of
    from omnitron.plan.memory import model_config
    from omnitron.plan.speed import predict, stage_params

    rates = constant_rates(tmp_path, 0.5, 2.0)
    s = settings_of({"model": "gpt2_tiny", "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 200,
                     "layout": "tp2,pp2,dp2", "global_batch_size": 8, "attention_dropout": 0.0})
    st = predict(s, rates)
    cfg = model_config(s)  # the tokenizer's vocabulary (200), not the preset's
    x = work.local_shapes(cfg, 2, 1, 1)
    m = s.num_microbatches
    last = 2 * work.gemm_flops(work.layer_gemms(x)) + 2 * work.attention_flops(x) + work.gemm_flops([work.head_gemm(x)])
    assert st.compute == pytest.approx(m * 3 * last / 0.5e12, rel=1e-9)
    # the last stage: 2 layers x 4 all-reduces of [T, h], the logits' input gradient, the cross-entropy's 3 of [T]
    full = x.tokens * x.hidden * 4
    assert st.tp == pytest.approx(m * (2 * 4 * full + full + 3 * 4 * x.tokens) * 2e-9, rel=1e-9)
    # one bucket of fp32 gradients all-reduced over dp 2, and the tied embedding's [V_pad / tp, h] over 2 stages
    grads = max(stage_params(cfg, s, r, 2) for r in range(2)) * 4
    assert st.dp == pytest.approx((grads + 256 // 2 * cfg.hidden_size * 4) * 2e-9, rel=1e-9)
    assert st.total == pytest.approx(st.compute + st.tp + st.pp + st.dp + st.bubble, rel=1e-9)


@pytest.mark.parametrize("layout", ["tp2,pp2", "pp2", "tp2"])
def test_stage_params_are_the_gradient_buffers(layout):
    """The elements each stage all-reduces over dp: the gradient buffers the data-parallel wrapper lays out on the
    stage's meta skeleton (tests/plan/test_state.py checks those against real buffers); dp 1, so no padding."""
    from omnitron.commands.plan import settings_of
    from omnitron.plan.memory import chunk_layers, model_config
    from omnitron.plan.speed import stage_params
    from omnitron.plan.state import state_bytes

    rng = random.Random()
    s = settings_of({"model": "gpt2_tiny", "mock_data": True, "tokenizer_type": "NullTokenizer",
                     "vocab_size": rng.choice([200, 333]), "layout": layout,
                     "untie_embeddings_and_output_weights": rng.random() < 0.5})
    cfg = model_config(s)
    layers = chunk_layers(s, cfg)
    for r in range(s.parallel.pipeline_model_parallel_size):
        assert stage_params(cfg, s, r, layers[(r, 0)]) * 4 == state_bytes(s, cfg, r).grads, (layout, r)


def test_overlap_assumptions_only_hide_communication(tmp_path, constant_rates):
    """``dp`` hides gradient reduction, ``all`` also the pipeline sends (and cp's ring hops) but not tp's collectives,
    which the engine waits for where it issues them: each step is no longer than the one before and no shorter than
    the compute alone; the compute term is the same under every assumption. Buckets of 1000
    elements, so that each stage's reduction is ready in pieces over its backward (one bucket a stage, at the
    default size, is ready only at its end and hides nothing: tests/plan/test_dp_overlap.py)."""
    from omnitron.commands.plan import settings_of
    from omnitron.core.config.parallel import ConfigError
    from omnitron.plan.speed import predict

    rates = constant_rates(tmp_path, 0.5, 50.0)  # slow links: communication is most of the step
    s = settings_of({"model": "gpt2_tiny", "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 200,
                     "layout": "tp2,pp2,dp2", "global_batch_size": 8, "bucket_size": 1000})
    none, dp, every = (predict(s, rates, o) for o in ("none", "dp", "all"))
    assert none.total > dp.total >= every.total >= every.compute
    assert none.compute == dp.compute and dp.dp < none.dp and every.pp == 0.0 < none.pp
    assert every.tp == none.tp > 0
    assert "overlap: dp" in dp.assumptions[0]
    with pytest.raises(ConfigError, match="--assume-overlap 'some'"):
        predict(s, rates, "some")


@pytest.mark.parametrize("m", [2, 5])
def test_combined_pairs_hide_the_all_to_alls_behind_the_other_pass(m):
    """``--overlap-moe-expert-parallel-comm`` without pipelining: the combined table F0 F1 B0 F2 B1 ... B(m-1)
    runs m - 1 pairs, each a forward with the backward before it, and in a pair each pass's all-to-alls run while
    the other computes: the forward's ``a_f`` is hidden up to the backward's work ``w_b``, the backward's ``a_b``
    up to the forward's ``w_f``. By hand: m (w_f + a_f + w_b + a_b) - (m - 1) (min(a_f, w_b) + min(a_b, w_f)),
    on random costs where the all-to-alls are now shorter, now longer than the other side's work; without the flag
    m (w_f + a_f + w_b + a_b). Exact up to float sums."""
    from types import SimpleNamespace

    from omnitron.plan.speed import StageCost, pipeline

    rng = random.Random()
    wf, wb, af, ab = (rng.uniform(0.5, 4) for _ in range(4))
    cost = StageCost()
    cost.f["compute"], cost.b["compute"], cost.f["ep"], cost.b["ep"] = wf, wb, af, ab
    cost.handed = {"F": af, "B": ab}  # all of ep the rows' all-to-alls (StageCost.handed: the pair hands over there)
    for flag in (False, True):
        s = SimpleNamespace(parallel=SimpleNamespace(pipeline_model_parallel_size=1,
                                                     virtual_pipeline_model_parallel_size=None,
                                                     overlap_moe_expert_parallel_comm=flag),
                            training=SimpleNamespace(pipeline_schedule="none"), num_microbatches=m)
        tl, sched = pipeline(s, {0: cost}, "none")
        hidden = (m - 1) * (min(af, wb) + min(ab, wf)) if flag else 0.0
        assert sched.combined == flag
        assert tl.makespan == pytest.approx(m * (wf + af + wb + ab) - hidden, rel=1e-12, abs=1e-12)
    tl, _ = pipeline(s, {0: cost}, "all")  # a pass's all-to-alls are not hidden behind its own work: the same pairs
    assert tl.makespan == pytest.approx(m * (wf + af + wb + ab) - hidden, rel=1e-12, abs=1e-12)


def _old_all(d: dict) -> float:
    """One pass under ``--assume-overlap all`` as it was fitted (before the engine's overlap model): every
    communication hidden behind the pass's work where shorter, ``max(work, tp + cp + pp + ep)``."""
    return max(d["compute"] + d["elementwise"] + d["host"], d["tp"] + d["cp"] + d["pp"] + d["ep"])


def test_megatron_overlap_is_the_old_all_on_dense_layouts(tmp_path, constant_rates):
    """``megatron`` (tp collectives hidden, as Megatron-LM's --tp-comm-overlap): on a dense layout without cp each
    pass of every stage costs ``max(work, tp + pp)`` (:func:`_old_all`, computed here from the stage's own terms),
    on random stage costs and on a real tp2 x pp2 x dp2 layout's; and its pipeline message arrives when the old
    ``all`` said: ``max(0, pp - max(0, comm - work))``. Exact (one max of the same sums)."""
    from omnitron.commands.plan import settings_of
    from omnitron.plan.speed import StageCost, _stage_costs

    rng = random.Random()
    costs = []
    for _ in range(20):
        c = StageCost()
        for d in (c.f, c.b):
            d.update({k: rng.uniform(0, 3) for k in ("compute", "elementwise", "host", "tp", "pp")})
        costs.append(c)
    rates = constant_rates(tmp_path, 0.5, rng.choice([0.5, 5.0, 50.0]))  # links fast to slow against the work
    s = settings_of({"model": "gpt2_tiny", "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 200,
                     "layout": "tp2,pp2,dp2", "global_batch_size": 8})
    real = list(_stage_costs(s, rates, "megatron")[2].values())
    # each stage sends one way (the first forward, the last backward) and runs tp collectives both ways; no cp, ep
    assert all(c.f["tp"] > 0 < c.f["pp"] + c.b["pp"] and c.f["cp"] == c.f["ep"] == c.b["cp"] == 0 for c in real)
    for c in costs + real:
        for kind, d in (("F", c.f), ("B", c.b)):
            assert c.total(kind, "megatron") == pytest.approx(_old_all(d), rel=1e-12)
            work_s = d["compute"] + d["elementwise"] + d["host"]
            old_lag = max(0.0, d["pp"] - max(0.0, d["tp"] + d["pp"] - work_s))
            assert c.lag(kind, "megatron") == pytest.approx(old_lag, rel=1e-12, abs=1e-15)


def test_megatron_overlap_differs_from_all_by_the_tp_time(tmp_path, constant_rates):
    """One stage (pp 1, dp 1: no pipeline sends, no bubble, no gradient reduction), tp2, links fast enough that the
    tp collectives are shorter than the work: ``all`` waits for them (the step = work + tp), ``megatron`` hides them
    (the step = work), so the two steps differ by exactly the tp time ``none`` reports (the bytes at the rate), and
    the two agree on every other term. Exact up to float sums."""
    from omnitron.commands.plan import settings_of
    from omnitron.plan.speed import _stage_costs, predict

    rng = random.Random()
    rates = constant_rates(tmp_path, 0.05, rng.uniform(0.005, 0.05))  # slow GEMMs, fast links
    s = settings_of({"model": "gpt2_tiny", "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 200,
                     "layout": "tp2", "global_batch_size": rng.choice([2, 4, 8])})
    none, every, meg = (predict(s, rates, o) for o in ("none", "all", "megatron"))
    (c,) = _stage_costs(s, rates, "all")[2].values()
    for d in (c.f, c.b):  # the regime this checks: each pass's tp shorter than its work
        assert 0 < d["tp"] < d["compute"] + d["elementwise"] + d["host"] and d["pp"] == 0
    assert every.total - meg.total == pytest.approx(none.tp, rel=1e-9)
    assert every.tp == pytest.approx(none.tp, rel=1e-12) and meg.tp == 0.0
    assert meg.compute == pytest.approx(every.compute, rel=1e-12) and meg.optimizer == every.optimizer
    assert "overlap: megatron" in meg.assumptions[0] and "--tp-comm-overlap" in meg.assumptions[0]
