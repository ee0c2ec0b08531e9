"""Each step's learning rate, decoupled rate, weight decay and batch size against Megatron-LM's own scheduler.

The fixtures (tests/data/megatron_schedule/fixtures.json) were written by Megatron's code at d98e8a6
(``make_fixtures.py`` beside them: its ``parse_args`` / ``validate_args`` on the same flags, its
``get_optimizer_param_scheduler`` and num-microbatches calculator, driven as its ``train`` drives them, skipped fp16
steps included; resume cases through its ``load_state_dict``). Here the same flags go through omnitron's
``parse_settings`` and the schedule the training step uses (:func:`make_scheduler`, the run's batch sizes).
"""
from __future__ import annotations

import json
import pathlib

import pytest

from omnitron.core.training.arguments import batch_ramp, parse_settings
from omnitron.core.training.components import make_scheduler

FIXTURES = json.loads((pathlib.Path(__file__).resolve().parents[1] / "data" / "megatron_schedule"
                       / "fixtures.json").read_text())
OURS = ["--mock-data"]
"""omnitron's data flag beside the fixtures' model flags (the schedule does not read the data)."""
REL = 1e-12
"""Both sides compute each value with a handful of float64 operations on the same integers (Megatron in samples,
omnitron in samples or their ratio to the batch size): they agree to a few ulp (2.2e-16 each); 1e-12 leaves room
for the different order of those operations and fails on any difference of schedule."""


def _settings(flags: str):
    return parse_settings(FIXTURES["model"] + OURS + flags.split(), 1)


def _check(sched, ramp, rows, skipped=(), done=0, consumed=0):
    """Step through ``rows`` ([lr, decoupled lr, weight decay, batch] per step) from ``done`` successful steps."""
    for i, (lr, decoupled, wd, gbs) in enumerate(rows):
        batch = ramp.global_batch(consumed)
        assert batch == gbs, (i, consumed)
        assert sched.lr_for_step(done, batch) == pytest.approx(lr, rel=REL, abs=1e-300), i
        ours = sched.decoupled_lr_for_step(done, batch)
        assert (lr if ours is None else ours) == pytest.approx(decoupled, rel=REL, abs=1e-300), i
        assert sched.wd_for_step(done, batch) == pytest.approx(wd, rel=REL, abs=1e-300), i
        consumed += batch
        if i not in skipped:
            done += 1
            sched.advance(batch)


@pytest.mark.parametrize("name", sorted(FIXTURES["cases"]))
def test_every_step_applies_megatrons_schedule(name):
    case = FIXTURES["cases"][name]
    s = _settings(case["flags"])
    _check(make_scheduler(s), batch_ramp(s.training, 1, s.model.seq_length), case["steps"], set(case["skipped"]))


@pytest.mark.parametrize("name", sorted(FIXTURES["resumes"]))
def test_resume_under_another_batch_size_is_megatrons(name):
    """Run A's schedule saved after some steps, loaded by run B (another --global-batch-size) with the flag that
    says whose schedule stands: B's steps apply Megatron's rates."""
    case = FIXTURES["resumes"][name]
    first, then = _settings(case["first"]), _settings(case["then"])
    old, ramp = make_scheduler(first), batch_ramp(first.training, 1, first.model.seq_length)
    consumed = 0
    for _ in range(case["done"]):
        old.advance(ramp.global_batch(consumed))
        consumed += ramp.global_batch(consumed)
    ck = then.checkpoint
    keep = "command line" if ck.override_opt_param_scheduler else "checkpoint"
    assert ck.override_opt_param_scheduler or ck.use_checkpoint_opt_param_scheduler
    new = make_scheduler(then)
    new.load_state_dict(old.state_dict(), keep)
    _check(new, batch_ramp(then.training, 1, then.model.seq_length), case["steps"], done=case["done"],
           consumed=consumed)
