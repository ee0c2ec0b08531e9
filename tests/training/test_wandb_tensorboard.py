"""The event files a user opens: TensorBoard's after a crash-style resume hold each iteration once (the resumed
run's values), read back with TensorBoard's own reader; wandb in offline mode (no network) logs what
metrics.jsonl has under Megatron's W&B keys, and asking for wandb without the package or without a run name stops with
the fix."""
from __future__ import annotations

import glob
import json
import os

import pytest

from omnitron.core.config.parallel import ConfigError
from omnitron.core.config.training import LoggingConfig
from omnitron.core.training.metrics import MetricsLogger
from omnitron.core.training.wandb_log import check_available


def _values(loss: float) -> dict:
    return {"lm_loss": loss, "lr": 0.1, "grad_norm": 1.0, "loss_scale": None, "skipped": False, "step_time_s": 0.5,
            "tokens_per_sec": 10.0, "consumed_samples": 4, "global_batch_size": 4}


def test_tensorboard_events_after_a_resume_hold_each_step_once(tmp_path):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    first = MetricsLogger(log_dir=str(tmp_path), log_interval=1, train_iters=6, enabled=True, tensorboard=True,
                          progress_bar=False, start_iteration=0)
    for it in range(1, 5):  # the crashed attempt got to 4; its checkpoint is at 2
        first.step(it, _values(10.0 + it))
    first.close()
    resumed = MetricsLogger(log_dir=str(tmp_path), log_interval=1, train_iters=6, enabled=True, tensorboard=True,
                            progress_bar=False, start_iteration=2)
    for it in range(3, 7):
        resumed.step(it, _values(20.0 + it))
    resumed.close()
    acc = accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("lm loss")  # Megatron's tag names
    assert [e.step for e in events] == [1, 2, 3, 4, 5, 6]
    assert [e.value for e in events] == [11.0, 12.0, 23.0, 24.0, 25.0, 26.0]
    assert [e.step for e in acc.Scalars("batch-size")] == [1, 2, 3, 4, 5, 6]


def test_wandb_offline_logs_the_records(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from omnitron.core.training.wandb_log import WandbRun

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = LoggingConfig(wandb_project="omnitron-test", wandb_exp_name="tiny", wandb_save_dir=str(tmp_path / "wb"))
    check_available(cfg)
    run = WandbRun(cfg, log_dir=str(tmp_path), config={"lr": 0.1})
    logged, real = [], run._run.log
    monkeypatch.setattr(run._run, "log", lambda values, step: (logged.append((step, values)), real(values, step=step)))
    logger = MetricsLogger(log_dir=str(tmp_path), log_interval=1, train_iters=2, enabled=True, tensorboard=False,
                           progress_bar=False, start_iteration=0, wandb=run)
    logger.step(1, _values(3.0))
    logger.step(2, _values(2.0))
    logger.close()
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [s for s, _ in logged] == [1, 2]
    for (_, values), rec in zip(logged, recs):
        assert values["lm loss"] == rec["lm_loss"] and values["samples vs steps"] == rec["consumed_samples"]
    runs = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1 and os.path.getsize(runs[0]) > 0


# Megatron's W&B keys (training_log, evaluate_and_print_results at d98e8a6) for the record keys that have them
MEGATRON_WANDB = {"lm_loss": "lm loss", "lr": "learning-rate", "global_batch_size": "batch-size",
                  "grad_norm": "grad-norm", "loss_scale": "loss-scale", "params_norm": "params-norm",
                  "num_zeros_in_grad": "num-zeros", "step_time_s": "iteration-time", "tflops_per_device": "throughput",
                  "consumed_samples": "samples vs steps",
                  "val_loss": "lm loss validation"}  # (the validation ppl: a TensorBoard tag; Megatron's W&B has none)


def test_wandb_keys_are_megatrons(tmp_path, monkeypatch):
    """What reaches wandb (a stand-in package recording its calls), with --log-timers-to-tensorboard and
    --log-throughput: each iteration's values under Megatron's W&B keys where Megatron logs the value, stepped by
    the iteration, equal to the metrics.jsonl record; the rest under their metrics.jsonl names; not the
    perplexity (TensorBoard's alone in Megatron) nor the first iteration's time. Failed before: every key was
    metrics.jsonl's (``lm_loss``, ``lr``), so a project holding Megatron runs got its charts split in two."""
    run, calls = _fake_wandb(monkeypatch, tmp_path, log_timers_to_tensorboard=True, log_throughput=True)
    logger = MetricsLogger(log_dir=str(tmp_path), log_interval=1, train_iters=2, enabled=True, tensorboard=False,
                           progress_bar=False, start_iteration=0, wandb=run)
    for it, loss in ((1, 3.0), (2, 2.0)):
        logger.step(it, {**_values(loss), "loss_scale": 1024.0, "params_norm": 7.5, "num_zeros_in_grad": 3,
                         "consumed_samples": 4 * it, "tflops_per_device": 0.25, "mfu": None})
    logger.validation(2, {"val_loss": 2.5, "val_ppl": 12.18}, consumed_samples=8)
    logger.close()
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [s for s, _ in calls] == [r["iteration"] for r in recs] == [1, 2, 2]
    for i, ((_, values), rec) in enumerate(zip(calls, recs)):
        left_out = {"val_ppl"} | ({"step_time_s"} if i == 0 else set())
        numbers = {k: v for k, v in rec.items() if k != "iteration" and isinstance(v, (int, float))
                   and not isinstance(v, bool) and k not in left_out}
        assert values == {MEGATRON_WANDB.get(k, k): v for k, v in numbers.items()}
    assert calls[0][1]["lm loss"] == 3.0 and calls[1][1]["samples vs steps"] == 8
    assert calls[2][1]["lm loss validation"] == 2.5


def test_wandb_needs_a_name_and_the_package(monkeypatch):
    import sys

    with pytest.raises(ConfigError, match="--wandb-project needs --wandb-exp-name"):
        check_available(LoggingConfig(wandb_project="p"))
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match=r"needs the wandb package: pip install 'omnitron\[wandb\]'"):
        check_available(LoggingConfig(wandb_project="p", wandb_exp_name="e"))
    check_available(LoggingConfig())  # not asked for: nothing to check


def test_tensorboard_dir_holds_megatrons_tags(tmp_path):
    """A run with Megatron's --tensorboard-dir D: EventAccumulator(D) itself finds Megatron's tags (training and
    validation, by iteration and ``vs samples``), each equal to the metrics.jsonl value it mirrors."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    tb = tmp_path / "tb"
    argv = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--lr-warmup-iters", "2", "--log-interval", "1",
            "--eval-interval", "2", "--eval-iters", "1", "--num-workers", "0", "--tensorboard-dir", str(tb),
            "--log-params-norm", "--log-validation-ppl-to-tensorboard", "--data-cache-path", str(tmp_path / "cache")]
    train(parse_settings(argv, 1), get_backend("cpu"))
    acc = accumulator.EventAccumulator(str(tb))
    acc.Reload()
    recs = [json.loads(line) for line in open(tb / "metrics.jsonl")]
    train_recs = [r for r in recs if "lm_loss" in r]
    val_recs = [r for r in recs if "val_loss" in r]
    samples = {r["iteration"]: r["consumed_samples"] for r in train_recs}
    for tag, key, rows in (("lm loss", "lm_loss", train_recs), ("learning-rate", "lr", train_recs),
                           ("grad-norm", "grad_norm", train_recs), ("params-norm", "params_norm", train_recs),
                           ("batch-size", "global_batch_size", train_recs),
                           ("lm loss validation", "val_loss", val_recs),
                           ("lm loss validation ppl", "val_ppl", val_recs)):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [r["iteration"] for r in rows], tag
        # the events hold float32: one rounding of the float64 record
        assert [e.value for e in events] == pytest.approx([r[key] for r in rows], rel=1e-7, abs=0), tag
        twin = acc.Scalars(f"{tag} vs samples")
        assert [e.step for e in twin] == [samples[r["iteration"]] for r in rows], tag
    assert [e.value for e in acc.Scalars("learning-rate")][0] == 0.0  # Megatron's first warm-up step: lr(0)
    assert len(val_recs) == 3 and not (tb / "tensorboard").exists()  # each --eval-interval, once more at the end
    assert "world-size" not in acc.Tags()["scalars"]  # only with --log-world-size-to-tensorboard
    # Megatron writes these two only with --log-timers-to-tensorboard (throughput: and --log-throughput)
    assert not {"iteration-time", "throughput"} & set(acc.Tags()["scalars"])
    # an fp32 run has no loss scaler: the records say None, TensorBoard gets Megatron's 1.0 (its fp32 optimizer's)
    assert all(r["loss_scale"] is None for r in train_recs)
    assert [(e.step, e.value) for e in acc.Scalars("loss-scale")] == [(r["iteration"], 1.0) for r in train_recs]


def _world_size_worker(root: str) -> None:
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    argv = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "64", "--log-interval", "1", "--num-workers", "0",
            "--tensorboard-dir", os.path.join(root, "tb"), "--log-world-size-to-tensorboard",
            "--disable-log-loss-scale-to-tensorboard", "--data-cache-path", os.path.join(root, "cache")]
    train(parse_settings(argv, 2), get_backend())


def test_world_size_reaches_tensorboard_when_asked(tmp_path):
    """--log-world-size-to-tensorboard on a data-parallel world of 2: Megatron's ``world-size`` tag holds 2 at
    each logged iteration and its ``vs samples`` twin is stepped by the consumed samples; metrics.jsonl has it.
    With Megatron's --disable-log-loss-scale-to-tensorboard (was refused as not implemented) no ``loss-scale``
    tag, while the records keep ``loss_scale``."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    from omnitron.testing.distributed import run_distributed

    run_distributed(_world_size_worker, 2, str(tmp_path))
    acc = accumulator.EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    recs = [json.loads(line) for line in open(tmp_path / "tb" / "metrics.jsonl") if "lm_loss" in line]
    assert [r["world_size"] for r in recs] == [2, 2]
    assert [(e.step, e.value) for e in acc.Scalars("world-size")] == [(1, 2.0), (2, 2.0)]
    assert [(e.step, e.value) for e in acc.Scalars("world-size vs samples")] == [(4, 2.0), (8, 2.0)]
    assert not [t for t in acc.Tags()["scalars"] if t.startswith("loss-scale")] and all("loss_scale" in r for r in recs)


class _Board:
    """A stand-in SummaryWriter: {tag: [(step, value)]}."""

    def __init__(self) -> None:
        self.tags: dict[str, list] = {}

    def add_scalar(self, tag, value, step) -> None:
        self.tags.setdefault(tag, []).append((step, value))

    def close(self) -> None:
        pass


def _fake_wandb(monkeypatch, tmp_path, **flags):
    """A WandbRun over a stand-in ``wandb`` package that records ``(step, values)`` of each ``log`` call."""
    import sys
    import types

    calls = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: types.SimpleNamespace(log=lambda values, step: calls.append((step, values)),
                                                   finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    from omnitron.core.training.wandb_log import WandbRun

    cfg = LoggingConfig(wandb_project="p", wandb_exp_name="tiny", wandb_save_dir=str(tmp_path / "wb"), **flags)
    return WandbRun(cfg, log_dir=str(tmp_path), config={}), calls


# Every TensorBoard tag and W&B key Megatron's training_log writes for what a record holds (d98e8a6)
MEGATRON_TAGS = {"learning-rate", "batch-size", "lm loss", "loss-scale", "world-size", "grad-norm", "num-zeros",
                 "params-norm", "mem-reserved-bytes", "mem-allocated-bytes", "mem-max-allocated-bytes",
                 "iteration-time", "throughput", "samples vs steps"}


def _megatron_writes(timers: bool, throughput: bool, loss_scale: bool, memory: bool, first: bool,
                     to_wandb: bool) -> set:
    """The tags (TensorBoard) or keys (W&B) Megatron's training_log writes at a logged iteration, transcribed:
    ``samples vs steps`` to W&B alone; learning-rate, batch-size, lm loss, grad-norm, num-zeros, params-norm
    always; loss-scale with --log-loss-scale-to-tensorboard; world-size with --log-world-size-to-tensorboard (set
    here); the memory tags with --log-memory-to-tensorboard, to TensorBoard alone; iteration-time with
    --log-timers-to-tensorboard and not at the process's first iteration; throughput with --log-throughput and
    --log-timers-to-tensorboard (also at the first iteration)."""
    out = {"learning-rate", "batch-size", "lm loss", "grad-norm", "num-zeros", "params-norm", "world-size"}
    out |= {"samples vs steps"} if to_wandb else set()
    out |= {"loss-scale"} if loss_scale else set()
    out |= {"mem-reserved-bytes", "mem-allocated-bytes", "mem-max-allocated-bytes"} if memory and not to_wandb \
        else set()
    out |= {"iteration-time"} if timers and not first else set()
    out |= {"throughput"} if timers and throughput else set()
    return out


@pytest.mark.parametrize("timers", [False, True])
@pytest.mark.parametrize("throughput", [False, True])
@pytest.mark.parametrize("loss_scale", [False, True])
@pytest.mark.parametrize("start", [0, 5])
def test_tensorboard_and_wandb_gates_are_megatrons(tmp_path, monkeypatch, timers, throughput, loss_scale, start):
    """Each logged iteration's TensorBoard tags and W&B keys among Megatron's are the ones Megatron's training_log
    writes under the same flags (``_megatron_writes``), a fresh run and one resumed at iteration 5 alike, each
    holding the record's value. Failed before: W&B got iteration-time, throughput and loss-scale whatever the
    flags, and the memory tags; both got iteration-time at the process's first iteration."""
    import random

    rng = random.Random()
    run, calls = _fake_wandb(monkeypatch, tmp_path, log_timers_to_tensorboard=timers, log_throughput=throughput,
                             log_loss_scale_to_tensorboard=loss_scale)
    logger = MetricsLogger(log_dir=str(tmp_path), log_interval=1, train_iters=start + 3, enabled=True,
                           tensorboard=False, progress_bar=False, start_iteration=start, throughput=throughput,
                           tensorboard_timers=timers, tensorboard_loss_scale=loss_scale, wandb=run)
    logger._tb = board = _Board()
    memory = {"mem_allocated_bytes": 3, "mem_reserved_bytes": 4, "mem_max_allocated_bytes": 5}
    for it in range(start + 1, start + 4):
        logger.step(it, {**_values(rng.uniform(1, 10)), "step_time_s": rng.uniform(0.1, 1.0),
                         "tflops_per_device": rng.uniform(1, 100), "loss_scale": 2.0 ** rng.randint(1, 20),
                         "consumed_samples": 4 * it, "num_zeros_in_grad": rng.randint(0, 9),
                         "log": {"params_norm": rng.uniform(1, 9), "world_size": 1, **memory}})
    logger.close()
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    keys = {"lm loss": "lm_loss", "learning-rate": "lr", "grad-norm": "grad_norm", "loss-scale": "loss_scale",
            "iteration-time": "step_time_s", "throughput": "tflops_per_device", "batch-size": "global_batch_size",
            "params-norm": "params_norm", "num-zeros": "num_zeros_in_grad", "world-size": "world_size",
            "samples vs steps": "consumed_samples", "mem-allocated-bytes": "mem_allocated_bytes",
            "mem-reserved-bytes": "mem_reserved_bytes", "mem-max-allocated-bytes": "mem_max_allocated_bytes"}
    assert [step for step, _ in calls] == [r["iteration"] for r in recs] == list(range(start + 1, start + 4))
    for (_, wandb_values), rec in zip(calls, recs):
        it = rec["iteration"]
        tb_values = {tag: v for tag, rows in board.tags.items() for step, v in rows if step == it}
        for values, to_wandb in ((tb_values, False), (wandb_values, True)):
            want = _megatron_writes(timers, throughput, loss_scale, True, it == start + 1, to_wandb)
            assert set(values) & MEGATRON_TAGS == want, (it, to_wandb)
            for tag in want:
                assert values[tag] == rec[keys[tag]], tag
    if loss_scale:
        assert board.tags["loss-scale vs samples"] == [(r["consumed_samples"], r["loss_scale"]) for r in recs]
    assert not any(k.startswith("mem") or k.endswith(" ppl") for _, v in calls for k in v)


def test_the_first_logged_iteration_after_the_first_has_iteration_time(tmp_path):
    """At --log-interval 3 the process's first iteration has no line: iteration 3's TensorBoard gets its
    iteration-time (Megatron's is_first_iteration guard is about iteration 1 alone)."""
    logger = MetricsLogger(log_dir=str(tmp_path), log_interval=3, train_iters=6, enabled=True, tensorboard=False,
                           progress_bar=False, start_iteration=0, tensorboard_timers=True)
    logger._tb = board = _Board()
    for it in range(1, 7):
        logger.step(it, {**_values(2.0), "step_time_s": 0.1 * it})
    logger.close()
    assert board.tags["iteration-time"] == [(3, pytest.approx(0.2, rel=1e-12)), (6, pytest.approx(0.5, rel=1e-12))]


@pytest.mark.parametrize("asked", [False, True])
def test_validation_ppl_reaches_tensorboard_only_when_asked(tmp_path, asked):
    """Megatron's evaluate_and_print_results writes ``lm loss validation ppl`` and its ``vs samples`` twin only with
    --log-validation-ppl-to-tensorboard (default off), the loss tags always; omnitron's test split's ``lm loss test
    ppl`` follows the same flag. metrics.jsonl keeps the ppl either way. Failed before: the ppl tags were written
    whatever the flag (which was accepted as a no-op). The test split keeps its own ``lm loss test`` tags: Megatron
    writes it under ``lm loss validation`` at the iteration of the validation after training (the same step), where
    its value would land on the validation curve (W&B keeps only the last value logged at a step)."""
    import random

    from omnitron.core.training.arguments import parse_settings

    flags = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
             "--micro-batch-size", "2", "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", "64"] + (["--log-validation-ppl-to-tensorboard"] if asked else [])
    assert parse_settings(flags, 1).logging.log_validation_ppl_to_tensorboard is asked
    rng = random.Random()
    logger = MetricsLogger(log_dir=str(tmp_path), log_interval=1, train_iters=4, enabled=True, tensorboard=False,
                           progress_bar=False, start_iteration=0, tensorboard_validation_ppl=asked)
    logger._tb = board = _Board()
    val, test = rng.uniform(1, 9), rng.uniform(1, 9)
    logger.validation(4, {"val_loss": val, "val_ppl": 2.0 ** val}, consumed_samples=16)
    logger.validation(4, {"test_loss": test, "test_ppl": 2.0 ** test}, consumed_samples=16, after_training=True)
    logger.close()
    assert board.tags["lm loss validation"] == [(4, val)] and board.tags["lm loss validation vs samples"] == [(16, val)]
    assert board.tags["lm loss test"] == [(4, test)]
    ppl = {"lm loss validation ppl": [(4, 2.0 ** val)], "lm loss validation ppl vs samples": [(16, 2.0 ** val)],
           "lm loss test ppl": [(4, 2.0 ** test)], "lm loss test ppl vs samples": [(16, 2.0 ** test)]}
    assert {t: v for t, v in board.tags.items() if "ppl" in t} == (ppl if asked else {})
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r.get("val_ppl", r.get("test_ppl")) for r in recs] == [2.0 ** val, 2.0 ** test]
