"""The rank grid as a pure function: every group partitions the world, order tp-cp-dp-pp."""
import itertools

import pytest

from omnitron.core.config import ConfigError, ParallelConfig
from omnitron.core.parallel.grid import coord_of, rank_grid


def _check_partition(groups, world):
    flat = sorted(r for g in groups for r in g)
    assert flat == list(range(world))


@pytest.mark.parametrize("tp,cp,pp,dp", [(1, 1, 1, 1), (2, 1, 1, 1), (2, 1, 2, 2), (4, 2, 2, 1), (8, 1, 4, 32),
                                         (2, 2, 4, 16), (1, 1, 8, 128)])
def test_groups_partition_world_and_follow_rank_order(tp, cp, pp, dp):
    world = tp * cp * pp * dp
    cfg = ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp, pipeline_model_parallel_size=pp)
    grid = rank_grid(cfg, world)
    sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp, "dp_cp": dp * cp, "mp": tp * pp, "tp_pp_cp": tp * cp * pp}
    for name, size in sizes.items():
        _check_partition(grid[name], world)
        assert all(len(g) == size for g in grid[name]), name
    # tensor-parallel ranks are adjacent
    assert all(g == list(range(g[0], g[0] + tp)) for g in grid["tp"])
    # each rank's coordinate agrees with its groups
    for rank in range(0, world, max(1, world // 50)):
        c = coord_of(cfg, world, rank)
        assert rank == c.tp + tp * (c.cp + cp * (c.dp + dp * c.pp))
        pp_group = next(g for g in grid["pp"] if rank in g)
        assert pp_group.index(rank) == c.pp
    assert all(len(g) == min(2, pp) for g in grid["embedding"])


def test_thousand_rank_grid_expert_layout():
    cfg = ParallelConfig(tensor_model_parallel_size=8, pipeline_model_parallel_size=8, expert_model_parallel_size=16,
                         expert_tensor_parallel_size=1)
    world = 8 * 8 * 32  # dp = 32
    grid = rank_grid(cfg, world)
    assert len(world_ranks := sorted(itertools.chain.from_iterable(grid["ep"]))) == world == 2048
    assert world_ranks == list(range(world))
    assert all(len(g) == 16 for g in grid["ep"]) and all(len(g) == 16 for g in grid["edp"])
    # experts stay inside one pipeline stage
    stage = world // 8
    assert all(len({r // stage for r in g}) == 1 for g in grid["ep"] + grid["edp"])


@pytest.mark.parametrize("kw,world,needle", [
    (dict(tensor_model_parallel_size=3), 4, "world size 4 is not a multiple"),
    (dict(pipeline_model_parallel_size=2, expert_model_parallel_size=4), 4, "expert layout"),
])
def test_invalid_layouts_name_the_numbers(kw, world, needle):
    with pytest.raises(ConfigError, match=needle):
        rank_grid(ParallelConfig(**kw), world)


def test_bad_sizes_rejected_up_front():
    with pytest.raises(ConfigError, match="--tensor-model-parallel-size"):
        ParallelConfig(tensor_model_parallel_size=0)
    with pytest.raises(ConfigError, match="virtual pipeline"):
        ParallelConfig(virtual_pipeline_model_parallel_size=2)
