"""The V-shaped schedules against their published code: ``vshape_reference/fixtures.json``, written by
``vshape_reference/make_fixtures.py`` from DeepSeek's DualPipeV (run for real on gloo) and Sea AI's ZB-V scheduler
(``zbv.py``); omnitron is not imported there.

* dualpipe-v: every rank's order of F / B / W passes is DualPipeV's, and so are its overlapped pairs but one: the
  last rank's first steady-state forward (chunk 0) and backward (chunk 1), which DualPipeV runs one after the other
  ("to further reduce bubble size": its pair waits for both inputs). omnitron pairs them (vshape.py's docstring):
  its forward does not wait for the backward's input, and on the combined clock the step is as long either way.
* zb-v: omnitron's own list schedule (not the published one's order) against the published tables run with
  omnitron's B priced (``zb-v b_mem 1``: a B adds a chunk's worth, its W frees both, at most ``2p`` chunks held and
  ``2p + 1`` with the waiting W inputs) and with the published defaults (``zb-v``: B adds nothing, ``2p`` held, W
  inputs not capped): a step no longer on the ideal clock, and on every rank no more memory, B priced as
  omnitron's.
"""
import dataclasses
import json
import os

import pytest

from omnitron.core.parallel.pipeline.actions import Action, Schedule, zb_stage_cost
from omnitron.core.parallel.pipeline.combined import combine_1f1b
from omnitron.core.parallel.pipeline.simulate import simulate
from omnitron.core.parallel.pipeline.vshape import schedule_dualpipe_v, schedule_zb_v

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


def _held(schedule) -> list[int]:
    """Per rank, the most chunk activations held when a split B adds one more (omnitron's B keeps the graph and adds
    the gradients its W needs, wgrad.py) and its W frees both: counted by hand here, not by the simulator."""
    most = []
    for r in range(schedule.pp):
        split, held, top = schedule.split_backward(r), 0, 0
        for a in schedule.tables[r]:
            held += {"F": 1, "B": 1 if (a.chunk, a.microbatch) in split else -1, "W": -2}[a.kind]
            top = max(top, held)
        most.append(top)
    return most


def _uniform(stage: int, kind: str) -> float:
    """Every pass one unit, as the published scheduler was run (F = B = W = 1)."""
    return 2.0 if kind == "BW" else 1.0


@pytest.mark.parametrize("name,pp,m", [(n, p, m) for n in ("zb-v b_mem 1", "zb-v") for p, m in _cases(n)])
def test_zb_v_is_as_short_as_the_published_table_and_holds_no_more(name, pp, m):
    tables = FIXTURES[name][f"{pp},{m}"]
    published = Schedule("zb-v", pp, 2, m, {r: tuple(map(Action.parse, tables[r])) for r in range(pp)}, style="v")
    for cost in (zb_stage_cost, _uniform):
        s = schedule_zb_v(pp, m, stage_cost=cost)
        span, theirs = (simulate(x, stage_cost=cost).makespan for x in (s, published))
        assert span <= theirs, cost  # never longer than the published table, at any m (1 ... 4p + 1 and a few more)
        ours, held = _held(s), _held(published)
        assert all(a <= b for a, b in zip(ours, held)), (cost, ours, held)
        assert max(simulate(s, stage_cost=cost).peak_inflight.values()) <= 2 * pp  # the published cap, F to W
