"""The speed model's MoE terms (:mod:`omnitron.plan.moe`) against a real MoE model: GEMM FLOPs against
``torch.utils.flop_counter`` on one process, every collective of a real forward + backward (op, bytes, group
size) against :func:`omnitron.plan.speed.layer_collectives` at ep2, tp2 with sequence parallelism and a capacity
factor, and tp2 without it, and the stage's parameters against the gradient buffers.

Routing. The model assumes balanced routing; the distributed test makes it exact by routing token ``t`` to
experts ``(t k + j) mod E`` (a round-robin router with the real router's GEMM, softmax and loss statistics), so
every expert receives ``T k / E`` rows and each collective's size is determined. The FLOP count needs no such
router: the expert GEMMs' total work depends only on the number of processed assignments, ``T k``.

Imbalance (:mod:`omnitron.plan.routing`), in the same two-rank run before the round-robin router is put in: a
skewed router (sigmoid scores plus a random expert bias on one expert, the engine's
``--moe-router-enable-expert-bias`` selection) records each layer's router picks per expert (the histogram) and
the rows each rank's local experts process (``run_experts``' counts, after the ep exchange and any capacity
drop). The plan, given only the histogram (summed over the ranks that share the ep group's sources), must give
the busiest ep rank's rows per local expert, what it receives, and the dropped fraction exactly (integer rows;
the fraction to float rounding):

- ep2, tp1, dropless: each rank routes its own micro-batch; expert ``e`` receives both ranks' picks, which is
  ``p_e T k ep`` for the summed shares ``p_e``;
- tp2 + SP, ep2 (the tp pair is the ep group), capacity factor 1.0: the capacity is decided over the whole
  micro-batch, so expert ``e`` processes ``min(p_e T k, ceil(T k / E))`` rows and the rest are dropped."""
from __future__ import annotations

import json
import os
import random
from collections import Counter

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from omnitron.plan import moe as moe_work
from omnitron.plan import work
from omnitron.testing.distributed import run_distributed

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def test_moe_gemm_flops_match_the_flop_counter():
    """Exact integer FLOPs: dense layers' GEMMs, MoE layers' attention GEMMs, router, experts and shared
    expert, and the output layer, each 3x forward (input and weight gradients)."""
    from omnitron.core.models.gpt import GPTModel
    from omnitron.core.models.gpt.presets import gpt2_tiny
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.transformer.moe.pattern import moe_layer_pattern

    rng = random.Random()
    layers = rng.choice([2, 3])
    freq = rng.choice([1, 2, "[1]+[0]*%d" % (layers - 1)])
    cfg = gpt2_tiny(num_layers=layers, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, seq_length=16,
                    max_position_embeddings=16, vocab_size=50, hidden_dropout=0.0, attention_dropout=0.0,
                    num_experts=rng.choice([2, 4]), moe_router_topk=rng.choice([1, 2]),
                    moe_ffn_hidden_size=rng.choice([None, 24]), moe_layer_freq=freq,
                    moe_shared_expert_intermediate_size=rng.choice([None, 40]), swiglu=rng.random() < 0.5)
    b = rng.choice([1, 2])
    m = GPTModel(cfg, ParallelGroups.single())
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_length))
    with FlopCounterMode(display=False) as fc:
        m(tokens=tokens, position_ids=torch.arange(cfg.seq_length).expand(b, -1), labels=tokens).sum().backward()
    got = {str(k): v for k, v in fc.get_flop_counts()["Global"].items()}
    x = work.local_shapes(cfg, 1, 1, b)
    ml = moe_work.moe_local(cfg, x, 1, 1, False)
    dense = work.gemm_flops(work.layer_gemms(x))
    moe = work.gemm_flops(work.layer_gemms(x)[:2] + moe_work.moe_gemms(ml))
    pattern = moe_layer_pattern(freq, layers)
    want = sum(moe if p else dense for p in pattern) + work.gemm_flops([work.head_gemm(x)])
    assert got.get("aten.mm", 0) + got.get("aten.addmm", 0) == 3 * want, (cfg, got)


CASES = {  # name: (world-2 flags, world)
    "ep2": ["--expert-model-parallel-size", "2"],
    "tp2 sp capacity aux": ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                            "--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity",
                            "--moe-aux-loss-coeff", "0.01"],
    "tp2 shared bias": ["--tensor-model-parallel-size", "2", "--moe-shared-expert-intermediate-size", "64"],
}


def _args(root: str, extra: list[str]) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            "200", "--num-workers", "0", "--train-iters", "1", "--no-tensorboard", "--micro-batch-size", "2",
            "--num-experts", "4", "--moe-router-topk", "2", "--data-cache-path", os.path.join(root, "cache"), *extra]


def _round_robin(self, x, batch_size=1):
    """The router with token ``t``'s picks fixed to experts ``(t k + j) mod E``: balanced routing."""
    import torch.nn.functional as F

    from omnitron.core.transformer.moe.router import aux_loss_scores, load_balancing_loss

    logits = F.linear(x.float(), self.weight.float())
    t = torch.arange(logits.shape[0], device=logits.device)
    experts = (t[:, None] * self.k + torch.arange(self.k, device=t.device)) % self.num_experts
    probs = torch.softmax(logits.gather(1, experts), dim=-1)
    aux = None
    if self.balancing.get("aux_loss", 0.0) > 0.0:
        aux = load_balancing_loss(aux_loss_scores(logits, self.score_function), experts, self.num_experts,
                                  self.balancing["aux_loss"], self.stats_group)
    return probs, experts, aux


def _recorded(root: str, world: int) -> dict:
    """{case: [(op, bytes, group size)] of one forward + backward}, on this rank."""
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.components import build_components
    from omnitron.core.transformer.moe.router import TopKRouter

    from tests.plan.test_tp_volume import forward_backward, recording

    TopKRouter.forward = _round_robin
    out = {}
    for name, extra in CASES.items():
        s = parse_settings(_args(root, extra), world)
        m = build_components(s, get_backend()).modules[0].train()
        with recording([], OPS, group_size=True) as log:
            forward_backward(s, m, 200)
        out[name] = log
    return out


def _expected(root: str, extra: list[str]) -> Counter:
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.memory import model_config
    from omnitron.plan.speed import layer_collectives

    s = parse_settings(_args(root, extra), 2)
    cfg, pc = model_config(s), s.parallel
    tp, sp = pc.tensor_model_parallel_size, pc.sequence_parallel
    f, b = layer_collectives(s, cfg, moe=True)
    want = [(op, n, g) for _, op, n, g in (f + b)] * cfg.num_layers
    x = work.local_shapes(cfg, tp, 1, s.training.micro_batch_size)
    for end in (work.first_stage_tp(cfg, x, 4, sp), work.last_stage_tp(x, 4, sp)):
        want += [(op, n, tp) for op, n in end[0] + end[1]]
    return Counter(want)


def _both(root: str, world: int, bias: list[float]) -> dict:
    """One two-rank run for both distributed tests: the skewed router's routing first (the round-robin router
    replaces the real one for good after)."""
    return {"routed": _routed(root, world, bias), "collectives": _recorded(root, world)}


@pytest.fixture(scope="module")
def real_steps(tmp_path_factory):
    """(root, per-rank results of :func:`_both`) with a random expert bias on one expert (sigmoid scores lie in
    (0, 1): that expert wins most picks)."""
    root = tmp_path_factory.mktemp("moe")
    bias = [0.0] * 4
    bias[random.randrange(4)] = random.uniform(0.4, 0.8)
    return root, run_distributed(_both, 2, str(root), 2, bias)


def test_moe_collectives_match_a_real_step(real_steps):
    root, got = real_steps
    for name, extra in CASES.items():
        want = _expected(str(root), extra)
        for r in range(2):
            rec = got[r]["collectives"][name]
            assert Counter(rec) == want, (name, r, sorted(rec), sorted(want.elements()))


SKEW = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
SKEWED = {
    "ep2 dropless": ["--expert-model-parallel-size", "2", *SKEW],
    "tp2 sp ep2 capacity": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size",
                            "2", "--expert-tensor-parallel-size", "1", "--moe-expert-capacity-factor", "1.0", *SKEW],
}


def _routed(root: str, world: int, bias: list[float]) -> dict:
    """{case: (picks per expert of each layer's router on this rank, each layer's local expert rows)}."""
    import torch

    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.components import build_components
    from omnitron.core.transformer.moe import layer as moe_layer
    from omnitron.core.transformer.moe.router import TopKRouter

    from tests.plan.test_tp_volume import forward_backward

    run, out = moe_layer.run_experts, {}
    for name, extra in SKEWED.items():
        s = parse_settings(_args(root, extra), world)
        m = build_components(s, get_backend()).modules[0].train()
        picks, rows = [], []
        for mod in m.modules():
            if isinstance(mod, TopKRouter):
                mod.expert_bias.copy_(torch.tensor(bias))
                mod.register_forward_hook(lambda _m, _i, o: picks.append(
                    torch.bincount(o[1].reshape(-1), minlength=len(bias)).tolist()))

        def counted(x, counts, *a, **k):
            rows.append(list(counts))
            return run(x, counts, *a, **k)

        moe_layer.run_experts = counted
        try:
            forward_backward(s, m, 200)
        finally:
            moe_layer.run_experts = run
        out[name] = (picks, rows)
    return out


def test_busiest_rank_rows_and_drops_match_a_real_skewed_step(real_steps):
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan import work
    from omnitron.plan.memory import model_config
    from omnitron.plan.moe import moe_local
    from omnitron.plan.routing import dropped, read_expert_load

    tmp_path, both = real_steps
    got = [rank["routed"] for rank in both]
    drops = 0.0
    for name, extra in SKEWED.items():
        s = parse_settings(_args(str(tmp_path), extra), 2)
        cfg, pc = model_config(s), s.parallel
        x = work.local_shapes(cfg, pc.tensor_model_parallel_size, 1, s.training.micro_batch_size)
        layers = len(got[0][name][0])
        hist = [[sum(got[r][name][0][i][e] for r in range(2)) for e in range(4)] for i in range(layers)]
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"tokens_per_expert": hist}))
        load = read_expert_load(str(path))
        T, k = x.tokens, cfg.moe_router_topk
        for i, share in enumerate(load.shares):
            per_rank = [got[r][name][1][i] for r in range(2)]
            busiest = max(per_rank, key=sum)  # the first on a tie, as the plan takes it
            m = moe_local(cfg, x, pc.expert_model_parallel_size, pc.etp, pc.sequence_parallel, share)
            assert list(m.rows) == busiest and m.received == sum(busiest), (name, i, hist[i], per_rank, m)
            processed = sum(map(sum, per_rank))
            sources = 2 // pc.tensor_model_parallel_size  # micro-batches routed into the ep group
            want = 1 - processed / (sources * T * k)
            assert dropped(cfg, T, share) == pytest.approx(want, abs=1e-12), (name, i, hist[i], per_rank)
            if "dropless" in name:  # each rank sends all its micro-batch's picks
                assert m.assignments == T * k
            drops += want
        assert max(max(h) for h in hist) > T * k // 4 * (3 - pc.tensor_model_parallel_size)  # routing was skewed
    assert drops > 0  # the capacity case dropped assignments


@pytest.mark.parametrize("extra", [["--expert-model-parallel-size", "2"],
                                   ["--tensor-model-parallel-size", "2", "--moe-layer-freq", "2",
                                    "--moe-shared-expert-intermediate-size", "64"]])
def test_moe_stage_params_are_the_gradient_buffers(tmp_path, extra):
    """Dense and expert parameters of a rank against the memory model's gradient buffers (a meta-device
    model's real parameters; fp32 gradients, no padding at dp 1 and the bucket sizes used)."""
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.memory import model_config
    from omnitron.plan.speed import stage_param_groups
    from omnitron.plan.stage_layers import stage_layers
    from omnitron.plan.state import state_bytes

    s = parse_settings(_args(str(tmp_path), extra), 2)
    cfg = model_config(s)
    kinds = stage_layers(s, cfg)[(0, 0)]
    dense, expert = stage_param_groups(cfg, s, 0, kinds)
    assert expert > 0
    assert (dense + expert) * 4 == state_bytes(s, cfg, 0).grads


def test_a_combined_pair_hides_the_rows_all_to_alls_not_the_token_counts(tmp_path):
    """Under ``--overlap-moe-expert-parallel-comm`` a combined pair hands over to its other pass at the rows'
    all-to-alls only, the dispatch's and the combine's each way (tests/sim/test_sim_plan_overlap.py counts them on
    a real sim step); each MoE layer's token-count exchange is synchronous (the host reads the received counts for
    the rows' splits) and stays in the pass. Reference, from the flags: balanced, dropless routing sends ``A = T
    k`` rows of ``h`` fp32 values per all-to-all (T = s b = 64 tokens, k = 2, h = 64), two per pass and MoE layer;
    the pair's credit is ``min(a_f, w_b) + min(a_b, w_f)`` of those and the passes' work, and each pass still
    holds the counts' all-to-all, ``E`` int64 per layer (no other collective at tp1 cp1). The plan credited every
    ``ep`` collective (the counts' exchange included) before."""
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.speed import _stage_costs, pair_credit
    from tests.plan.conftest import _constant_rates

    s = parse_settings(_args(str(tmp_path), ["--expert-model-parallel-size", "2", "--global-batch-size", "8",
                                             "--overlap-moe-expert-parallel-comm"]), 2)
    rates = _constant_rates(tmp_path, 0.05, 0.001)  # links slow enough to leave nothing hidden by accident
    costs = _stage_costs(s, rates, "all")[2]
    layers, rows = 2, 64 * 2 * 64 * 4
    a = layers * 2 * rates.comm_s("all_to_all", rows, 2, group="ep")
    counts = layers * rates.comm_s("all_to_all", 4 * 8, 2, group="ep")
    c = costs[0]
    assert c.f["ep"] == pytest.approx(a + counts, rel=1e-12, abs=0)
    assert c.b["ep"] == pytest.approx(a, rel=1e-12, abs=0)
    fw, bw = c._parts("F")[0], c._parts("B")[0]
    assert 0 < counts and a < min(fw, bw)  # the credit is the all-to-alls' whole time: the counts would show
    assert pair_credit(costs, "all")(0, 0) == pytest.approx(min(a, bw) + min(a, fw), rel=1e-12, abs=0)
