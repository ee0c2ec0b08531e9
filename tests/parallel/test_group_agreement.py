"""Process-group creation has a deadline: ranks that create different groups, or a rank that never comes to a
creation, stop every rank in one line naming the group and the ranks, within the job's timeout.

Without :mod:`omnitron.backends.group_agreement`, a rank that made one group more than its peer waited in torch's
``new_group`` for torch's default 30 minutes (a two-rank gloo job printed nothing for 120 s, until killed).
"""
from __future__ import annotations

import random
import time

import pytest
import torch

from omnitron.backends.group_agreement import GroupCreationError
from omnitron.testing.distributed import run_distributed

LIMIT_S = 3.0
"""The planted deadline (``--distributed-timeout-minutes`` in seconds); the tests' own limit is far above it."""
MARGIN_S = 1.0
"""The planted wait for rank 0's verdict past the deadline (VERDICT_MARGIN_S)."""


def _collectives():
    from omnitron.backends import get_backend

    return get_backend("cpu").collectives


def _outcome(fn):
    """What ``fn()`` raised (type name and line), or "ok", and the seconds it took."""
    start = time.monotonic()
    try:
        fn()
        got = "ok"
    except GroupCreationError as err:
        got = f"GroupCreationError: {err}"
    return got, time.monotonic() - start


def _extra_group_on_rank_0():
    """Rank 0 creates one group more (a branch only it takes) before the job's groups; both ranks build them."""
    import torch.distributed as dist

    from omnitron.backends import group_agreement
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups

    group_agreement.set_limits(180.0, LIMIT_S)
    coll = _collectives()

    def run():
        if dist.get_rank() == 0:
            coll.new_group([0, 1], "extra")
        ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=2), coll)

    return _outcome(run)


def test_a_group_only_one_rank_creates_stops_both_ranks_in_one_line_naming_it():
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.parallel.grid import rank_grid

    got = run_distributed(_extra_group_on_rank_0, 2, timeout_s=120)
    lines = {line for line, _ in got}
    assert len(lines) == 1, lines  # the same line on both ranks
    line = lines.pop()
    built = "; ".join(f"{name} [0, 1]" for name, lists in rank_grid(ParallelConfig(tensor_model_parallel_size=2),
                                                                     2).items() if lists == [[0, 1]])
    assert line == (f"GroupCreationError: process group creation #1 (extra [0, 1]): rank 1 of 2 creates other groups "
                    f"(rank 1 creates {built}): every rank must create the same groups in the same order"), line
    assert all(s < LIMIT_S for _, s in got), got  # found at once: no need to wait for the deadline


def _a_private_group_before():
    """Ranks 1 and 2 each make a group of their own through torch (outside the collectives: no agreement), then
    every rank creates the same group."""
    import torch.distributed as dist

    from omnitron.backends import group_agreement

    group_agreement.set_limits(180.0, LIMIT_S)
    rank = dist.get_rank()
    if rank > 0:
        dist.new_group([rank])  # a group of one: torch's counter moves on this rank only
    return _outcome(lambda: _collectives().new_group([0, 1, 2], "x"))


def test_groups_made_outside_on_some_ranks_are_named():
    """The groups agree, torch's count of the groups made before them does not: the ranks' group names (torch
    numbers them) no longer match, and the next group would wait on keys no peer writes."""
    got = run_distributed(_a_private_group_before, 3, timeout_s=120)
    lines = {line for line, _ in got}
    assert lines == {"GroupCreationError: process group creation #1 (x [0, 1, 2]): ranks 1, 2 of 3 create other "
                     "groups (the same groups, but rank 1 had made 2 process groups before them, rank 0 1: a group "
                     "made on some ranks only, outside omnitron's collectives): every rank must create the same "
                     "groups in the same order"}, lines


def _one_rank_never_comes(absent: int):
    """Rank ``absent`` waits (on the store, for longer than the deadline) instead of creating the group."""
    import torch.distributed as dist

    from omnitron.backends import group_agreement

    group_agreement.set_limits(180.0, LIMIT_S)
    group_agreement.VERDICT_MARGIN_S = MARGIN_S
    if dist.get_rank() == absent:
        time.sleep(LIMIT_S + MARGIN_S + 2.0)  # past every other rank's wait for the verdict
        return "absent", 0.0
    return _outcome(lambda: _collectives().new_host_group(range(dist.get_world_size()), "checkpoint writer"))


@pytest.mark.parametrize("absent", [0, 2])
def test_a_rank_that_never_comes_is_named_within_the_deadline(absent):
    """Rank 0 (the one that compares) or another rank of three never comes: the others stop naming it after the
    deadline (rank 0 absent: each waits that long for its digest; else rank 0 for the absent one's, then its
    verdict names it to the others)."""
    got = run_distributed(_one_rank_never_comes, 3, absent, timeout_s=120)
    for r, (line, seconds) in enumerate(got):
        if r == absent:
            continue
        assert line == (f"GroupCreationError: process group creation #1 (checkpoint writer [0, 1, 2]): rank {absent} "
                        f"of 3 did not arrive within 3 s (--distributed-timeout-minutes): every rank must create the "
                        f"same groups in the same order"), line
        # the polls back off to 0.5 s; a loaded host adds the store's round trips: 3 s of slack
        assert LIMIT_S <= seconds < LIMIT_S + 3.0, (r, seconds)


def _new_groups_agree_and_work(timeout_s: float):
    """Equal creations on every rank: no error; each group carries the job's timeout (not torch's 30 minutes for a
    new gloo group) and reduces correctly."""
    import torch.distributed as dist

    from omnitron.backends import group_agreement

    group_agreement.set_limits(timeout_s)
    coll = _collectives()
    world, rank = dist.get_world_size(), dist.get_rank()
    pairs = [[r, r + 1] for r in range(0, world, 2)]
    groups = coll.new_groups([("pair", p) for p in pairs]) + [coll.new_host_group(range(world), "all")]
    mine, whole = groups[rank // 2], groups[-1]
    x = torch.tensor([float(rank + 1)], dtype=torch.float64)
    coll.all_reduce(x, group=mine)
    y = torch.tensor([float(rank + 1)], dtype=torch.float64)
    coll.all_reduce(y, group=whole)
    timeouts = [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in (mine, whole)]
    return x.item(), y.item(), timeouts


def test_equal_creations_agree_and_the_groups_carry_the_jobs_timeout():
    timeout_s = float(random.randrange(40, 900))
    got = run_distributed(_new_groups_agree_and_work, 4, timeout_s, timeout_s=120)
    for rank, (pair, whole, timeouts) in enumerate(got):
        first = rank - rank % 2
        assert pair == (first + 1) + (first + 2) and whole == 1 + 2 + 3 + 4, got  # hand-derived sums
        assert timeouts == [timeout_s, timeout_s], timeouts
