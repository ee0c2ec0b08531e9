"""The rank layout and the pipeline split are Megatron-LM's: every process group omnitron builds, and the layers of
every (pipeline rank, virtual stage), equal what Megatron's own code gives for the same flags.

The reference is ``megatron_layout/fixtures.json``, written by ``megatron_layout/make_fixtures.py`` with
Megatron-LM's ``parallel_state`` (RankGenerator, order ``tp-cp-ep-dp-pp``; the embedding ranks; the hierarchical
context-parallel groups) and its ``get_num_layers_to_build`` / ``get_transformer_layer_offset``. Integers only:
equality is exact. A different group would move tensor-parallel ranks off a node, or put a Megatron user's
ranks on other hosts than their hostfile expects.
"""
from __future__ import annotations

import json
import os

import pytest

from omnitron.core.config import ParallelConfig
from omnitron.core.parallel.grid import dense_groups, rank_grid
from omnitron.core.parallel.pipeline.layout import pipeline_layer_ranges

with open(os.path.join(os.path.dirname(__file__), "megatron_layout", "fixtures.json")) as _f:
    FIXTURES = json.load(_f)


def _sorted(groups):
    """Groups as sets of ranks (torch orders a group's ranks itself: only membership matters)."""
    return sorted(sorted(g) for g in groups)


@pytest.mark.parametrize("entry", FIXTURES["groups"],
                         ids=lambda e: "w{}-tp{}-cp{}-pp{}-ep{}-etp{}-hcp{}".format(*e["case"]))
def test_every_group_is_megatrons(entry):
    world, tp, cp, pp, ep, etp, hier = entry["case"]
    kw = dict(tensor_model_parallel_size=tp, context_parallel_size=cp, pipeline_model_parallel_size=pp,
              expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    if hier:
        kw.update(cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=list(hier))
    cfg = ParallelConfig(**kw)
    grid = rank_grid(cfg, world)
    want = entry["groups"]
    names = set(want) - {"amax"}
    assert names <= set(grid), names - set(grid)
    for name in sorted(names):
        assert _sorted(grid[name]) == _sorted(want[name]), name
    assert _sorted(dense_groups(cfg, world, ("tp", "cp", "dp"))) == _sorted(want["amax"])  # FP8's amax group
    # pipeline groups list their stages in order (the first and the last member hold the embedding and head)
    assert sorted(grid["pp"]) == sorted(want["pp"])


@pytest.mark.parametrize("entry", FIXTURES["layers"],
                         ids=lambda e: "L{}-pp{}-vp{}-first{}-last{}-emb{}-loss{}".format(*e["case"]))
def test_every_stage_builds_megatrons_layers(entry):
    num_layers, pp, vp, first, last, embedding, loss = entry["case"]
    got = pipeline_layer_ranges(num_layers, pp, vp, first, last, embedding=bool(embedding), loss=bool(loss))
    assert {f"{r},{c}": list(v) for (r, c), v in got.items()} == entry["layers"]
