"""A log line's loss and counts over its --log-interval, against Megatron-LM's ``training_log`` (d98e8a6)
transcribed here: the LM loss summed over the iterations that were not skipped and divided by their number
(``advanced iterations``), the skipped ones counted, and those of them whose loss was not finite counted as
``nan iterations``; and the validation perplexity capped as Megatron's. Tolerance: the same few float64 sums in
another order, 1e-12 relative."""
from __future__ import annotations

import json
import math
import os
import random

import pytest

from omnitron.core.training.metrics import MetricsLogger
from omnitron.testing.megatron_log import parse_training_line


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


def _megatron_log(steps: list[tuple[float, bool]], interval: int) -> list[dict]:
    """Megatron's console lines, as its training_log keeps ``total_loss_dict`` over the whole run with
    ``--log-interval`` and ``--tensorboard-log-interval`` both ``interval``: a line at each multiple of ``interval``
    and at the process's first iteration (``is_first_iteration``, which resets nothing); ``printed``: the line's
    ``lm loss`` or None where it has none (the key appears at the first advanced step and is reset to 0 after each
    line, so an interval without an advanced step prints 0 / max(1, 0); an average not >= 0 is left out),
    ``skipped`` and ``nan`` its counts, ``tb`` the TensorBoard ``lm loss`` (the iteration's own ``loss_dict``, skipped
    or not; None at a first-iteration line that is not a multiple). NOTE: where the first iteration is itself a
    multiple (--log-interval 1) Megatron resets nothing either, so its second line averages iterations 1 and 2;
    omnitron's second line is iteration 2's own, the one difference (transcribed as omnitron does it): a bug of
    Megatron's (training.py 3289, ``should_reset = not is_first_iteration``), whose own timers line at that
    iteration divides the two iterations' time by --log-interval (1), and whose comment there wants the interval's
    statistics kept accurate."""
    total, advanced, skipped, nan, out = None, 0, 0, 0, []
    for i, (loss, skip) in enumerate(steps, 1):
        if not skip:
            total, advanced = (total or 0.0) + loss, advanced + 1
        skipped, nan = skipped + skip, nan + (skip and not math.isfinite(loss))
        if i % interval == 0 or i == 1:
            avg = None if total is None else total / max(1, advanced)
            out.append({"iteration": i, "printed": avg if avg is None or avg >= 0.0 else None, "skipped": skipped,
                        "nan": nan, "tb": loss if i % interval == 0 else None})
        if i % interval == 0:
            total, advanced, skipped, nan = (None if total is None else 0.0), 0, 0, 0
    return out


class _Board:
    """A stand-in SummaryWriter: (tag, value, step) of each scalar."""

    def __init__(self) -> None:
        self.scalars = []

    def add_scalar(self, tag, value, step) -> None:
        self.scalars.append((tag, value, step))

    def close(self) -> None:
        pass


def _logged(tmp_path, capsys, steps: list[tuple[float, bool]], interval: int):
    """(records, the printed lines, the TensorBoard ``lm loss`` values) of a run of ``steps``."""
    log = MetricsLogger(log_dir=str(tmp_path), log_interval=interval, train_iters=len(steps), enabled=True,
                        tensorboard=False, progress_bar=False, start_iteration=0)
    log._tb = board = _Board()
    for i, (loss, skip) in enumerate(steps):
        log.step(i + 1, {"lm_loss": loss, "lr": 1e-3, "grad_norm": None if skip else 1.0, "loss_scale": 2.0 ** 16,
                         "skipped": skip, "step_time_s": 0.1, "tokens_per_sec": 1.0, "tflops_per_device": None,
                         "mfu": None, "peak_memory_bytes": None})
    log.close()
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lines = [p for p in map(parse_training_line, capsys.readouterr().out.splitlines()) if p]
    return recs, lines, [v for tag, v, _ in board.scalars if tag == "lm loss"]


@pytest.mark.parametrize("interval", [1, 3])
def test_an_interval_skipped_whole_logs_as_megatron(tmp_path, capsys, interval):
    """fp16 runs start with skipped steps (the initial scale 2^32 overflows) and may skip whole intervals later,
    some with a non-finite loss. The line's loss is Megatron's: none before any step advanced, 0 for a later
    interval without an advanced step (its empty sum), the average otherwise (printed as ``.6E``: 5e-7
    relative); TensorBoard's ``lm loss`` is Megatron's at --log-interval 1 (each step's own loss, skipped or not)
    and for a skipped interval the last step's; the record's loss is None there (no average exists). Failed
    before: such an interval logged the mean of its skipped losses everywhere, nan when one was nan."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    steps = [(rng.uniform(2.0, 9.0), True) for _ in range(2 * interval)]  # two intervals before any advance
    steps += [(rng.uniform(2.0, 9.0), rng.random() < 0.3) for _ in range(3 * interval)]
    steps += [(rng.uniform(2.0, 9.0), False)] + [(rng.uniform(2.0, 9.0), True)] * (2 * interval - 1)
    steps += [(float("nan"), True)] * interval + [(float("inf"), True)] * interval  # overflowed forwards
    steps += [(rng.uniform(2.0, 9.0), rng.random() < 0.3) for _ in range(2 * interval)]
    recs, lines, board = _logged(tmp_path, capsys, steps, interval)
    want = _megatron_log(steps, interval)
    assert len(lines) == len(want) and len(recs) == len(board) == len([w for w in want if w["tb"] is not None])
    for line, w in zip(lines, want):
        assert ("lm_loss" in line) == (w["printed"] is not None), line
        if w["printed"] is not None:
            assert line["lm_loss"] == pytest.approx(w["printed"], rel=5e-7, abs=1e-300)
    for rec, tb, w in zip(recs, board, [w for w in want if w["tb"] is not None]):
        chunk = steps[w["iteration"] - interval:w["iteration"]]
        if all(skip for _, skip in chunk):
            assert rec["lm_loss"] is None
            assert tb == chunk[-1][0] or (math.isnan(tb) and math.isnan(chunk[-1][0]))
        elif interval == 1:
            assert tb == w["tb"]


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
    assert f"| loss scale: {scale:.1f} |" in capsys.readouterr().out


# the Megatron parser's field name -> Megatron's training_log label, for the fields compared here
_LABELS = {"lm_loss": "lm loss", "loss_scale": "loss scale", "grad_norm": "grad norm", "num_zeros": "num zeros",
           "skipped_iterations": "number of skipped iterations", "nan_iterations": "number of nan iterations"}


def _megatron_fields(printed: float | None, loss_scale: float | None, grad_norm: float | None,
                     num_zeros: int | None, skipped: int, nan: int) -> dict:
    """The fields of Megatron's console line among ``_LABELS`` (training_log at d98e8a6, transcribed): the loss
    when its average exists and is ``>= 0.0``; the loss scale always (training's loop passes 1.0 where the optimizer
    has no scaler: bf16, fp32); the grad norm and zeros when not None; the skipped and nan counts always."""
    out = {"loss scale": 1.0 if loss_scale is None else loss_scale, "number of skipped iterations": skipped,
           "number of nan iterations": nan}
    if printed is not None:
        out["lm loss"] = printed
    if grad_norm is not None:
        out["grad norm"] = grad_norm
    if num_zeros is not None:
        out["num zeros"] = num_zeros
    return out


def _fields(line: dict) -> dict:
    """The ``_LABELS`` fields of one parsed line, under Megatron's labels."""
    return {_LABELS[k]: v for k, v in line.items() if k in _LABELS}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_the_console_fields_are_megatrons(tmp_path, capsys, precision):
    """Field by field against Megatron's console line (``_megatron_fields``) at --log-interval 1 and 2 on fresh
    random steps: bf16 and fp32 show loss scale 1.0 and the skipped / nan counts (Megatron prints them for every
    precision), an fp16 step skipped on overflow has no grad norm or zeros, and a nan average (a bf16 step gone
    nan with the check off) is left out. Values to their printed precision: the loss ``.6E`` (5e-7 relative), the
    norm 3 decimals (5e-4), the scale 1 (0.05). Failed before: bf16 / fp32 lines had no loss scale, skipped or nan
    fields, a skipped step printed ``grad norm -`` and ``num zeros -``, and a nan average printed ``loss nan``."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    for interval in (1, 2):
        steps = []
        for i in range(8):
            skip = precision == "fp16" and rng.random() < 0.4
            loss = float("nan") if i == 5 and precision == "bf16" else rng.uniform(2.0, 9.0)
            steps.append({"lm_loss": float("inf") if skip and i == 3 else loss, "lr": 1e-3,
                          "grad_norm": None if skip else rng.uniform(0.1, 5.0), "skipped": skip,
                          "loss_scale": 2.0 ** rng.randint(-2, 20) if precision == "fp16" else None,
                          "num_zeros_in_grad": None if skip else rng.randint(0, 99), "step_time_s": 0.1,
                          "tokens_per_sec": 1.0, "tflops_per_device": None, "mfu": None, "peak_memory_bytes": None})
        log = MetricsLogger(log_dir=str(tmp_path / str(interval)), log_interval=interval, train_iters=len(steps),
                            enabled=True, tensorboard=False, progress_bar=False, start_iteration=0)
        for i, values in enumerate(steps):
            log.step(i + 1, values)
        log.close()
        lines = [p for p in map(parse_training_line, capsys.readouterr().out.splitlines()) if p]
        want_lines = _megatron_log([(v["lm_loss"], v["skipped"]) for v in steps], interval)
        assert len(lines) == len(want_lines) == len(steps) // interval + (interval > 1)
        for line, w in zip(lines, want_lines):
            last = steps[w["iteration"] - 1]
            want = _megatron_fields(w["printed"], last["loss_scale"], last["grad_norm"], last["num_zeros_in_grad"],
                                    w["skipped"], w["nan"])
            got = _fields(line)
            assert set(got) == set(want), line
            for key, rel, tol in (("lm loss", 5e-7, 1e-300), ("grad norm", 0, 5e-4), ("loss scale", 0, 0.05)):
                if key in want:
                    assert got[key] == pytest.approx(want[key], rel=rel, abs=tol), (key, line)
            for key in ("num zeros", "number of skipped iterations", "number of nan iterations"):
                assert got.get(key) == want.get(key), (key, line)


def test_a_resumed_process_prints_its_first_iteration(tmp_path, capsys):
    """Megatron's is_first_iteration is the process's first, after a resume too: a run resumed at 4 with
    --log-interval 3 prints 5 (console only: metrics.jsonl and TensorBoard keep their interval), 6 and 9, and 6's
    line averages 5 and 6 (the first line resets nothing)."""
    log = MetricsLogger(log_dir=str(tmp_path), log_interval=3, train_iters=9, enabled=True, tensorboard=False,
                        progress_bar=False, start_iteration=4)
    losses = {it: random.uniform(2.0, 9.0) for it in range(5, 10)}
    for it, loss in losses.items():
        log.step(it, {"lm_loss": loss, "lr": 1e-3, "grad_norm": 1.0, "loss_scale": None, "skipped": False,
                      "step_time_s": 0.1, "tokens_per_sec": 1.0, "tflops_per_device": None, "mfu": None,
                      "peak_memory_bytes": None})
    log.close()
    lines = [p for p in map(parse_training_line, capsys.readouterr().out.splitlines()) if p]
    assert [ln["iteration"] for ln in lines] == [5, 6, 9]
    assert [ln["lm_loss"] for ln in lines] == pytest.approx(
        [losses[5], (losses[5] + losses[6]) / 2, (losses[7] + losses[8] + losses[9]) / 3], rel=5e-7)  # .6E
    assert [json.loads(ln)["iteration"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [6, 9]
