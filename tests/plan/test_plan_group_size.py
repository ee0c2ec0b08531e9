"""``omnitron plan`` with ``--microbatch-group-size-per-virtual-pipeline-stage`` N: a given interleaved layout is
priced on the schedule N makes (rank r holds Megatron's warm-up of 2 (pp - r - 1) + (vp - 1) N chunk forwards, plus
the one that starts the steady state), and the layout search, which sets the virtual stages and micro-batch counts
itself, refuses N in one line."""
from __future__ import annotations

import pytest

from omnitron.core.config import ConfigError
from tests.plan.test_recommend import GIVEN

LAYOUT = GIVEN | {"num_layers": 4, "pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 1,
                  "micro_batch_size": 1, "global_batch_size": 6, "nproc_per_node": 2}


@pytest.mark.parametrize("n", [None, 3, 6])
def test_given_layout_holds_the_warmup_of_its_group_size(n):
    from omnitron.plan.memory import estimate
    from omnitron.plan.settings import settings_of

    pp, vp, m = 2, 2, 6
    stages = estimate(settings_of(LAYOUT | {"microbatch_group_size_per_vp_stage": n}), transients=False)
    group = n or pp
    for r, stage in enumerate(sorted(stages, key=lambda s: s.stage)):
        warmup = min(2 * (pp - r - 1) + (vp - 1) * group, m * vp)
        assert stage.inflight == min(warmup + 1, m * vp), (r, n)  # the steady state's first forward runs before a B


def test_search_refuses_the_group_size_in_one_line():
    from omnitron.plan.layouts import candidates

    with pytest.raises(ConfigError, match="^--microbatch-group-size-per-virtual-pipeline-stage: ") as info:
        candidates(GIVEN | {"microbatch_group_size_per_vp_stage": 3, "nproc_per_node": 2}, 2)
    assert "\n" not in str(info.value)
