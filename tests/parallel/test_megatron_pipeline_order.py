"""The 1F1B and interleaved schedules are Megatron-LM's: on every pipeline rank the same forwards and backwards of
the same (model chunk, micro-batch) in the same order -- so the same warm-up count and the same activations held --
and the same micro-batch counts refused.

The reference is ``megatron_schedule/fixtures.json``, written by ``megatron_schedule/make_fixtures.py``, which runs
Megatron-LM's own ``forward_backward_pipelining_without_interleaving`` / ``..._with_interleaving`` (snapshot
d98e8a6, CPU and gloo) over logging model chunks for pp 2-4, vp 1-3 and every micro-batch count 1 ... 2 pp + 1, and
interleaved at vp 2-3 with ``--microbatch-group-size-per-virtual-pipeline-stage`` N = pp + 1 and pp + 2 (entry key
``n``) for every count 1 ... 3 pp + 1. Strings only: equality is exact.
"""
from __future__ import annotations

import json
import os

import pytest

from omnitron.core.config import ConfigError
from omnitron.core.parallel.pipeline import build_schedule

with open(os.path.join(os.path.dirname(__file__), "megatron_schedule", "fixtures.json")) as _f:
    FIXTURES = json.load(_f)


# Megatron's refusal (its exception's first line) -> omnitron's one-line ConfigError for the same case
REFUSALS = {"ValueError: The number of contiguous micro-batches": "must lie between --pipeline-model-parallel-size",
            "RuntimeError: The remainder of M": "the last group holds"}


def _case_id(e: dict) -> str:
    return "pp{pp}-vp{vp}-m{m}".format(**e) + (f"-n{e['n']}" if "n" in e else "")


@pytest.mark.parametrize("entry", FIXTURES["cases"], ids=_case_id)
def test_every_rank_runs_megatrons_order(entry):
    pp, vp, m, n = entry["pp"], entry["vp"], entry["m"], entry.get("n")
    name = "1f1b" if vp == 1 else "interleaved"
    if "error" in entry:  # Megatron refuses the count: so does omnitron, before any process starts
        want = "multiple of --pipeline-model-parallel-size" if n is None else next(
            ours for theirs, ours in REFUSALS.items() if entry["error"].startswith(theirs))
        with pytest.raises(ConfigError, match=want) as info:
            build_schedule(name, pp, vp, m, n)
        assert "\n" not in str(info.value)
        return
    schedule = build_schedule(name, pp, vp, m, n)
    for rank, want in enumerate(entry["tables"]):
        assert [str(a) for a in schedule.tables[rank]] == want, (rank, schedule.format())


def test_fixtures_hold_the_cases_the_order_hinges_on():
    """Interleaving with m == pp has a steady state on the last rank (a backward before its last forward: older
    Megatron releases ran every forward as warm-up there), counts below pp and off its multiples are refused,
    and 1F1B takes fewer micro-batches than stages."""
    def steady(table):
        return table.index(next(a for a in table if "B" in a)) < max(i for i, a in enumerate(table) if "F" in a)

    cases = [e for e in FIXTURES["cases"] if "n" not in e]
    assert all(steady(e["tables"][-1]) for e in cases if e["vp"] > 1 and e["m"] == e["pp"])
    assert sum(e["vp"] > 1 and e["m"] == e["pp"] for e in cases) == 6
    assert {(e["vp"] > 1 and e["m"] % e["pp"] != 0) for e in cases if "error" in e} == {True}
    assert all("tables" in e for e in cases if e["vp"] == 1 and e["m"] < e["pp"])

