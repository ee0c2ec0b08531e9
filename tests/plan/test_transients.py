"""The memory plan's step peak: the allocation log it replays, its scaling from probes, and whole training
steps against what they really allocate.

References: a hand-written allocation sequence (the log); the same chunk logged at its real size (the
scaling, which is exact when every storage's bytes are a monomial in the probe's dimensions, as a dense
layer's are: equal to the byte); ``PeakTracker`` over a real ``train_step`` at its real size (the whole
step).
"""
from __future__ import annotations

import json
import os
import random
import weakref
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from omnitron.testing.distributed import run_distributed


def test_timeline_logs_new_storages_and_their_frees():
    from omnitron.plan.transients import Timeline, peak

    old = torch.randn(1000)
    tl = Timeline()
    with tl:
        a = old * 2.0  # new: 4000 bytes
        v = a.view(10, 100)  # a view: nothing new
        old.add_(1.0)  # in place on a pre-existing storage: nothing
        b = torch.randn(500)  # new: 2000
        del a
        c = torch.randn(1000)  # new; the allocator may hand out a's address again: still new
        del v
        d = c + 1.0  # new: 4000, while c is live: 10000 in all
        del b, c, d
    ops = [(op is not None, n) for op, n in tl.events]
    assert ops == [(True, 4000), (True, 2000), (True, 4000), (False, 0), (True, 4000), (False, 1), (False, 2),
                   (False, 4)], tl.events
    assert peak(tl.events) == 10000
    assert peak(tl.events, [1.0, 0, 2.0, 0, 4.0, 0, 0, 0]) == 6.0  # replayed with other sizes


_GPT = dict(num_layers=4, hidden_size=512, num_attention_heads=32, ffn_hidden_size=2048, seq_length=96,
            max_position_embeddings=96, vocab_size=300)
_LLAMA = dict(num_layers=4, hidden_size=512, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=1408,
              seq_length=80, max_position_embeddings=80, vocab_size=300, normalization="RMSNorm",
              swiglu=True, position_embedding_type="rope", add_bias_linear=False,
              untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
              recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


_MLA = dict(num_layers=4, hidden_size=512, num_attention_heads=8, ffn_hidden_size=1024, seq_length=64,
            max_position_embeddings=64, vocab_size=300, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
            position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0, multi_latent_attention=True,
            q_lora_rank=64, kv_lora_rank=32, qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=32, qk_layernorm=True)


@pytest.mark.parametrize("fields,b,first,last", [
    pytest.param(_GPT, 2, True, True, id="gpt-whole"), pytest.param(_GPT, 2, False, False, id="gpt-middle"),
    pytest.param(_LLAMA, 3, True, False, id="llama-full-recompute-first"),
    pytest.param(_LLAMA, 3, False, True, id="llama-full-recompute-last"),
    pytest.param({**_LLAMA, "num_query_groups": 1}, 2, True, True, id="llama-one-group-logged-at-two"),
    pytest.param(_MLA, 2, False, True, id="mla-latents-with-the-heads")])
def test_scaled_probe_replay_equals_the_real_chunk(fields, b, first, last):
    """Probed at half the width (gpt: heads / 2; llama, GQA: head dimension / 2; MLA: heads and latent ranks / 2,
    head dimensions kept), sequence 32, batch 2, vocabulary 128, then scaled: the peak equals the chunk's own log
    at its real size."""
    from omnitron.core.models.gpt.config import GPTConfig, padded_vocab_size
    from omnitron.plan.activations import probe_config
    from omnitron.plan.transients import _B0, _S0, Probe, peak, scaled_peak, timeline

    cfg = GPTConfig(**fields)
    probe, kh, kd = probe_config(cfg, 1)
    assert kh * kd > 1  # the probe is narrower than the model
    v = padded_vocab_size(cfg, 1)
    got = scaled_peak(Probe(probe, 2, first, last, _S0, _B0), cfg.seq_length, b, kh, kd, v)
    real = replace(cfg, vocab_size=v, make_vocab_size_divisible_by=v)
    want = peak(timeline(Probe(real, 2, first, last, cfg.seq_length, b)))
    assert got == pytest.approx(want, rel=1e-12, abs=0)


def test_scaled_moe_probe_replay_equals_the_real_chunk():
    """The MoE transient probe (every expert padded to ``T k / E`` rows: balanced routing) at half the heads and
    widths, experts and shared expert included, sequence 32, batch 2, scaled: the peak equals the same chunk's
    own log at its real size (the replay is exact when every storage is a monomial in the doubled dimensions)."""
    from omnitron.core.models.gpt.config import GPTConfig, padded_vocab_size
    from omnitron.plan.activations import probe_config
    from omnitron.plan.moe_activations import transient_probe
    from omnitron.plan.transients import _B0, _S0, Probe, peak, scaled_peak, timeline

    cfg = GPTConfig(**{**_GPT, "num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 1024,
                       "moe_shared_expert_intermediate_size": 512, "moe_aux_loss_coeff": 0.01})
    probe, kh, kd = probe_config(cfg, 1)
    assert kh * kd > 1
    v = padded_vocab_size(cfg, 1)
    got = scaled_peak(Probe(transient_probe(cfg, probe, kh * kd, 1, 1), 2, True, True, _S0, _B0), cfg.seq_length, 2,
                      kh, kd, v)
    real = transient_probe(cfg, replace(cfg, vocab_size=v, make_vocab_size_divisible_by=v), 1, 1, 1)
    want = peak(timeline(Probe(real, 2, True, True, cfg.seq_length, 2)))
    assert got == pytest.approx(want, rel=1e-12, abs=0)


def _args(root: str, extra: list[str]) -> list[str]:
    return ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
            "--max-position-embeddings", "128", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            "200", "--data-cache-path", os.path.join(root, "cache"), *extra]


def _check_step(args: list[str], world: int, measured: list[tuple[int, int]], rel: float = 0.0, slack: int = 0,
                load=None) -> None:
    """Predicted (activations + logits + recompute + transient + boundary + W inputs) against the measured step
    peak, each stage.

    Tolerance: two [s, b, h] fp32 tensors (128 KiB at b = 1) for what the step does besides the chunk's
    forward and backward that the probe replays (the loss's reduction, the gradient-norm and optimizer
    temporaries come after the peak and are smaller). A missed weight gradient (h x 4h: 256 KiB), an [s, b, V]
    logits gradient (100 KiB at b = 1, with its 64 KiB input gradient) or an attention-score tensor
    ([b, heads, s, s]: 256 KiB) is more. ``rel``: a relative bound instead, where more is not modelled;
    ``slack``: bytes more, where the measurement itself moves (named by the caller); ``load``: a routing
    histogram (the stage's busiest ep rank is predicted)."""
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.memory import estimate

    from omnitron.plan.fp8_memory import fp8_state_bytes
    from omnitron.plan.memory import model_config

    s = parse_settings(args, world)
    stages = estimate(s, load=load)
    b = s.training.micro_batch_size
    for stage, peak in measured:
        e = stages[stage]
        # what the step adds: under FP8 the weights' FP8 form too (quantized anew after the optimizer step changed
        # them), but not the delayed recipe's scaling state, made with the model
        pred = e.total - e.params - e.grads - e.optimizer - fp8_state_bytes(s, model_config(s), stage)
        print(f"stage {stage}: predicted {pred}, measured {peak}, error {(pred - peak) / peak:+.2%}")
        assert abs(pred - peak) <= max(2 * 128 * b * 128 * 4, rel * peak) + slack, (stage, pred, peak, e)


@pytest.mark.parametrize("extra", [[], ["--recompute-granularity", "full", "--recompute-method", "block",
                                        "--recompute-num-layers", "2"],
                                   ["--swiglu", "--num-experts", "8", "--moe-router-topk", "2",
                                    "--moe-shared-expert-intermediate-size", "64"]], ids=["tied", "full-block2", "moe"])
def test_step_peak_one_process(extra, tmp_path):
    """Also on sim: the probes' dropout saves the device's one-byte masks (before 2026-12-06 the host's fp32 ones,
    the prediction 15% above the step peak there), and the probes run the kernels sim resolves where the host has
    them (``plan/measure.py``'s ``_backend_kernels``: its reference SwiGLU; the MoE case 7.1% under on sim before
    2026-12-07, -0.05% since)."""
    from omnitron.plan.measure import train_step_peak

    args = _args(str(tmp_path), extra)
    torch.set_num_threads(1)
    _check_step(args, 1, [train_step_peak(args, 1, str(tmp_path))])


def step_peaks(argvs: list[list[str]], world: int, root: str) -> list[tuple[int, int]]:
    """:func:`omnitron.plan.measure.train_step_peak` of each run in turn, in one world (spawns cost seconds)."""
    from omnitron.plan.measure import train_step_peak

    return [train_step_peak(argv, world, root) for argv in argvs]


_TENSORWISE = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
_BLOCKWISE = ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]
_FULL8 = ["--num-layers", "8", "--recompute-granularity", "full", "--recompute-method", "uniform",
          "--recompute-num-layers", "1"]


@pytest.mark.parametrize("schedule,more", [
    ("1f1b", []), pytest.param("interleaved", [], marks=pytest.mark.slow), ("zb-h1", []), ("zb-v", []),
    pytest.param("dualpipe-v", [], marks=pytest.mark.slow),
    pytest.param("zb-h1", _FULL8, id="zb-h1-full-recompute", marks=pytest.mark.slow),  # 8 layers: 20-30 s
    pytest.param("zb-h1", _TENSORWISE, id="zb-h1-fp8-tensorwise"),
    pytest.param("zb-v", _BLOCKWISE + ["--bf16"], id="zb-v-fp8-blockwise-bf16")])
def test_step_peak_pipeline_two_ranks(schedule, more, tmp_path):
    """pp2, 1F1B (stage 0 holds two micro-batches in flight), interleaved over two one-layer chunks per rank, or
    the schedules that split the backward into B and W: ZB-H1 (rank r holds up to 2p-1-r micro-batches between F
    and W), ZB-V and DualPipeV (two one-layer chunks per rank in a V), at 4 and at 16 micro-batches of 2,
    Llama-style layers; measured without the suite's strict collective checking, whose own buffers a training run
    does not have. Bound: the issue's 10% goal, at both counts: the runtime releases sent tensors and outputs, so
    16 micro-batches hold what 4 do. With micro-batches in flight the model adds each one's saved tensors, and one
    boundary tensor for the send in flight, but not what else the runtime keeps of them (rope tables, received
    buffers: about two [s, b, h] tensors more on stage 0 here, 1.3%); one layer's saved tensors missed per
    micro-batch (17%), the 2m boundary tensors the runtime kept to the end of the step before (measured 2026-12-03:
    15% above the prediction on stage 1 at m = 16 under 1F1B, 24% interleaved), or the gradients a split backward
    keeps from B to W (``w_inputs``; left out, measured 2026-12-06: the prediction 28% under the step peak on ZB-H1's
    stage 1 and 13% under on ZB-V's stage 0, at both counts) fails it. ZB-H1 under full recomputation, 4 layers a
    stage: B's rerun of each layer keeps the weight boundaries' saved tensors for W (tensor/recompute.py; W ran
    one rerun per boundary before, 109 MB measured on stage 1 against 24.7 MB now), priced from probes at 1 and 2
    layers. FP8 (fp32 tensorwise on ZB-H1, bf16 block-wise on ZB-V): W holds B's quantized output gradient
    (``core/precision/fp8/linear.py``), while B holds the wide one beside it until B ends; measured 2026-12-07
    within 2.6% on every stage for tensorwise / delayed / block-wise, bf16 and fp32 (the W inputs priced wide
    before: up to 6.2% over, within this bound: :func:`test_fp8_w_inputs_equal_what_the_split_backward_keeps`
    is the exact check). Also on sim since the probes run sim's reference RMSNorm, rope and SwiGLU
    (``_backend_kernels``): 1F1B's stage 0 12.7% and ZB-V FP8's 15.9% under there before (2026-12-07), every case
    and stage within 2.3% since."""
    extra = ["--pipeline-model-parallel-size", "2", "--micro-batch-size", "2", "--normalization", "RMSNorm", "--swiglu",
             "--position-embedding-type", "rope", "--disable-bias-linear", "--pipeline-schedule", schedule, *more]
    two_chunks = schedule in ("interleaved", "zb-v", "dualpipe-v")
    extra += ["--num-layers-per-virtual-pipeline-stage", "1"] if two_chunks else []
    argvs = [_args(str(tmp_path), extra + ["--global-batch-size", str(2 * m)]) for m in (4, 16)]
    measured = run_distributed(step_peaks, 2, argvs, 2, str(tmp_path), env={"OMNITRON_STRICT_COLLECTIVES": "0"})
    for i, args in enumerate(argvs):
        _check_step(args, 2, [rank[i] for rank in measured], rel=0.10)


_MOE = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
        "--num-experts", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]


@pytest.mark.slow
def test_step_peak_moe_two_ranks(tmp_path):
    """MoE layers on 2 ranks, every rank's step peak: ep2 with every expert padded to its capacity (each rank's
    rows are then the capacity's whatever the router picks, so the balanced-routing plan is exact), and tp2 + SP
    with etp2 (the ranks share their rows; the backward's etp all-gather buffers, 2 [R_e, h] fp32 = 256 KiB here,
    fail the bound when left out: measured 2026-12-04 5.4% under). Bound: ``_check_step``'s two [s, b, h] fp32
    tensors; at ep2 plus the forward exchange's send and receive buffers, ``2 [A, h]`` fp32 (A = s k = 256 rows,
    256 KiB): gloo's worker may drop them after ``wait`` returns, so the measured peak holds them or not (seen
    2026-12-04: the same run 0, 66 KiB or 230 KiB higher). Still fails on any per-assignment ``[A, h]`` tensor
    missed in the 4 layers (512 KiB). Dropless ep2 is not checked per rank: a rank's peak moves with the rows
    routed to it (+-5% here). Also on sim (``_backend_kernels``, 2026-12-07): ep2 11.4% under before, +0.01% since;
    tp2 + SP +1.2% (88 KiB over; +0.3% on cpu)."""
    argvs = [_args(str(tmp_path), _MOE + extra) for extra in (
        ["--expert-model-parallel-size", "2", "--moe-expert-capacity-factor", "1.0",
         "--moe-pad-expert-input-to-capacity"], ["--tensor-model-parallel-size", "2", "--sequence-parallel"])]
    measured = run_distributed(step_peaks, 2, argvs, 2, str(tmp_path), env={"OMNITRON_STRICT_COLLECTIVES": "0"})
    for i, (args, slack) in enumerate(zip(argvs, (2 * 256 * 128 * 4, 0))):
        _check_step(args, 2, [rank[i] for rank in measured], slack=slack)


def skewed_step_peak(argv: list[str], world: int, root: str, bias: list[float]) -> tuple[int, list[list[int]]]:
    """(this rank's step peak, each router's picks per expert in the measured step): ``bias`` on every router's
    expert bias (sigmoid scores lie in (0, 1): the biased expert wins most picks), its update off."""
    from omnitron.core.transformer.moe.router import TopKRouter
    from omnitron.plan.measure import train_step_peak

    picks = []

    def skew(c):
        routers = [m for mod in c.modules for m in mod.modules() if isinstance(m, TopKRouter)]
        for r in routers:
            r.expert_bias.copy_(torch.tensor(bias))
            r.bias_update_rate = 0.0
            r.register_forward_hook(lambda _m, _i, o: picks.append(torch.bincount(o[1].reshape(-1),
                                                                                  minlength=len(bias)).tolist()))
        skew.routers = len(routers)

    torch.set_num_threads(1)
    _, peak = train_step_peak(argv, world, root, skew)
    return peak, picks[-skew.routers:]  # one micro-batch a step, no recomputation: a forward per router


@pytest.mark.slow
def test_step_peak_busiest_ep_rank_under_skewed_routing(tmp_path):
    """ep2 dropless with a random expert biased (the engine's sigmoid selection with an expert bias): the rank
    holding it receives about 2/3 of the rows in every layer. The measured step's picks, summed over the two ranks
    (each routes its own micro-batch), are the histogram ``omnitron plan --moe-expert-load`` reads; the plan's
    stage figure is then the busiest ep rank's (the one measured highest). Bound, from what the model leaves out:
    ``_check_step``'s two [s, b, h] fp32 tensors plus the dispatch exchange's send and receive buffers ``(A + R) h``
    fp32 (A = s k = 256 rows sent, R the busiest rank's receipts; gloo may hold them at the peak or not, as in
    test_step_peak_moe_two_ranks) either way. Measured 2026-12-04 (BENCHMARKS.md) with the rank's local experts'
    backward at balanced rows: 0.3-3.4% under in four runs; priced at the rank's rows (omnitron/plan/moe_backward.py)
    +0.4% to +1.5% over in six runs (2026-12-04, 23:00 UTC). The balanced plan, or the rows at balanced, is 16-18%
    (3 MB) under: this fails (planted, 2026-12-04). Also on sim (``_backend_kernels``, 2026-12-07): 8.6% under
    before, +0.01% since."""
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.memory import estimate
    from omnitron.plan.routing import read_expert_load

    bias = [0.0] * 8
    bias[random.randrange(8)] = random.uniform(0.5, 0.8)
    args = _args(str(tmp_path), _MOE + ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                                        "--expert-model-parallel-size", "2"])
    got = run_distributed(skewed_step_peak, 2, args, 2, str(tmp_path), bias, env={"OMNITRON_STRICT_COLLECTIVES": "0"})
    hist = [[sum(rank[1][i][e] for rank in got) for e in range(8)] for i in range(len(got[0][1]))]
    path = tmp_path / "load.json"
    path.write_text(json.dumps({"tokens_per_expert": hist}))
    settings = parse_settings(args, 2)
    e = estimate(settings, load=read_expert_load(str(path)))[0]
    experts = e.transient - estimate(settings)[0].transient  # the experts' backward at the rank's rows, added
    peaks = [peak for peak, _ in got]
    busiest = peaks.index(max(peaks))
    h, A = 128, 128 * 2
    R = max(sum(row[r * 4:(r + 1) * 4]) for row in hist for r in (0, 1))
    bound = 2 * 128 * h * 4 + (A + R) * h * 4
    pred = e.activations + e.logits + e.recompute + e.transient + e.boundary
    print(f"skewed ep2: predicted {pred}, measured {peaks} (busiest {busiest}), experts' backward added {experts}, "
          f"error {(pred - peaks[busiest]) / peaks[busiest]:+.2%}, histogram {hist}")
    assert e.ep_rank == busiest and abs(pred - peaks[busiest]) <= bound, (pred, peaks, hist, e)


def test_probes_that_do_not_align_leave_the_transients_out_with_a_warning(monkeypatch, caplog):
    """When the doubled probes' logs differ the estimate still comes (saved tensors + one rematerialised chunk,
    the model before transients), with one warning naming the cause."""
    import omnitron.plan.transients as T
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.memory import estimate, recompute_bytes

    s = parse_settings(_args("/tmp", ["--recompute-granularity", "full", "--recompute-method", "uniform"]), 1)
    real = T.timeline

    def shifted(p):  # the sequence-doubled probe logs one more storage
        events = real(p)
        return events + [("aten.extra", 4)] if p.s == 2 * T._S0 else events

    monkeypatch.setattr(T, "timeline", shifted)
    with caplog.at_level("WARNING"):
        (stage,) = estimate(s)
    assert stage.transient == 0 and stage.recompute == recompute_bytes(s, s.model) > 0
    assert "allocations differ with the sequence doubled" in caplog.text


def _kept_for_w(cfg, layers: int, first: bool, last: bool, s: int, b: int, fp8=None) -> int:
    """Reference: the bytes the runtime's split backward keeps from its B to its W, counted at the chunk's real size
    by storage: the distinct storages of the plan's boundary gradients and of its output gradient
    (:mod:`omnitron.core.parallel.pipeline.wgrad`) and, with ``fp8`` (an ``FP8Config``: the chunk's linears in FP8, as
    training converts them), the operands B stashed on the FP8 linears' nodes for W (``split_backward.py``), less
    those the forward saved (the activation term's), the delayed recipe's scales (its state, the fp8 term's) and the
    cached FP8 weights (the fp8 term's).
    Under full recomputation also the values B's rerun left in the checkpoint's slots for W (``tensor/recompute.py``
    keeps a weight boundary's reads), the parameters it saves (their own storages) left out.
    Delayed: a step first, then the step's scale update, as every step of training after its first."""
    from omnitron.core.parallel.pipeline.wgrad import backward_input
    from omnitron.core.parallel.split_backward import _STASH
    from omnitron.core.parallel.tensor.recompute import _Frame
    from omnitron.core.precision.fp8.enable import enable_fp8, fp8_step
    from omnitron.plan.measure import SavedBytes
    from omnitron.plan.transients import Probe, _chunk

    m = _chunk(Probe(cfg, layers, first, last, s, b))
    enabled = enable_fp8(m, fp8, None, num_layers=cfg.num_layers, per_step=True) if fp8 is not None else {}
    params = [p for p in m.parameters() if p.requires_grad]
    torch.manual_seed(random.randrange(2**31))
    tokens = torch.randint(0, cfg.vocab_size, (b, s))
    x = None if first else torch.randn(s, b, cfg.hidden_size, dtype=cfg.params_dtype, requires_grad=True)

    def forward():
        y = m(tokens=tokens, position_ids=torch.arange(s).expand(b, s), hidden=x, labels=tokens if last else None)
        return y.float().mean() if last else y

    if fp8 is not None and fp8.fp8_recipe == "delayed":
        y = forward()
        y.backward(None if last else torch.randn_like(y))
        fp8_step(enabled)
    rec, slots, pack = SavedBytes(m.parameters()), [], _Frame.pack
    _Frame.pack = lambda frame, t: slots.append(weakref.ref(slot := pack(frame, t))) or slot  # this forward's
    try:
        with rec.record():
            y = forward()
    finally:
        _Frame.pack = pack
    _, plan = backward_input(y, None if last else torch.randn_like(y), x, params)
    stashed = [t for node, _ in plan.boundaries for ops in [getattr(node, _STASH, None)] if ops is not None
               for t in (*ops[0], ops[1])]
    weights = {p.untyped_storage().data_ptr() for p in m.parameters()}  # a rerun saves the parameters themselves
    reran = [slot.value for ref in slots for slot in [ref()] if slot is not None and slot.value is not None and
             slot.value.untyped_storage().data_ptr() not in weights]  # B's rerun's, kept for W
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in [plan.grad, *(g for gs in plan.kept.values() for g in gs), *stashed, *reran] if t is not None}
    state = {st.scale_inv.untyped_storage().data_ptr() for ex in enabled.values() for st in ex.states.values()}
    state |= {t.untyped_storage().data_ptr() for ex in enabled.values() if ex._wcache is not None  # the fp8 term's
              for t in ex._wcache[2] if isinstance(t, torch.Tensor)}  # cached FP8 weight a rerun saves again
    return sum(n for ptr, n in kept.items() if ptr not in rec.storages and ptr not in state)


@pytest.mark.parametrize("fields,b,layers,first,last", [
    pytest.param(_GPT, 2, 2, False, False, id="gpt-middle"), pytest.param(_GPT, 2, 3, False, True, id="gpt-last-3"),
    pytest.param(_GPT, 2, 2, True, False, id="gpt-first"), pytest.param(_LLAMA, 3, 2, False, False, id="llama-middle"),
    pytest.param({**_LLAMA, "recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None},
                 3, 3, False, True, id="llama-last-3")])
def test_w_inputs_equal_what_the_split_backward_keeps(fields, b, layers, first, last):
    """The plan's W inputs of one micro-batch (:func:`omnitron.plan.memory.w_input_bytes`: small probes run through
    the runtime's B, their logs scaled; three layers extrapolated from the probes at one and two) equal the storages
    the split backward keeps at the chunk's real size (:func:`_kept_for_w`), to the byte: every kept gradient is an
    ``[s, b, w]`` monomial. A GPT chunk's are by hand (fp32): each layer's linears' and norms' output gradients
    (``3h + h + ffn + h`` and ``2 h`` a token), the final norm's on the last chunk (a middle chunk's plan drops the
    received gradient after B: W starts at the boundaries); stage 0's plan runs the whole backward in W, keeping
    the received gradient only. Under full recomputation
    the probe also sees the CPU generator state full recomputation's RNG tracker clones in B (``torch.get_rng_state``,
    5056 bytes), which the reference, counting the plan's storages, does not: that much apart at most."""
    from types import SimpleNamespace

    from omnitron.core.models.gpt.config import GPTConfig, padded_vocab_size
    from omnitron.plan.memory import w_input_bytes

    cfg = GPTConfig(**fields)
    v = padded_vocab_size(cfg, 1)
    settings = SimpleNamespace(parallel=SimpleNamespace(tensor_model_parallel_size=1, context_parallel_size=1, etp=1),
                               training=SimpleNamespace(micro_batch_size=b))
    got = w_input_bytes(settings, cfg, layers, first, last)
    want = _kept_for_w(replace(cfg, vocab_size=v, make_vocab_size_divisible_by=v), layers, first, last,
                       cfg.seq_length, b)
    rng = torch.get_rng_state().nbytes if cfg.recompute_granularity == "full" else 0
    assert want <= got <= want + rng, (got, want)
    if fields is _GPT:
        h, tokens = cfg.hidden_size, cfg.seq_length * b
        widths = h if first else layers * (3 * h + h + cfg.ffn_hidden_size + h + 2 * h) + (h if last else 0)
        assert want == widths * tokens * 4


@pytest.mark.parametrize("recipe,dtype,full", [
    ("tensorwise", torch.float32, False), ("tensorwise", torch.bfloat16, False), ("delayed", torch.bfloat16, False),
    ("blockwise", torch.bfloat16, False), ("tensorwise", torch.bfloat16, True),
    pytest.param("delayed", torch.float32, True, marks=pytest.mark.slow),
    pytest.param("blockwise", torch.bfloat16, True, marks=pytest.mark.slow)])
def test_fp8_w_inputs_equal_what_the_split_backward_keeps(recipe, dtype, full):
    """With FP8 linears the plan's W inputs (:func:`omnitron.plan.memory.w_input_bytes` with the chunk's linears:
    :func:`omnitron.plan.fp8_memory.fp8_w_inputs`) equal the storages the runtime's split backward keeps at the
    chunk's real size (:func:`_kept_for_w` on an FP8 chunk), to the byte: a Llama chunk of 2 layers (no bias) at
    the last stage, random widths and micro-batch. And by hand: the wide chunk's kept gradients less each FP8
    linear's output gradient (qkv, proj, fc1, fc2: ``2 h + h + 2 f + h`` a token, GQA; the norms' stay), plus what each
    holds instead: its gradient's codes at 1 byte (``[out, t]``) and, tensorwise, a 4-byte scale (delayed: the
    role's, none new), block-wise a 4-byte scale per 1x128 tile along the tokens; and the 2-layer stand-in each
    boundary keeps, one element. Priced wide (before 2026-12-07) these are 1.7-2.5x the real bytes: this fails.
    ``full``: every layer recomputed (``_LLAMA``'s uniform chunks of one): B's rerun keeps each FP8 linear's 1-byte
    input copy and scale for W, not the wide input the wide probe's linear kept (priced wide before: 25% over at
    tensorwise, h 128); within the CPU generator state the recomputation's RNG tracker clones in B, as the wide
    check (:func:`test_w_inputs_equal_what_the_split_backward_keeps`)."""
    from omnitron.core.models.gpt.config import GPTConfig, padded_vocab_size
    from omnitron.core.precision.fp8.config import FP8Config
    from omnitron.plan.fp8_passes import own_scale
    from omnitron.plan.memory import w_input_bytes

    h = random.choice([128, 256])
    f, b = random.choice([256, 384]), random.choice([1, 2])
    rec = {} if full else {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None}
    cfg = GPTConfig(**{**_LLAMA, **rec, "hidden_size": h, "ffn_hidden_size": f, "seq_length": 128,
                       "max_position_embeddings": 128, "params_dtype": dtype})
    fp8 = FP8Config(fp8_recipe=recipe, fp8_format="e4m3" if recipe == "blockwise" else "hybrid")
    v = padded_vocab_size(cfg, 1)
    settings = SimpleNamespace(parallel=SimpleNamespace(tensor_model_parallel_size=1, context_parallel_size=1, etp=1,
                                                        pipeline_model_parallel_size=1, sequence_parallel=False),
                               training=SimpleNamespace(micro_batch_size=b, pipeline_schedule="zb-h1"), fp8=fp8)
    t = cfg.seq_length * b
    saved = (lambda k: k * t + own_scale(fp8)) if fp8.per_tensor else (lambda k: 0)  # (chunk_linears' saved)
    linears = {(i, n): (o, k, 0, saved(k), t) for i in (0, 1) for n, (o, k) in
               {"self_attention.linear_qkv": (2 * h, h), "self_attention.linear_proj": (h, h),
                "mlp.linear_fc1": (2 * f, h), "mlp.linear_fc2": (h, f)}.items()}
    got = w_input_bytes(settings, cfg, 2, False, True, fp8=linears)
    real = replace(cfg, vocab_size=v, make_vocab_size_divisible_by=v)
    want = _kept_for_w(real, 2, False, True, cfg.seq_length, b, fp8)
    rng = torch.get_rng_state().nbytes if full else 0
    assert want <= got <= want + rng, (got, want)
    if full:
        return
    e = dtype.itemsize
    wide = _kept_for_w(real, 2, False, True, cfg.seq_length, b)
    outs = [2 * h, h, 2 * f, h]  # GQA: 8 heads, 4 groups: q h, k and v h / 2 each
    scale = {"tensorwise": 4 * len(outs), "delayed": 0, "blockwise": 4 * sum(outs) * -(-t // 128)}[recipe]
    assert want == wide - 2 * (e * sum(outs) * t - (sum(outs) * t + scale + e * len(outs))), (want, wide)
