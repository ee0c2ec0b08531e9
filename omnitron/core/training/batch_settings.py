"""The training config's batch sizes and run length: the global batch size's default, a ramp or step schedule of
batch sizes, a ``--train-samples`` run's iterations, and the checks that every micro-batch count has a pipeline
schedule and that the learning-rate schedule counts the run's unit."""
from __future__ import annotations

from typing import Any

from omnitron.core.config.parallel import ConfigError, ParallelConfig
from omnitron.core.config.training import TrainingConfig
from omnitron.core.training.flag_table import _build


def _training_settings(merged: dict[str, Any], dp: int, seq_length: int) -> TrainingConfig:
    """The training config; ``--global-batch-size`` defaults to one micro-batch per data-parallel rank, or with
    ``--step-batch-size-schedule`` to the schedule's last batch size."""
    from dataclasses import replace

    training = _build(TrainingConfig, merged)
    mbs = training.micro_batch_size
    if training.step_batch_size_schedule is not None:
        training = replace(training, global_batch_size=_schedule_final_batch(training, seq_length))
    if training.global_batch_size is None:
        training = replace(training, global_batch_size=mbs * dp)
    if training.global_batch_size % (mbs * dp):
        raise ConfigError(f"--global-batch-size {training.global_batch_size} is not a multiple of --micro-batch-size "
                          f"{mbs} x data-parallel size {dp} = {mbs * dp}; change one of them")
    if training.eval_batch % (mbs * dp):
        raise ConfigError(f"--eval-global-batch-size {training.eval_batch} is not a multiple of --micro-batch-size "
                          f"{mbs} x data-parallel size {dp} = {mbs * dp}; change it")
    _check_schedule_units(merged, training)
    if training.train_samples is None:
        return training
    iters = batch_ramp(training, dp, seq_length).iterations(training.train_samples)
    if iters < 1:
        raise ConfigError(f"--train-samples {training.train_samples} is less than one global batch "
                          f"({training.global_batch_size}); give more samples")
    return replace(training, train_iters=iters)


def batch_ramp(training: TrainingConfig, dp: int, seq_length: int):
    """The run's :class:`~omnitron.core.training.batches.BatchRamp` (batch size per step)."""
    from omnitron.core.training.batches import BatchRamp, parse_step_schedule

    ramp = tuple(training.rampup_batch_size) if training.rampup_batch_size else None
    text = training.step_batch_size_schedule
    steps = parse_step_schedule(text, seq_length) if text else None
    return BatchRamp(training.global_batch_size, training.micro_batch_size * dp, ramp, steps)


def _schedule_final_batch(training: TrainingConfig, seq_length: int) -> int:
    """The schedule's last batch size (the run's --global-batch-size); a different --global-batch-size is refused.
    NOTE: Megatron at d98e8a6 refuses any --global-batch-size beside the schedule, though its GPT-3 175B script
    passes the schedule's last size; that one agrees with the schedule, so it is accepted here."""
    from omnitron.core.training.batches import parse_step_schedule

    steps = parse_step_schedule(training.step_batch_size_schedule, seq_length)
    final = steps[-1][1]
    if training.global_batch_size not in (None, final):
        raise ConfigError(f"--global-batch-size {training.global_batch_size} with --step-batch-size-schedule: the "
                          f"schedule ends at {final}; drop --global-batch-size (the schedule sets every step's)")
    return final


def _check_schedules(training: TrainingConfig, parallel: ParallelConfig, dp: int, seq_length: int) -> None:
    """Every micro-batch count the run takes (one, or each of a ramp's, and an evaluation's) has a pipeline
    schedule: a schedule's own limits (interleaving needs multiples of pp, DualPipeV 2 pp micro-batches) stop the
    command line, not the ranks after they started (an evaluation's count, from --eval-global-batch-size, would
    stop them at the first evaluation, before that iteration's checkpoint)."""
    from omnitron.core.parallel.pipeline.schedules import cached_schedule

    ramp = "--rampup-batch-size" if training.rampup_batch_size else \
        "--step-batch-size-schedule" if training.step_batch_size_schedule else None
    counts = [(n, f"{ramp}: a step of {n} micro-batches: " if ramp else "")
              for n in batch_ramp(training, dp, seq_length).sizes()]
    if training.eval_iters:  # evaluations run the same schedule's forwards
        n = training.eval_batch // (training.micro_batch_size * dp)
        counts.append((n, f"--eval-global-batch-size {training.eval_batch}: an evaluation of {n} micro-batches "
                          f"(change --eval-global-batch-size, or --eval-iters 0 for none): "))
    for n, where in counts:
        try:
            cached_schedule(training.pipeline_schedule, parallel.pipeline_model_parallel_size,
                            parallel.virtual_pipeline_model_parallel_size, n,
                            parallel.microbatch_group_size_per_vp_stage)
        except ConfigError as err:
            raise ConfigError(f"{where}{err}") from None


_ITER_LR = ("lr_decay_iters", "lr_warmup_iters", "lr_wsd_decay_iters")
_SAMPLE_LR = ("lr_decay_samples", "lr_warmup_samples", "lr_wsd_decay_samples")


def _check_schedule_units(merged: dict[str, Any], training: TrainingConfig) -> None:
    """Megatron's rule: a run counts iterations or samples, and its learning-rate schedule the same unit."""
    samples = training.train_samples is not None
    if samples and "train_iters" in merged:
        raise ConfigError("give --train-iters or --train-samples, not both")
    wrong, unit, other = (_ITER_LR, "samples", "iters") if samples else (_SAMPLE_LR, "iters", "samples")
    for key in wrong:
        if merged.get(key):
            flag, fix = (k.replace("_", "-") for k in (key, key.replace(other, unit)))
            run = "--train-samples" if samples else "--train-iters (no --train-samples)"
            counts = "samples" if samples else "iterations"
            raise ConfigError(f"--{flag} does not apply to a run of {run}: the schedule counts {counts}; use --{fix}")
