"""Routing imbalance and dropped tokens in the plan (:mod:`omnitron.plan.routing`) against the engine's own routing:
a real two-rank MoE step with a skewed router (sigmoid scores plus a random expert bias on one expert, the
engine's ``--moe-router-enable-expert-bias`` selection) records each layer's router picks per expert (the
histogram) and the rows each rank's local experts process (``run_experts``' counts, after the ep exchange and
any capacity drop). The plan, given only the histogram (summed over the ranks that share the ep group's
sources), must give the busiest ep rank's rows per local expert, what it receives, and the dropped fraction
exactly (integer rows; the fraction to float rounding):

- ep2, tp1, dropless: each rank routes its own micro-batch; expert ``e`` receives both ranks' picks, which is
  ``p_e T k ep`` for the summed shares ``p_e``;
- tp2 + SP, ep2 (the tp pair is the ep group), capacity factor 1.0: the capacity is decided over the whole
  micro-batch, so expert ``e`` processes ``min(p_e T k, ceil(T k / E))`` rows and the rest are dropped.

Bad histogram files get one line naming the problem. The speed model's use of the rows (GEMMs per local
expert, all-to-all buffers) is the balanced path's, checked in test_moe_speed.py against a real step."""
from __future__ import annotations

import json
import random

import pytest

from omnitron.testing.distributed import run_distributed

SKEW = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
CASES = {
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

    from tests.plan.test_moe_speed import _args
    from tests.plan.test_tp_volume import forward_backward

    run, out = moe_layer.run_experts, {}
    for name, extra in CASES.items():
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


def test_busiest_rank_rows_and_drops_match_a_real_skewed_step(tmp_path):
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan import work
    from omnitron.plan.memory import model_config
    from omnitron.plan.moe import moe_local
    from omnitron.plan.routing import dropped, read_expert_load

    from tests.plan.test_moe_speed import _args

    bias = [0.0] * 4
    bias[random.randrange(4)] = random.uniform(0.4, 0.8)  # sigmoid scores lie in (0, 1): this expert wins most picks
    got = run_distributed(_routed, 2, str(tmp_path), 2, bias)
    drops = 0.0
    for name, extra in CASES.items():
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


@pytest.mark.parametrize("text,says", [
    ("[1, 2", "cannot read it as JSON"),
    ('{"counts": [1, 2]}', "tokens_per_expert"),
    ('{"tokens_per_expert": [[1, 2], [1]]}', "row 1 has 1 experts"),
    ('{"tokens_per_expert": [[1, -2]]}', "non-negative"),
    ('{"tokens_per_expert": [[0, 0]]}', "counts no assignment"),
])
def test_bad_histograms_get_one_line(tmp_path, text, says):
    from omnitron.core.config.parallel import ConfigError
    from omnitron.plan.routing import read_expert_load

    path = tmp_path / "load.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=says) as err:
        read_expert_load(str(path))
    assert "\n" not in str(err.value) and "--moe-expert-load" in str(err.value)


def test_skewed_histogram_priced_by_hand(tmp_path):
    """E 4, top-2, ep2, tp1, one micro-batch of T tokens, shares (1/2, 1/6, 1/6, 1/6) (counts 3:1:1:1). Dropless:
    rank 0 holds experts 0-1, 2/3 of the picks, so with both ranks' micro-batches it receives 4/3 T k rows against
    the mean rank's T k: 1.33x, and the dispatch all-to-alls are priced at that buffer, 4/3 of the balanced one;
    its experts' rows are T k and T k / 3 against T k / 2 each balanced. With capacity factor 1.0 (cap T k / 4)
    expert 0 keeps T k / 4 of its T k / 2: 25% of the assignments dropped; rank 0 then holds (1/4 + 1/6) T k
    of the (3/4) T k processed: 0.4167 / 0.375 = 1.11x. On an H100 profile the skewed step takes longer, in
    compute and in the all-to-alls (GEMMs large enough that time grows with rows)."""
    from dataclasses import replace

    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan import work
    from omnitron.plan.cluster import device_rates
    from omnitron.plan.memory import model_config
    from omnitron.plan.moe import moe_local
    from omnitron.plan.routing import read_expert_load
    from omnitron.plan.speed import layer_collectives, predict

    from tests.plan.test_moe_speed import _args

    path = tmp_path / "load.json"
    n = random.randint(1, 50)
    path.write_text(json.dumps({"tokens_per_expert": [3 * n, n, n, n]}))
    load = read_expert_load(str(path))
    big = ["--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "4096", "--max-position-embeddings",
           "4096"]  # GEMMs past the launch-bound sizes, where time grows with rows
    s = parse_settings(_args(str(tmp_path), ["--expert-model-parallel-size", "2", "--bf16", *big]), 2)
    cfg = model_config(s)
    x = work.local_shapes(cfg, 1, 1, s.training.micro_batch_size)
    Tk = x.tokens * cfg.moe_router_topk
    m = moe_local(cfg, x, 2, 1, False, load.shares[0])
    assert m.rows == (Tk, Tk // 3) and m.received == Tk * 4 // 3 and m.assignments == Tk
    a2a = [n for _, op, n, g in layer_collectives(s, cfg, True, load.shares[0])[0] if op == "all_to_all" and n > 64]
    flat = [n for _, op, n, g in layer_collectives(s, cfg, True)[0] if op == "all_to_all" and n > 64]
    assert a2a == [Tk * 4 // 3 * cfg.hidden_size * 2] * 2 and flat == [Tk * cfg.hidden_size * 2] * 2
    rates = device_rates("h100-sxm", 8)
    balanced = predict(s, rates)
    rates = device_rates("h100-sxm", 8)
    rates.expert_load = load
    skewed = predict(s, rates)
    assert skewed.total > balanced.total and skewed.ep > balanced.ep and skewed.compute > balanced.compute
    assert any("1.33x the mean rank's rows, 0.00% of assignments dropped" in a for a in skewed.assumptions)
    capped = replace(s, model=replace(s.model, moe_expert_capacity_factor=1.0))
    assert any("1.11x the mean rank's rows, 25.00% of assignments dropped" in a
               for a in predict(capped, rates).assumptions)
