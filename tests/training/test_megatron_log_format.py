"""omnitron's console lines are Megatron-LM's (megatron/training/training.py at d98e8a6), so that a log parser
written for Megatron reads them: training_log's accumulation and format strings (lines 3291-3315 and 3567-3641) and
evaluate_and_print_results' (lines 5372-5400, prefixes of lines 2078, 2109 and 4926) are transcribed below and
applied to fresh random values; omnitron's line must begin with Megatron's, character for character, and carry
only further `` name: value |`` fields after it. A parser of the kind users write for Megatron's lines
(:mod:`omnitron.testing.megatron_log`) reads each field back.

What is compared is the text: the transcription sums the losses in float64 in iteration order, as omnitron does
(Megatron's float32 device sums can differ from that in the last printed digit, which is not a matter of format),
and takes the two measured numbers, the elapsed time's mean and the throughput, from omnitron's record (their
arithmetic is tests/training/test_log_throughput.py's). The learning rate is fed as given: omnitron prints the rate
the step applied, Megatron its scheduler's after the step (docs/megatron-flags.md, "Learning rate").
"""
from __future__ import annotations

import datetime
import json
import math
import os
import random

import pytest

from omnitron.core.training import metrics
from omnitron.core.training.metrics import MetricsLogger
from omnitron.testing.megatron_log import extra_fields, parse_training_line, parse_validation_line

ADVANCED, SKIPPED, NAN = "advanced iterations", "skipped iterations", "nan iterations"
MEGATRON_LABELS = {"consumed samples", "elapsed time per iteration (ms)", "throughput per GPU (TFLOP/s/GPU)",
                   "learning rate", "global batch size", "lm loss", "sop loss", "loss scale", "grad norm",
                   "num zeros", "params norm", "number of skipped iterations", "number of nan iterations"}


class _MegatronLog:
    """training_log's ``total_loss_dict`` bookkeeping and console line, transcribed (``log_throughput``:
    --log-throughput)."""

    def __init__(self, train_iters: int, log_interval: int, log_throughput: bool) -> None:
        self.train_iters, self.log_interval, self.log_throughput = train_iters, log_interval, log_throughput
        self.total_loss_dict: dict = {}
        self.times: list[float] = []

    def step(self, loss_dict: dict, skipped_iter: bool, step_time: float) -> None:
        """Lines 3291-3315: advanced, skipped and nan iterations; the losses of the advanced ones summed."""
        d = self.total_loss_dict
        if not skipped_iter:
            d[ADVANCED] = d.get(ADVANCED, 0) + 1
        elif ADVANCED not in d:
            d[ADVANCED] = 0
        d[SKIPPED] = d.get(SKIPPED, 0) + skipped_iter
        got_nan = False
        for key in loss_dict:
            if not skipped_iter:
                d[key] = d.get(key, 0.0) + loss_dict[key]
            else:
                value = loss_dict[key]
                got_nan = got_nan or value == float("inf") or value == -float("inf") or value != value
        d[NAN] = d.get(NAN, 0) + int(got_nan)
        self.times.append(step_time)

    def line(self, now, iteration, consumed, throughput, learning_rate, batch_size, loss_scale, grad_norm,
             num_zeros_in_grad, params_norm, is_first_iteration) -> str:
        """Lines 3567-3641 (``elapsed_time_per_iteration``: the interval's time over its iterations), and the
        reset of the sums after a line that is not the process's first (``should_reset``)."""
        d, should_reset = self.total_loss_dict, not is_first_iteration
        elapsed_time_per_iteration = sum(self.times) / (d[ADVANCED] + d[SKIPPED])
        log_string = f" [{now.strftime('%Y-%m-%d %H:%M:%S.%f')}]"
        log_string += ' iteration {:8d}/{:8d} |'.format(iteration, self.train_iters)
        log_string += ' consumed samples: {:12d} |'.format(consumed)
        log_string += ' elapsed time per iteration (ms): {:.1f} |'.format(elapsed_time_per_iteration * 1000.0)
        if self.log_throughput:
            log_string += f' throughput per GPU (TFLOP/s/GPU): {throughput:.1f} |'
        if learning_rate is not None:
            log_string += f' learning rate: {learning_rate:.6E} |'
        log_string += f' global batch size: {batch_size:5d} |'
        for key in d:
            if key not in [ADVANCED, SKIPPED, NAN]:
                avg = d[key] / float(max(1, d[ADVANCED]))
                if avg >= 0.0:
                    log_string += ' {}: {:.6E} |'.format(key, avg)
                if should_reset:
                    d[key] = 0.0
        log_string += f' loss scale: {loss_scale:.1f} |'
        if grad_norm is not None:
            log_string += f' grad norm: {grad_norm:.3f} |'
        if num_zeros_in_grad is not None:
            log_string += f' num zeros: {num_zeros_in_grad} |'
        if params_norm is not None:
            log_string += f' params norm: {params_norm:.3f} |'
        log_string += ' number of skipped iterations: {:3d} |'.format(d[SKIPPED])
        log_string += ' number of nan iterations: {:3d} |'.format(d[NAN])
        if should_reset:
            d[ADVANCED] = d[SKIPPED] = d[NAN] = 0
            self.times = []
        return log_string


def _megatron_validation(prefix: str, total_loss_dict: dict) -> list[str]:
    """evaluate_and_print_results' three printed lines (lines 5372-5400, no ``--multiple-validation-sets``)."""
    suffix = ""
    string = f' validation{suffix} loss at {prefix} | '
    for key in total_loss_dict:
        string += '{} value: {:.6E} | '.format(key, total_loss_dict[key])
        ppl = math.exp(min(20, total_loss_dict[key]))
        string += '{} PPL: {:.6E} | '.format(key, ppl)
    length = len(string) + 1
    return ['-' * length, string, '-' * length]


def _steps(rng: random.Random, kind: str, n: int) -> list[dict]:
    """``n`` iterations' values as the loop gives them: fp16 skips steps (no grad norm, zeros; some with an infinite
    loss) under a random scale; bf16 has a nan loss at one step (the loss check off); bert is fp16 with a
    sentence-order loss; "extras" has omnitron's own fields (decoupled lr, scheduled weight decay, MoE and MTP
    losses)."""
    out = []
    for i in range(n):
        skip = kind in ("fp16", "bert") and rng.random() < 0.35
        loss = float("nan") if kind == "bf16" and i == 4 else rng.uniform(0.5, 11.0)
        v = {"lm_loss": float("inf") if skip and rng.random() < 0.3 else loss, "lr": rng.uniform(0.0, 3e-3),
             "grad_norm": None if skip else rng.uniform(0.01, 40.0), "skipped": skip,
             "loss_scale": 2.0 ** rng.randint(-3, 24) if kind in ("fp16", "bert") else None,
             "num_zeros_in_grad": None if skip or i % 2 else rng.randint(0, 10 ** 7),
             "step_time_s": rng.uniform(0.001, 30.0), "tokens_per_sec": rng.uniform(10, 1e6),
             "tflops_per_device": rng.uniform(0.01, 900.0), "tokens_per_sec_per_device": rng.uniform(1, 1e5),
             "mfu": rng.choice([None, rng.uniform(0.0, 0.7)]), "peak_memory_bytes": rng.randint(0, 2 ** 36),
             "consumed_samples": 0, "global_batch_size": rng.choice([1, 8, 512, 16384]),
             "log": {"params_norm": rng.uniform(1.0, 3e3)} if i % 3 else {}}
        if kind == "bert":
            v["sop_loss"] = float("inf") if skip and rng.random() < 0.3 else rng.uniform(0.1, 1.5)
        if kind == "extras":
            v.update(decoupled_lr=rng.uniform(0, 1e-2), weight_decay=rng.uniform(0, 0.1),
                     moe_aux_loss=rng.uniform(0, 1), mtp_loss=rng.uniform(0, 9))
        out.append(v)
    consumed = rng.randint(0, 10 ** 6)
    for v in out:
        consumed += v["global_batch_size"]
        v["consumed_samples"] = consumed
    return out


def _fixed_clock(monkeypatch, rng: random.Random) -> list:
    """omnitron's wall clock replaced by fresh random instants (microseconds included); returns them in order."""
    stamps = []

    def now():
        stamps.append(datetime.datetime(2026, rng.randint(1, 12), rng.randint(1, 28), rng.randint(0, 23),
                                        rng.randint(0, 59), rng.randint(0, 59), rng.randint(0, 999999)))
        return stamps[-1]
    monkeypatch.setattr(metrics, "_wall_clock", now)
    return stamps


def _loss_dict(v: dict) -> dict:
    """The iteration's ``loss_dict`` as the model's loss function reports it (pretrain_bert's: lm, then sop)."""
    return {"lm loss": v["lm_loss"], **({"sop loss": v["sop_loss"]} if "sop_loss" in v else {})}


@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp16", "bert", "extras"])
@pytest.mark.parametrize("interval,start,throughput", [(1, 0, False), (3, 0, True), (4, 5, False), (2, 3, True)])
def test_training_lines_are_megatrons(tmp_path, capsys, monkeypatch, kind, interval, start, throughput):
    """Every printed training line (the process's first iteration, each multiple of --log-interval: Megatron's
    training_log condition) begins with the line Megatron's training_log prints for the same iterations, flags and
    values, character for character; omnitron's own fields follow as `` name: value |`` with names Megatron's line
    does not use, the ETA always among them. A last iteration off the interval gets no line, as Megatron's, but its
    record (metrics.jsonl). Failed before: omnitron's labels and formats (``iter      7/20 | samples ... | loss
    5.1234 | lr ...``) matched none of Megatron's; later, a line was printed at a last iteration off the interval."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    stamps = _fixed_clock(monkeypatch, rng)
    n = 9
    steps = _steps(rng, kind, n)
    log = MetricsLogger(log_dir=str(tmp_path), log_interval=interval, train_iters=start + n, enabled=True,
                        tensorboard=False, progress_bar=False, start_iteration=start, throughput=throughput)
    for it, v in enumerate(steps, start + 1):
        log.step(it, v)
    log.close()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(" [")]
    printed = [it for it in range(start + 1, start + n + 1) if it == start + 1 or it % interval == 0]
    recorded = [json.loads(r)["iteration"] for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert recorded == [it for it in printed if it % interval == 0] + [start + n] * ((start + n) % interval != 0)
    assert len(lines) == len(printed) == len(stamps) - ((start + n) % interval != 0)  # the last record's clock
    ref, flops = _MegatronLog(start + n, interval, throughput), []
    for it, v in enumerate(steps, start + 1):
        ref.step(_loss_dict(v), v["skipped"], v["step_time_s"])
        flops.append(v["tflops_per_device"] * v["step_time_s"])  # the step's work (TFLOP per device)
        if it not in printed:
            continue
        line, now = lines[printed.index(it)], stamps[printed.index(it)]
        rate = sum(flops) / sum(ref.times)  # the interval's work over its time, as Megatron's throughput
        # NOTE: where the process's first iteration is itself a multiple of --log-interval, Megatron resets nothing
        # after its line either (its next line averages both); omnitron's next line starts afresh, a difference
        # kept (Megatron's bug: tests/training/test_log_averages.py) and transcribed here as omnitron does it
        first = it == start + 1 and it % interval != 0
        if not first:
            flops = []
        scale = 1.0 if v["loss_scale"] is None else v["loss_scale"]  # Megatron's bf16 / fp32 optimizers: 1.0
        want = ref.line(now, it, v["consumed_samples"], rate, v["lr"], v["global_batch_size"], scale,
                        v["grad_norm"], v["num_zeros_in_grad"], v["log"].get("params_norm"), first)
        assert line.startswith(want), f"\n{line}\n{want}"
        extras = extra_fields(line)
        assert line == want + "".join(f" {k}: {x} |" for k, x in extras.items())
        assert "ETA" in extras and not set(extras) & MEGATRON_LABELS, extras


@pytest.mark.parametrize("kind", ["fp32", "bf16", "fp16", "bert"])
def test_a_megatron_parser_reads_every_field(tmp_path, capsys, kind):
    """A Megatron log parser (a regular expression per field, :mod:`omnitron.testing.megatron_log`) reads each
    logged line's fields back equal to metrics.jsonl's record, to the printed precision: ``.6E`` (half a unit in the
    7th digit, 5e-7 relative), ``.3f`` (5e-4), ``.1f`` (0.05); the counts and sizes exactly. Failed before: the
    parser found no line."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    steps = _steps(rng, kind, 8)
    log = MetricsLogger(log_dir=str(tmp_path), log_interval=2, train_iters=8, enabled=True, tensorboard=False,
                        progress_bar=False, start_iteration=0, throughput=True)
    for it, v in enumerate(steps, 1):
        log.step(it, v)
    log.close()
    parsed = {p["iteration"]: p for p in map(parse_training_line, capsys.readouterr().out.splitlines()) if p}
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sorted(parsed) == [1, 2, 4, 6, 8] and [r["iteration"] for r in recs] == [2, 4, 6, 8]
    for rec in recs:
        p = parsed[rec["iteration"]]
        assert p["train_iters"] == 8
        for name, key in (("consumed_samples", "consumed_samples"), ("global_batch_size", "global_batch_size"),
                          ("skipped_iterations", "skipped_iters"), ("nan_iterations", "nan_iters"),
                          ("num_zeros", "num_zeros_in_grad")):
            assert p.get(name) == rec.get(key), name
        for name, key, tol in (("learning_rate", "lr", 5e-7), ("lm_loss", "lm_loss", 5e-7),
                               ("sop_loss", "sop_loss", 5e-7)):
            if rec.get(key) is None or not rec[key] >= 0.0:
                assert name not in p or p[name] == 0.0, name  # Megatron's 0: an interval skipped whole
            else:
                assert p[name] == pytest.approx(rec[key], rel=tol, abs=1e-300), name
        for name, key, tol in (("grad_norm", "grad_norm", 5e-4), ("params_norm", "params_norm", 5e-4),
                               ("loss_scale", "loss_scale", 0.05), ("throughput", "tflops_per_device", 0.05)):
            want = 1.0 if key == "loss_scale" and rec[key] is None else rec.get(key)
            assert (name in p) == (want is not None), name
            if want is not None:
                assert p[name] == pytest.approx(want, abs=tol * (1 + 1e-9)), name
        assert p["elapsed_ms"] == pytest.approx(rec["step_time_s"] * 1e3, abs=0.05 * (1 + 1e-9))


@pytest.mark.parametrize("split,after", [("val", False), ("val", True), ("test", True)])
@pytest.mark.parametrize("bert", [False, True])
def test_validation_lines_are_megatrons(tmp_path, capsys, split, after, bert):
    """A validation or test evaluation prints evaluate_and_print_results' three lines exactly (prefix ``iteration
    N`` during training, ``iteration N on validation set`` / ``on test set`` after it; PPL ``exp(min(20, loss))``,
    so losses past 20 are drawn too; BERT's ``sop loss`` after ``lm loss``), and the parser reads the values back.
    Failed before: omnitron printed ``[time] iter      N | validation loss 5.1234 | ppl 168.99``."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    loss, sop = rng.uniform(0.0, 30.0), rng.uniform(0.0, 2.0)
    values = {f"{split}_loss": loss, f"{split}_ppl": math.exp(min(20.0, loss))}
    if bert:
        values[f"{split}_sop_loss"] = sop
    it = rng.randint(1, 10 ** 6)
    log = MetricsLogger(log_dir=str(tmp_path), log_interval=1, train_iters=it, enabled=True, tensorboard=False,
                        progress_bar=False, start_iteration=0)
    log.validation(it, values, consumed_samples=4 * it, after_training=after)
    log.close()
    out = capsys.readouterr().out.splitlines()
    prefix = f"iteration {it}" + ((" on test set" if split == "test" else " on validation set") if after else "")
    want = _megatron_validation(prefix, {"lm loss": loss, **({"sop loss": sop} if bert else {})})
    assert out == want
    p = parse_validation_line(out[1])
    assert p["iteration"] == it and p["split"] == ({"val": "validation", "test": "test"}[split] if after else None)
    assert p["losses"]["lm loss"] == pytest.approx((loss, math.exp(min(20.0, loss))), rel=5e-7)
    assert ("sop loss" in p["losses"]) == bert


def test_validation_line_prints_the_records_ppl():
    """The line's lm loss PPL is the record's ``val_ppl`` / ``test_ppl`` (computed once, with the loss), not a second
    ``exp``: a record whose ppl is not ``exp(min(20, loss))`` prints its own; the evaluation's record holds
    Megatron's value (``perplexity``, against ``math.exp`` of a fresh loss under and over the cap)."""
    from omnitron.core.training.log_lines import perplexity, validation_lines

    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    for split in ("val", "test"):
        loss, ppl = rng.uniform(0.0, 10.0), rng.uniform(1e3, 1e6)
        p = parse_validation_line(validation_lines(3, {f"{split}_loss": loss, f"{split}_ppl": ppl})[1])
        assert p["losses"]["lm loss"] == pytest.approx((loss, ppl), rel=5e-7)
    loss = rng.uniform(0.0, 40.0)
    assert perplexity(loss) == math.exp(min(20.0, loss))


def test_a_training_run_logs_megatrons_lines(tmp_path, capsys):
    """Through ``train`` (4 iterations, an evaluation every 2, the ones after training): the parser finds a
    training line for the first iteration and each logged one, equal to metrics.jsonl's records, and the
    validation lines with Megatron's prefixes, the evaluations after training naming their split."""
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    argv = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--log-interval", "2", "--eval-interval", "2",
            "--eval-iters", "1", "--num-workers", "0", "--no-tensorboard", "--log-dir", str(tmp_path / "logs"),
            "--data-cache-path", str(tmp_path / "cache")]
    train(parse_settings(argv, 1), get_backend("cpu"))
    out = capsys.readouterr().out.splitlines()
    recs = [json.loads(line) for line in open(tmp_path / "logs" / "metrics.jsonl")]
    lines = [p for p in map(parse_training_line, out) if p]
    assert [p["iteration"] for p in lines] == [1, 2, 4]
    for p, rec in zip(lines[1:], [r for r in recs if "lm_loss" in r]):
        assert (p["iteration"], p["consumed_samples"], p["global_batch_size"]) == (rec["iteration"], 4 * rec[
            "iteration"], 4)
        assert p["lm_loss"] == pytest.approx(rec["lm_loss"], rel=5e-7)
    evals = [(p["iteration"], p["split"], p["losses"]["lm loss"][0]) for p in map(parse_validation_line, out) if p]
    want = [(r["iteration"], s, r[k]) for r in recs for k, s in (("val_loss", None), ("test_loss", "test"))
            if k in r]
    want[2] = (want[2][0], "validation", want[2][2])  # the third validation is the one after training
    assert [(i, s) for i, s, _ in want] == [(2, None), (4, None), (4, "validation"), (4, "test")]
    assert [(i, s) for i, s, _ in evals] == [(i, s) for i, s, _ in want]
    assert [v for _, _, v in evals] == pytest.approx([v for _, _, v in want], rel=5e-7)
