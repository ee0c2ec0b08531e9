"""Weights & Biases logging, Megatron's ``--wandb-project`` / ``--wandb-exp-name`` / ``--wandb-save-dir``.

Optional: the ``wandb`` package comes with ``pip install 'omnitron[wandb]'``; a run that asks for it without
the package stops before any work (:func:`check_available`). ``WANDB_MODE=offline`` writes the run under the
save directory without a network (``wandb sync`` uploads it later). Only global rank 0 logs, at the iterations
metrics.jsonl gets its records, what Megatron's training_log and evaluate_and_print_results give W&B: under
Megatron's keys (``lm loss``, ``learning-rate``, ``grad-norm``, ``lm loss validation``, ..., the TensorBoard tags:
:func:`omnitron.core.training.metrics.tensorboard_scalars`) and ``samples vs steps`` (the consumed samples), so
runs of both frameworks share a project's charts, gated by the flags that gate TensorBoard's (``iteration-time``
and the timers with --log-timers-to-tensorboard, none at a process's first iteration; ``throughput`` with that and
--log-throughput; ``loss-scale`` unless --no-log-loss-scale-to-tensorboard); never the memory statistics nor the
perplexities, which Megatron writes to TensorBoard alone. Values Megatron has no key for (tokens/s, MFU, the
skipped counts, ...) keep their metrics.jsonl names. (Megatron gives W&B its training values only when it also
writes TensorBoard, --tensorboard-dir; omnitron does not ask for that.)
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

        self._cfg = logging_cfg
        save_dir = logging_cfg.wandb_save_dir or os.path.join(log_dir, "wandb")
        os.makedirs(save_dir, exist_ok=True)
        self._run = wandb.init(project=logging_cfg.wandb_project, name=logging_cfg.wandb_exp_name, dir=save_dir,
                               config=config)

    def log(self, record: dict) -> None:
        """One record at its iteration, under Megatron's keys and gates (module docstring)."""
        cfg = self._cfg
        values = {tag: v for tag, v, _ in tensorboard_scalars(
            record, None, timers=cfg.log_timers_to_tensorboard, throughput=cfg.log_throughput,
            loss_scale=cfg.log_loss_scale_to_tensorboard, memory=False)}  # validation_ppl off: TensorBoard's alone
        if record.get("consumed_samples") is not None:
            values["samples vs steps"] = record["consumed_samples"]
        self._run.log(values, step=record["iteration"])

    def close(self) -> None:
        self._run.finish()
