"""A log line's loss and counts over its --log-interval, against Megatron-LM's ``training_log`` (d98e8a6)
transcribed here: the LM loss summed over the iterations that were not skipped and divided by their number
(``advanced iterations``), the skipped ones counted, and those of them whose loss was not finite counted as
``nan iterations``; and the validation perplexity capped as Megatron's. Tolerance: the same few float64 sums in
another order, 1e-12 relative."""
from __future__ import annotations

import json
import random

import pytest

from omnitron.core.training.metrics import MetricsLogger


def _megatron_interval(steps: list[tuple[float, bool]]) -> tuple[float, int, int]:
    """(lm loss, skipped, nan) as Megatron's training_log accumulates them over one interval."""
    total, advanced, skipped, nan = 0.0, 0, 0, 0
    for loss, skip in steps:
        if not skip:
            total, advanced = total + loss, advanced + 1
        else:
            skipped += 1
            nan += int(loss in (float("inf"), -float("inf")) or loss != loss)
    return total / max(1, advanced), skipped, nan


def _records(tmp_path, steps: list[tuple[float, bool]], interval: int) -> list[dict]:
    log = MetricsLogger(log_dir=str(tmp_path), log_interval=interval, train_iters=len(steps), enabled=True,
                        tensorboard=False, progress_bar=False, start_iteration=0)
    for i, (loss, skip) in enumerate(steps):
        log.step(i + 1, {"lm_loss": loss, "lr": 1e-3, "grad_norm": None if skip else 1.0, "loss_scale": 2.0 ** 16,
                         "skipped": skip, "step_time_s": 0.1, "tokens_per_sec": 1.0, "tflops_per_device": None,
                         "mfu": None, "peak_memory_bytes": None})
    log.close()
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_skipped_iterations_leave_the_loss_average(tmp_path):
    """fp16 overflows skip steps (one of them with an infinite loss): each record's loss is the mean over the
    steps that updated the weights, its counts Megatron's. Failed before: the skipped steps' losses were
    averaged in (an infinite one made the whole line's loss inf) and nan iterations were not counted."""
    rng = random.Random(3)
    steps = [(rng.uniform(2.0, 9.0), rng.random() < 0.4) for _ in range(12)]
    steps[5] = (float("inf"), True)
    steps[6] = (rng.uniform(2.0, 9.0), False)
    recs = _records(tmp_path, steps, 4)
    assert [r["iteration"] for r in recs] == [4, 8, 12]
    for r, start in zip(recs, (0, 4, 8)):
        loss, skipped, nan = _megatron_interval(steps[start:start + 4])
        if skipped < 4:  # at least one step advanced (Megatron prints no average of nothing)
            assert r["lm_loss"] == pytest.approx(loss, rel=1e-12)
        assert (r["skipped_iters"], r["nan_iters"]) == (skipped, nan)
    assert recs[1]["nan_iters"] == 1


def test_an_interval_skipped_whole_reports_its_steps_mean(tmp_path):
    """Every step of the interval skipped (the start of an fp16 run): Megatron has no advanced step to average,
    the record keeps the mean of the skipped steps' losses (finite ones here) rather than a made-up zero."""
    steps = [(7.5, True), (6.5, True), (5.0, False), (4.0, False)]
    recs = _records(tmp_path, steps, 2)
    assert recs[0]["lm_loss"] == pytest.approx(7.0, rel=1e-12) and recs[0]["skipped_iters"] == 2
    assert recs[1]["lm_loss"] == pytest.approx(4.5, rel=1e-12) and recs[1]["skipped_iters"] == 0


@pytest.mark.parametrize("loss", [3.7, 19.5, 27.0, 45.0])
def test_validation_perplexity_is_megatrons(monkeypatch, loss):
    """The validation record's ppl is Megatron's ``math.exp(min(20, loss))`` (evaluate_and_print_results) for the
    mean loss of the evaluated batches. Failed before: the cap was at 50 (a diverged run's ppl 3e11, not 5e8)."""
    import math
    import types

    from omnitron.core.training import step

    losses = iter([loss - 0.5, loss + 0.5])
    monkeypatch.setattr(step, "_run", lambda c, it, **kw: (next(losses), 64.0))
    c = types.SimpleNamespace(modules=[], chunks=[], groups=types.SimpleNamespace(cp=types.SimpleNamespace(size=1)),
                              settings=types.SimpleNamespace(training=types.SimpleNamespace(
                                  calculate_per_token_loss=False), data=types.SimpleNamespace()), model=None)
    monkeypatch.setattr(step, "_stage_iterator", lambda c, it: it)
    out = step.evaluate(c, iter(()), 2)
    assert out["val_loss"] == pytest.approx(loss, rel=1e-12)
    assert out["val_ppl"] == pytest.approx(math.exp(min(20, loss)), rel=1e-12)


@pytest.mark.parametrize("scale", [0.5, 0.25, 3.0, 2.0 ** 16])
def test_the_loss_scale_prints_as_megatrons(tmp_path, capsys, scale):
    """The log line's loss scale is printed as Megatron's ``training_log`` prints it (``{:.1f}``): a scale below
    one (a constant --loss-scale, or dynamic scaling near its --min-loss-scale) no longer reads as 0."""
    log = MetricsLogger(log_dir=str(tmp_path), log_interval=1, train_iters=1, enabled=True, tensorboard=False,
                        progress_bar=False, start_iteration=0)
    log.step(1, {"lm_loss": 3.0, "lr": 1e-3, "grad_norm": 1.0, "loss_scale": scale, "skipped": False,
                 "step_time_s": 0.1, "tokens_per_sec": 1.0, "tflops_per_device": None, "mfu": None,
                 "peak_memory_bytes": None})
    log.close()
    assert f"| loss scale {scale:.1f} |" in capsys.readouterr().out
