"""``speed.step_lower_bound`` under the V placement (``--pipeline-schedule zb-v`` / ``dualpipe-v``): the bound is the
busiest rank's work, and with a V a rank holds virtual stages ``r`` and ``2 pp - 1 - r`` (the first and the last
stage, the embedding's and the head's, both on rank 0). The reference walks each rank's action table of the built
schedule and adds up every action it runs, its stage read from the V's definition written out here, each stage priced
apart from its own ends (embedding, head, which neighbours it sends to: the V's turn between stages pp - 1 and pp
stays on one rank)."""
from __future__ import annotations

import math
import random

import pytest

from omnitron.plan.profile import load


def _settings(pp: int, per_stage: int, vocab: int, name: str, mbs: int):
    from omnitron.commands.plan import settings_of

    layers = 2 * pp * per_stage
    given = {"model": "gpt2_tiny", "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": vocab,
             "seq_length": 1024, "max_position_embeddings": 1024, "global_batch_size": 4 * pp * mbs,
             "micro_batch_size": mbs, "bf16": True, "hidden_size": 1024, "num_attention_heads": 16,
             "ffn_hidden_size": 4096, "num_layers": layers, "layout": f"pp{pp}", "pipeline_schedule": name,
             "num_layers_per_virtual_pipeline_stage": per_stage}
    return settings_of(given)


def _v_stage(rank: int, chunk: int, pp: int) -> int:
    """The V: chunk 0 of rank r is stage r (down the ranks), chunk 1 is stage 2 pp - 1 - r (back up)."""
    return rank if chunk == 0 else 2 * pp - 1 - rank


def _stage_seconds(settings, rates, overlap: str, pp: int, per_stage: int) -> dict[int, tuple[float, float]]:
    """(forward, backward) seconds of one micro-batch of each virtual stage, its ends given by hand."""
    from omnitron.plan.memory import model_config
    from omnitron.plan.speed import stage_cost

    cfg = model_config(settings)
    rates.bind(settings)
    out = {}
    for k in range(2 * pp):
        first, last = k == 0, k == 2 * pp - 1
        nxt, prev = not last and k != pp - 1, not first and k != pp  # the turn: stages pp - 1 and pp share a rank
        c = stage_cost(settings, cfg, rates, [False] * per_stage, first, last, nxt, prev)
        out[k] = (c.total("F", overlap), c.total("B", overlap))
    return out


@pytest.mark.parametrize("name", ["zb-v", "dualpipe-v"])
@pytest.mark.parametrize("overlap", ["none", "all"])
def test_step_lower_bound_is_the_busiest_v_rank_by_its_action_table(name, overlap):
    from omnitron.core.parallel.pipeline import build_schedule
    from omnitron.plan.device_rates import DeviceRates
    from omnitron.plan.speed import predict, step_lower_bound

    rng = random.Random()
    pp, per_stage, mbs = rng.randint(2, 4), rng.randint(1, 3), rng.choice([1, 2])
    # a large vocabulary makes the head's stage (2 pp - 1) the heaviest, so which rank holds it decides the bound
    vocab = rng.randint(64, 256) * 1024
    s = _settings(pp, per_stage, vocab, name, mbs)
    rates = DeviceRates(load("h200"), 8)
    sec = _stage_seconds(s, rates, overlap, pp, per_stage)
    sched = build_schedule(name, pp, 2, s.num_microbatches)
    per_rank = {}
    for r, table in sched.tables.items():
        split = {(a.chunk, a.microbatch) for a in table if a.kind == "W"}  # B then W: half the backward each
        t = 0.0
        for a in table:
            f, b = sec[_v_stage(r, a.chunk, pp)]
            t += {"F": f, "B": b / 2 if (a.chunk, a.microbatch) in split else b, "W": b / 2, "BW": b}[a.kind]
        per_rank[r] = t
    # the reference rank sums each of its 2 m actions' float64 seconds in table order, the bound m x the rank's two
    # stages: the same terms summed in another order, so only rounding (~1e-16 a term, < 1e-12 relative) differs
    want = max(per_rank.values())
    got = step_lower_bound(s, rates, overlap)
    assert math.isclose(got, want, rel_tol=1e-12), (pp, per_stage, vocab, per_rank, got)
    # the head and the embedding both on rank 0: the bound is rank 0's (the placement of the test's premise)
    assert max(per_rank, key=per_rank.get) == 0, per_rank
    assert got <= predict(s, rates, overlap).total * (1 + 1e-12)
