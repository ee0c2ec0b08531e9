"""Routing imbalance and dropped tokens in the plan (:mod:`omnitron.plan.routing`): a skewed histogram priced by
hand (rows of the busiest ep rank, the all-to-all buffers, the printed imbalance and drops, the step slower), and
bad histogram files refused in one line. Against the engine's own routing on a real two-rank step:
test_moe_speed.py's ``test_busiest_rank_rows_and_drops_match_a_real_skewed_step`` (it shares that file's
two-rank run)."""
from __future__ import annotations

import json
import random

import pytest


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


def test_each_moe_layer_priced_at_its_own_row(tmp_path):
    """Two MoE layers on pp2 (one a stage), histogram rows (skewed, flat): stage 0 costs what it costs under the
    one-row histogram (skewed) and stage 1 what it costs under (flat); reversed rows swap them; three rows for two
    layers price both at the mean (each stage as under the one-row histogram of the three's mean cost)."""
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.cluster import device_rates
    from omnitron.plan.routing import read_expert_load
    from omnitron.plan.speed import KEYS, _stage_costs

    from tests.plan.test_moe_speed import _args

    big = ["--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "4096", "--max-position-embeddings",
           "4096", "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--bf16"]
    s = parse_settings(_args(str(tmp_path), big), 4)
    n = random.randint(1, 50)
    skew, flat = [3 * n, n, n, n], [n] * 4

    def stages(*rows):
        path = tmp_path / "load.json"
        path.write_text(json.dumps({"tokens_per_expert": list(rows)}))
        rates = device_rates("h100-sxm", 8)
        rates.expert_load = read_expert_load(str(path))
        costs = _stage_costs(s, rates, "none")[2]
        return [tuple(costs[k].f[key] + costs[k].b[key] for key in KEYS) for k in (0, 1)]

    one_skew, one_flat = stages(skew), stages(flat)
    assert one_skew[0] != one_flat[0]
    assert stages(skew, flat) == [one_skew[0], one_flat[1]]
    assert stages(flat, skew) == [one_flat[0], one_skew[1]]
    three = stages(skew, flat, flat)
    mean = [tuple((2 * f + k) / 3 for f, k in zip(one_flat[i], one_skew[i])) for i in (0, 1)]
    assert three == [pytest.approx(mean[0], rel=1e-12), pytest.approx(mean[1], rel=1e-12)]
