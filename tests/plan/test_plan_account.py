"""``omnitron plan`` under --account-for-embedding/loss-in-pipeline-split: the stages it prices hold the layers
the engine builds (a chunk may hold none: the embedding or the output layer alone), such a chunk prices, the
compute a layout moves between stages sums to the one-stage model's, and the layout search splits the slots."""
from __future__ import annotations

import pytest

GIVEN = {"model": "gpt2_tiny", "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 200,
         "seq_length": 32, "max_position_embeddings": 32, "global_batch_size": 4}
BOTH = {"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True}
# gpt2_tiny's 4 layers + 2 slots = 6 at pp2 x vpp3: one slot a virtual stage, the two ends hold no layer
WANT = {(0, 0): 0, (1, 0): 1, (0, 1): 1, (1, 1): 1, (0, 2): 1, (1, 2): 0}


def _settings(**over):
    from omnitron.plan.settings import settings_of

    return settings_of(GIVEN | over)


def _built_layers(s) -> dict:
    """Layers of each chunk the engine's model builder makes for ``s`` (every pipeline rank, on the meta device)."""
    import torch

    from omnitron.core.models.family import family_of
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.parallel.pipeline.layout import config_layer_ranges
    from omnitron.plan.memory import model_config

    cfg, pc = model_config(s), s.parallel
    groups = ParallelGroups.single()
    groups.config = pc
    with torch.device("meta"):
        chunks = family_of(cfg).build_chunks(cfg, groups, config_layer_ranges(cfg.num_layers, pc), None,
                                             pc.pipeline_model_parallel_size, pc.virtual_pipeline_model_parallel_size,
                                             backend=None, seed=0)
    return {k: len(m.decoder.layers) for k, m in chunks.items()}


def test_plan_stages_hold_the_engines_layers():
    from omnitron.plan.memory import chunk_layers, estimate, model_config
    from omnitron.plan.stage_layers import stage_layers

    s = _settings(layout="pp2", num_layers_per_virtual_pipeline_stage=1, **BOTH)
    assert s.parallel.virtual_pipeline_model_parallel_size == 3
    cfg = model_config(s)
    assert chunk_layers(s, cfg) == WANT
    assert {k: len(v) for k, v in stage_layers(s, cfg).items()} == WANT
    assert _built_layers(s) == WANT
    stages = estimate(s)
    assert len(stages) == 2 and all(st.total > 0 for st in stages)


def test_empty_chunks_price_and_compute_moves_between_stages(tmp_path, constant_rates):
    """Against the even pp2 layout of the same model on the same ranks: the account layout's virtual stages together
    compute what the even one's do (tp 1: the same GEMMs, attention and head, placed differently), and its empty
    end chunks cost the even end stage's work less its two layers (each a middle chunk's one layer)."""
    from omnitron.plan.speed import _stage_costs, predict

    rates = constant_rates(tmp_path, 0.05, 5.0)
    account = _settings(layout="pp2", num_layers_per_virtual_pipeline_stage=1, **BOTH)
    _, layers, costs = _stage_costs(account, rates, "none")
    _, _, even = _stage_costs(_settings(layout="pp2"), rates, "none")

    def compute(c) -> float:
        return c.f["compute"] + c.b["compute"]

    assert len(layers[(0, 0)]) == 0 and len(layers[(1, 2)]) == 0
    assert sum(map(compute, costs.values())) == pytest.approx(sum(map(compute, even.values())), rel=1e-12)
    layer = compute(costs[2])
    assert all(compute(costs[k]) == pytest.approx(layer, rel=1e-12) for k in (1, 2, 3, 4))
    assert compute(costs[0]) == pytest.approx(compute(even[0]) - 2 * layer, rel=1e-9)  # the embedding alone
    assert compute(costs[5]) == pytest.approx(compute(even[1]) - 2 * layer, rel=1e-9)  # the output layer alone
    assert compute(costs[5]) > 0
    step = predict(account, rates)
    assert step.total > 0 and step.tokens_per_s > 0


def test_search_splits_the_slots():
    """With both flags the search's pipeline sizes divide layers + 2 and its vpp the slots per stage; the flags it
    adds give those sizes back through the engine's rules."""
    from omnitron.plan.layouts import candidates

    every = candidates(GIVEN | BOTH | {"nproc_per_node": 4}, 4)
    pcs = [c.settings.parallel for c in every]
    assert {p.pipeline_model_parallel_size for p in pcs} == {1, 2}  # 6 slots: pp4 does not divide them
    assert {p.virtual_pipeline_model_parallel_size or 1 for p in pcs if p.pipeline_model_parallel_size == 2} >= {1, 3}
    assert all(p.account_for_embedding_in_pipeline_split and p.account_for_loss_in_pipeline_split for p in pcs)


def test_search_splits_layers_the_pipeline_does_not_divide():
    """Without a split given, a pipeline size that does not divide the layers is searched with the loss (then the
    embedding too) counted as a layer, as Megatron users split Llama 3 405B's 126 layers over 16 stages: 6 layers
    on 8 devices give pp2 (even), pp4 (6 + 2 = 8 slots: both counted) and pp8 (8 slots, one a virtual stage: the
    end chunks hold no layer), 7 layers pp2, pp4 and pp8 with the loss alone (7 + 1); each candidate's flags
    build, through the engine's rules, chunks that hold every layer once, the first / last virtual stage one slot
    short where the embedding / loss counts."""
    from omnitron.core.parallel.pipeline.layout import config_layer_ranges
    from omnitron.plan.layouts import candidates

    for layers, want in ((6, {1: (), 2: (), 4: ("embedding", "loss"), 8: ("embedding", "loss")}),
                         (7, {1: (), 2: ("loss",), 4: ("loss",), 8: ("loss",)})):
        got = {}
        for c in candidates(GIVEN | {"nproc_per_node": 8, "num_layers": layers, "global_batch_size": 16}, 8):
            pc = c.settings.parallel
            pp = pc.pipeline_model_parallel_size
            flags = tuple(k for k in ("embedding", "loss") if getattr(pc, f"account_for_{k}_in_pipeline_split"))
            assert got.setdefault(pp, flags) == flags
            ranges = config_layer_ranges(layers, pc)
            assert sorted(o + i for o, n in ranges.values() for i in range(n)) == list(range(layers))
            vp = pc.virtual_pipeline_model_parallel_size or 1
            slots = (layers + len(flags)) // (pp * vp)
            assert ranges[(0, 0)][1] == slots - ("embedding" in flags)
            assert ranges[(pp - 1, vp - 1)][1] == slots - ("loss" in flags)
        assert got == want, got


def test_search_keeps_set_end_stage_sizes():
    """With ``--decoder-first/last-pipeline-num-layers`` the search tries the pipeline sizes whose middle ranks split
    the rest evenly, whether or not they divide the layers (10 layers, 2 first and 4 last: pp2 must hold all, pp4
    gives 2-2-2-4 though 4 does not divide 10, pp8 leaves 4 over 6 ranks), and the chunk counts every rank's layers
    divide (2-2-2-4: 1 or 2, through --num-virtual-stages-per-pipeline-rank); the engine builds each."""
    from omnitron.core.parallel.pipeline.layout import config_layer_ranges
    from omnitron.plan.layouts import candidates

    given = GIVEN | {"nproc_per_node": 8, "num_layers": 10, "global_batch_size": 32,
                     "decoder_first_pipeline_num_layers": 2, "decoder_last_pipeline_num_layers": 4}
    got = {}
    for c in candidates(given, 8):
        pc = c.settings.parallel
        got.setdefault(pc.pipeline_model_parallel_size, set()).add(pc.virtual_pipeline_model_parallel_size or 1)
        ranges = config_layer_ranges(10, pc)
        assert sorted(o + i for o, n in ranges.values() for i in range(n)) == list(range(10))
    assert got == {4: {1, 2}}, got
