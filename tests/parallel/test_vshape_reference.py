"""The V-shaped schedules against their published code: ``vshape_reference/fixtures.json``, written by
``vshape_reference/make_fixtures.py`` from DeepSeek's DualPipeV (run for real on gloo) and Sea AI's ZB-V scheduler
(``zbv.py``); omnitron is not imported there.

* dualpipe-v: every rank's order of F / B / W passes is DualPipeV's, and so are its overlapped pairs but one: the
  last rank's first steady-state forward (chunk 0) and backward (chunk 1), which DualPipeV runs one after the other
  ("to further reduce bubble size": its pair waits for both inputs). omnitron pairs them (vshape.py's docstring):
  its forward does not wait for the backward's input, and on the combined clock the step is as long either way.
* zb-v: the tables of Sea AI's scheduler, with its default memory costs (``zb-v``) and with omnitron's B priced
  (``zb-v b_mem 1``: a B adds a chunk's worth, its W frees both).
"""
import dataclasses
import json
import os

import pytest

from omnitron.core.parallel.pipeline.actions import zb_stage_cost
from omnitron.core.parallel.pipeline.combined import combine_1f1b
from omnitron.core.parallel.pipeline.simulate import simulate
from omnitron.core.parallel.pipeline.vshape import schedule_dualpipe_v

with open(os.path.join(os.path.dirname(__file__), "vshape_reference", "fixtures.json")) as _f:
    FIXTURES = json.load(_f)


def _cases(name: str) -> list[tuple[int, int]]:
    return [tuple(map(int, key.split(","))) for key in FIXTURES[name]]


def _tables(schedule) -> list[list[str]]:
    return [[str(a) for a in schedule.tables[r]] for r in range(schedule.pp)]


def test_fixtures_hold_odd_and_even_counts_at_each_size():
    for name, low in (("dualpipe-v", 2), ("zb-v b_mem 1", 1)):
        cases = _cases(name)
        for p in (2, 3, 4):
            ms = {m for q, m in cases if q == p}
            assert set(range(low * p, 4 * p + 2)) <= ms, (name, p)
    assert {(16, 32), (16, 64)} <= set(_cases("zb-v b_mem 1"))


@pytest.mark.parametrize("pp,m", _cases("dualpipe-v"))
def test_dualpipe_v_runs_dualpipes_order_and_pairs(pp, m):
    s = schedule_dualpipe_v(pp, m)
    ref = FIXTURES["dualpipe-v"][f"{pp},{m}"]
    assert _tables(s) == [rank["table"] for rank in ref]
    for r in range(pp):
        extra = {2 * pp} if r == pp - 1 else set()  # the last rank: 2p warm-up forwards, then that pair
        assert set(s.pairs[r]) == set(ref[r]["pairs"]) | extra, r
    published = dataclasses.replace(s, pairs={r: frozenset(ref[r]["pairs"]) for r in range(pp)})
    for combined in (False, True):
        ours, theirs = (combine_1f1b(x) if combined else x for x in (s, published))
        assert simulate(ours, stage_cost=zb_stage_cost).makespan == simulate(theirs, stage_cost=zb_stage_cost).makespan
