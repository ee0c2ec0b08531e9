"""Weights & Biases logging, Megatron's ``--wandb-project`` / ``--wandb-exp-name`` / ``--wandb-save-dir``.

Optional: the ``wandb`` package comes with ``pip install 'omnitron[wandb]'``; a run that asks for it without
the package stops before any work (:func:`check_available`). ``WANDB_MODE=offline`` writes the run under the
save directory without a network (``wandb sync`` uploads it later). Only global rank 0 logs, the same numeric
values as ``metrics.jsonl`` at the same iterations, under Megatron's W&B keys where Megatron logs the value
(``lm loss``, ``learning-rate``, ``grad-norm``, ``lm loss validation``, ..., the TensorBoard tags:
:func:`omnitron.core.training.metrics.tensorboard_scalars`) and ``samples vs steps`` (the consumed samples), so
runs of both frameworks share a project's charts; other values keep their metrics.jsonl names.
"""
from __future__ import annotations

import os

from omnitron.core.config.parallel import ConfigError
from omnitron.core.training.metrics import tensorboard_scalars


def check_available(logging_cfg) -> None:
    """ConfigError when --wandb-project is given but cannot work."""
    if not logging_cfg.wandb_project:
        return
    if not logging_cfg.wandb_exp_name:
        raise ConfigError("--wandb-project needs --wandb-exp-name NAME (the run's name, as Megatron asks)")
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError("--wandb-project needs the wandb package: pip install 'omnitron[wandb]' (or drop the "
                          "--wandb-* flags; metrics.jsonl has every value)") from None


class WandbRun:
    """One wandb run for the training run (``None`` project: nothing)."""

    def __init__(self, logging_cfg, *, log_dir: str, config: dict) -> None:
        import wandb

        save_dir = logging_cfg.wandb_save_dir or os.path.join(log_dir, "wandb")
        os.makedirs(save_dir, exist_ok=True)
        self._run = wandb.init(project=logging_cfg.wandb_project, name=logging_cfg.wandb_exp_name, dir=save_dir,
                               config=config)

    def log(self, record: dict) -> None:
        """One record at its iteration, under Megatron's keys (module docstring)."""
        values = {tag: v for tag, v, _ in tensorboard_scalars(record, None, timers=True, throughput=True)}
        if record.get("consumed_samples") is not None:
            values["samples vs steps"] = record["consumed_samples"]
        self._run.log(values, step=record["iteration"])

    def close(self) -> None:
        self._run.finish()
