"""``omnitron plan``'s search tries the V-shaped schedules (zb-v, dualpipe-v): each candidate launches with
``--pipeline-schedule`` and two chunks per rank, its bubble is the schedule simulation's on the stage costs, its
memory counts the micro-batches the simulation holds at once, and a V layout that beats 1F1B prints the flag."""
from __future__ import annotations

import shlex

from tests.plan.test_recommend import ARGV, GIVEN


def _simulated(c, rates):
    """(the simulation of ``c``'s schedule on the plan's per-stage costs, B and W half the backward each, as the
    zero-bubble builders assume; the schedule)."""
    from omnitron.core.parallel.pipeline import build_schedule, simulate
    from omnitron.plan.speed import _stage_costs

    pc = c.settings.parallel
    schedule = build_schedule(c.flags.get("pipeline_schedule"), pc.pipeline_model_parallel_size,
                              pc.virtual_pipeline_model_parallel_size, c.settings.num_microbatches)
    _, _, costs = _stage_costs(c.settings, rates, "none")
    table = {}
    for k, sc in costs.items():
        b = sc.total("B", "none")
        table.update({(k, "F"): sc.total("F", "none"), (k, "BW"): b, (k, "B"): b / 2, (k, "W"): b / 2})
    return simulate(schedule, stage_cost=lambda k, kind: table[(k, kind)]), schedule


def test_search_tries_v_schedules_at_their_simulated_bubble_and_memory(tmp_path, constant_rates):
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.memory import estimate
    from omnitron.plan.recommend import candidates, format_choices, launch_flags
    from omnitron.plan.speed import predict

    rates = constant_rates(tmp_path, 0.05, 0.001)  # cheap transfers: the bubble decides between schedules
    piped = [c for c in candidates(GIVEN | {"nproc_per_node": 2},
                                   2) if c.settings.parallel.pipeline_model_parallel_size == 2]
    names = {c.flags.get("pipeline_schedule") for c in piped}
    assert names == {None, "zb-v", "dualpipe-v"}, names
    for c in piped:
        name, m = c.flags.get("pipeline_schedule"), c.settings.num_microbatches
        assert name != "dualpipe-v" or m >= 4  # DualPipeV needs 2 pp micro-batches
        if name:
            s = parse_settings(ARGV + ["--global-batch-size", "8"] + shlex.split(launch_flags(c)), 2)
            assert s.training.pipeline_schedule == name and s.parallel.virtual_pipeline_model_parallel_size == 2
        tl, schedule = _simulated(c, rates)
        busy = max(sum(e - st for st, e, _ in spans) for spans in tl.spans.values())
        c.step = predict(c.settings, rates)
        assert abs(c.step.bubble - (tl.makespan - busy)) <= 1e-12 * tl.makespan, c.name()
        c.stages = estimate(c.settings, transients=False)  # two chunks per rank, as many in flight as simulated
        assert [st.layers for st in c.stages] == [2, 2]
        assert [st.inflight for st in c.stages] == [tl.peak_inflight[r] for r in range(2)], c.name()
    best = max(piped, key=lambda c: c.step.tokens_per_s)  # the simulation's bubble decides: a V schedule wins
    assert best.flags.get("pipeline_schedule") in ("zb-v", "dualpipe-v"), best.name()
    out = format_choices([best], 2, 2**40)
    assert f"--pipeline-schedule {best.flags['pipeline_schedule']}" in out and best.name() in out
