"""The event files a user opens: TensorBoard's after a crash-style resume hold each iteration once (the resumed
run's values), read back with TensorBoard's own reader; wandb in offline mode (no network) logs what
metrics.jsonl has, and asking for wandb without the package or without a run name stops with the fix."""
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
        assert values == {k: v for k, v in rec.items() if k != "iteration" and isinstance(v, (int, float))}
    runs = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1 and os.path.getsize(runs[0]) > 0


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
            "--log-params-norm", "--data-cache-path", str(tmp_path / "cache")]
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
