"""The training loop, top to bottom: build, resume, then step / log / validate / save until done.

``train(settings, backend)`` runs on every rank (the process group already initialised) and
returns the per-iteration losses of this run, which the resume tests compare bit for bit.
"""
from __future__ import annotations

import logging
import math
import time

import torch

from omnitron.backends.collectives import ReduceOp
from omnitron.core.config.parallel import ConfigError
from omnitron.core.data import PretrainingSampler, build_data_loader
from omnitron.core.models.family import family_of
from omnitron.core.models.gpt.flops import megatron_flops
from omnitron.core.optim.clip import global_grad_norm
from omnitron.core.parallel.data.fsdp import local_shard
from omnitron.core.training import checkpointing, signals
from omnitron.core.training.components import build_components, evaluations_by, uses_fsdp2
from omnitron.core.training.housekeeping import Housekeeping
from omnitron.core.training.log_lines import memory_line
from omnitron.core.training.metrics import MetricsLogger, default_log_dir, line_due, log_due
from omnitron.core.training.nonfinite import NonFiniteError, SkipCounter, weights_finite
from omnitron.core.training.step import evaluate, train_step
from omnitron.core.training.straggler import StragglerDetector
from omnitron.core.training.timers import StepProfiler, Timers, format_timers, timer_fields
from omnitron.core.training.watchdog import NullWatchdog
from omnitron.core.transformer.moe import expert_load

log = logging.getLogger("omnitron.train")


def data_iterator(c, dataset, consumed: int):
    """Micro-batches for this data-parallel rank from sample ``consumed`` on (RNG untouched)."""
    if dataset is None:
        return None
    g = c.groups
    sampler = PretrainingSampler(len(dataset), consumed, c.settings.training.micro_batch_size,
                                 g.dp.rank if g.dp.size > 1 else 0, g.dp.size)
    state = torch.get_rng_state()  # NOTE: DataLoader draws a base seed from the default generator
    it = iter(build_data_loader(dataset, sampler, num_workers=c.settings.data.num_workers))
    torch.set_rng_state(state)
    device = c.backend.current_device()
    return ({k: v.to(device, non_blocking=True) for k, v in batch.items()} for batch in it)


class ValidationStream:
    """The run's validation batches, read on from one evaluation to the next (Megatron's one validation
    iterator): each evaluation sees --eval-iters new global batches. ``c.consumed_valid_samples`` counts what
    the evaluations read and is saved in the checkpoint (Megatron's consumed_valid_samples), so a resumed run
    starts after those batches whatever --eval-interval / --eval-iters it runs with; a checkpoint without the
    count starts after the batches the evaluations before its iteration read under this run's flags (Megatron's
    fallback). --skip-train: at the start."""

    def __init__(self, c):
        t = c.settings.training
        self.c, self.iterator = c, None
        if t.skip_train:
            c.consumed_valid_samples = 0
        elif c.consumed_valid_samples is None:
            done = evaluations_by(t, c.iteration) if t.eval_interval else 0
            c.consumed_valid_samples = done * t.eval_iters * t.eval_batch
        self.start = c.consumed_valid_samples

    def __call__(self):
        if self.iterator is None:  # made at the first evaluation: no loader workers before they are needed
            self.iterator = data_iterator(self.c, self.c.valid_data, self.start)
        return self.iterator

    def read(self, batches: int) -> None:
        """An evaluation read ``batches`` global batches of the stream (Megatron adds each one's samples)."""
        self.c.consumed_valid_samples += batches * self.c.settings.training.eval_batch


def _evaluate_split(c, batches, split: str, house, watchdog, logger, stop,
                    after_training: bool = False) -> dict | None:
    """One evaluation (--eval-iters global batches from ``batches()``) of the ``split`` ("validation" or
    "test"), logged (``after_training``: one of the evaluations after the loop); returns its record, or None when
    ``stop()`` (the run is stopping: asked between batches) ended it unfinished."""
    house.before_eval_or_save()
    c.schedule = c.schedule_for(c.settings.eval_microbatches)  # --eval-global-batch-size (full-size under a ramp)
    asked = []  # evaluate asks stop() after each batch but the last: an unfinished one read len(asked) batches

    def counted_stop():
        asked.append(1)
        return stop()
    eval_iters = c.settings.training.eval_iters
    with watchdog.deadline(f"{split} after iteration {c.iteration}"):
        val = evaluate(c, batches(), eval_iters, counted_stop)
    if isinstance(batches, ValidationStream):
        batches.read(eval_iters if val is not None else len(asked))
    if val is None:
        house.after_eval()
        if c.groups.rank == 0:
            log.info("%s after iteration %d stopped unfinished: the run is stopping", split, c.iteration)
        return None
    if split == "test":
        val = {k.replace("val_", "test_", 1): v for k, v in val.items()}
    logger.validation(c.iteration, val, c.consumed_samples, after_training)
    house.after_eval()
    return {"iteration": c.iteration, **val}


def _final_evaluations(c, valid, validation: list, house, watchdog, logger, stop) -> dict | None:
    """After training (not after an early stop), as Megatron: the validation split once more (its next
    batches, appended to ``validation``), then the test split; returns the test record (None without one, or
    when ``stop()`` ended an evaluation)."""
    if not c.settings.training.eval_iters:
        return None
    if c.valid_data is not None:
        record = _evaluate_split(c, valid, "validation", house, watchdog, logger, stop, after_training=True)
        if record is None:
            return None
        validation.append(record)
    if c.test_data is None:
        return None
    return _evaluate_split(c, lambda: data_iterator(c, c.test_data, 0), "test", house, watchdog, logger, stop,
                           after_training=True)


def _throughput(c, step_time: float, batch: int) -> dict:
    """One step's rates. TFLOP/s per device: Megatron's training log's (``num_floating_point_operations`` of the
    step's batch, its vocabulary padded for the run's tp, over the step time and the whole world)."""
    tokens = batch * c.model.seq_length
    out = {"step_time_s": step_time, "tokens_per_sec": tokens / step_time, "tflops_per_device": None, "mfu": None,
           "peak_memory_bytes": c.backend.memory_stats().get("peak_allocated"),
           "tokens_per_sec_per_device": tokens / step_time / c.groups.world_size}
    step_flops = megatron_flops(c.model, batch, c.model.seq_length, tp=c.groups.tp.size)
    flops = step_flops / step_time / c.groups.world_size
    out["tflops_per_device"] = flops / 1e12
    peak = c.backend.capabilities().peak(c.model.params_dtype)
    if peak:
        out["mfu"] = flops / peak
    return out


def _due(iteration: int, interval: int | None) -> bool:
    return bool(interval) and iteration % interval == 0


def model_parameters(cfg) -> int:
    """Total parameters by the model family's own count (``ModelFamily.num_parameters``)."""
    return family_of(cfg).num_parameters(cfg)


def params_norm(c) -> float:
    """Global L2 norm of every model parameter, each element counted once (the gradient norm's rules:
    tp shards everywhere, replicated tensors on tp rank 0, the pipeline's tied-embedding copy not at all).
    Under --bf16 the trained parameters count as the optimizer's fp32 main copies (frozen ones as they are), as
    Megatron's calc_params_l2_norm takes ``param.main_param`` there (fp16 and fp32: the model's parameters).
    Collective over the model-parallel ranks; waits for a pending parameter all-gather first."""
    if hasattr(c.optimizer, "finish_param_gather"):  # --overlap-param-gather: parameters current first
        c.optimizer.finish_param_gather()
    params = [p for m in c.modules for p in m.parameters()]
    main = None
    if c.settings.precision.bf16:
        main = c.optimizer._grad_norm(c.optimizer.saved_masters())  # each counts its own layout's parts once
        owned = {id(p) for p in c.optimizer.params}
        params = [p for p in params if id(p) not in owned]
    # NOTE: --use-torch-fsdp2: each rank holds disjoint row shards, summed over the whole world
    sharded = (c.groups.dp_cp, c.groups.mp) if uses_fsdp2(c.settings) else None
    rest = global_grad_norm(params, [local_shard(p.detach()) for p in params], c.groups, c.backend.collectives,
                            c.backend.kernels, c.optimizer.duplicates, reduce_over=sharded,
                            device=c.backend.current_device(), dtype=c.optimizer._norm_dtype())
    return rest if main is None else math.sqrt(main ** 2 + rest ** 2)


_MEMORY_FIELDS = (("allocated", "mem_allocated_bytes"), ("reserved", "mem_reserved_bytes"),
                  ("peak_allocated", "mem_max_allocated_bytes"), ("peak_reserved", "mem_max_reserved_bytes"))


def memory_fields(c) -> dict:
    """The backend's memory statistics, each the largest over ranks (fields the backend cannot say are left
    out). Collective over the world."""
    stats = c.backend.memory_stats()
    values = [float(stats[k]) if stats.get(k) is not None else -1.0 for k, _ in _MEMORY_FIELDS]
    t = torch.tensor(values, dtype=torch.float64, device=c.backend.current_device())
    if c.groups.world_size > 1:
        c.backend.collectives.all_reduce(t, op=ReduceOp.MAX)
    return {name: int(v) for (_, name), v in zip(_MEMORY_FIELDS, t.tolist()) if v >= 0}


def logged_values(c, timers: Timers, iterations: int, straggler: StragglerDetector | None = None) -> dict:
    """What a logged step adds to its record (``log``) and line (``log_lines``): timers over the last
    ``iterations`` steps, the straggler report (--log-straggler), and the norms and memory the flags ask for.
    Every rank calls it on the same steps."""
    lg = c.settings.logging
    per_rank = timers.reduce(iterations)
    out = {"log": timer_fields(per_rank, lg.timing_log_option), "log_lines": []}
    if per_rank and (lg.timing_log_level >= 1 or "save-checkpoint" in per_rank):  # level 0: only after saves
        out["log_lines"].append(format_timers(per_rank, lg.timing_log_option))
    if straggler is not None:
        fields, line = straggler.report()
        out["log"].update(fields)
        out["log_lines"].append(line)
    if lg.log_params_norm:
        out["log"]["params_norm"] = params_norm(c)
    if lg.log_memory_to_tensorboard:
        out["log"].update(memory_fields(c))
    if lg.log_world_size_to_tensorboard:
        out["log"]["world_size"] = c.groups.world_size
    return out


def _observers(c, log_dir: str) -> tuple[Timers, StepProfiler]:
    """The run's timers and profiler window (--timing-log-*, --profile*)."""
    lg, rank = c.settings.logging, c.groups.rank
    timers = Timers(c.backend, log_level=lg.timing_log_level, log_option=lg.timing_log_option,
                    barrier_with_l1=lg.barrier_with_L1_time, world_size=c.groups.world_size)
    profiler = StepProfiler(enabled=lg.profile and rank in lg.profile_ranks, start=lg.profile_step_start,
                            end=lg.profile_step_end, activities=c.backend.profiler_activities(), log_dir=log_dir,
                            rank=rank)
    return timers, profiler


def _guarded_step(c, train_iter, timers: Timers, logs: bool) -> dict:
    """:func:`train_step`, a non-finite loss or gradient norm reported with its iteration and rank."""
    try:
        return train_step(c, train_iter, timers, count_zeros=c.settings.logging.log_num_zeros_in_grad and logs)
    except NonFiniteError as err:
        raise err.at(c.iteration + 1, c.groups.rank) from None


def _check_before_save(c) -> None:
    """No checkpoint of non-finite weights (--check-for-nan-in-loss-and-grad; collective over the world)."""
    if c.settings.training.check_for_nan_in_loss_and_grad and not weights_finite(
            c.optimizer.masters_finite(), c.backend.collectives, c.backend.current_device()):
        raise NonFiniteError("a weight", "not finite", "found before saving: the checkpoint was not written").at(
            c.iteration, c.groups.rank)


def train(settings, backend, watchdog=None, *, memory_table=None) -> dict:
    """Train to ``--train-iters``; returns ``{"losses": {iteration: lm_loss}, "validation": [...]}``.
    ``watchdog``: the rank's :class:`~omnitron.core.training.watchdog.Watchdog` (deadlines on steps);
    ``memory_table(settings) -> str``: the predicted memory table ``--log-memory-estimate`` logs (the planner's,
    passed in by the command: core does not import ``omnitron.plan``)."""
    watchdog = watchdog or NullWatchdog()
    c = build_components(settings, backend)
    checkpointing.load(c)
    if "fp8_refresh" in c.extra:  # the FP8-gathered weights' scales from the weights the run starts from
        c.extra["fp8_refresh"]()
    checkpointing.prepare_saves(c)
    t, ck, lg = settings.training, settings.checkpoint, settings.logging
    rank0 = c.groups.rank == 0
    if lg.moe_expert_load_out:
        expert_load.start(c.modules, c.model)
    if rank0:
        layout = (c.groups.describe() or "").splitlines()
        log.info("omnitron: %s | %.2fM parameters | %s | %d micro-batches/step | backend %s",
                 layout[0] if layout else "", model_parameters(c.model) / 1e6,
                 settings.precision.params_dtype_name, settings.num_microbatches, backend.label())
        if settings.logging.log_memory_estimate and memory_table is not None:
            try:
                log.info("predicted memory per rank (omnitron plan):\n%s", memory_table(settings))
            except ConfigError as err:  # a diagnostic: say why there is none, train on
                log.info("--log-memory-estimate: no prediction (%s)", err)
    log_dir = lg.log_dir or default_log_dir(ck.save)
    logger = MetricsLogger(log_dir=log_dir, log_interval=lg.log_interval, train_iters=t.train_iters, enabled=rank0,
                           tensorboard=lg.tensorboard, progress_bar=lg.progress_bar, start_iteration=c.iteration,
                           throughput=lg.log_throughput, tensorboard_timers=lg.log_timers_to_tensorboard,
                           wandb=_wandb_run(settings, log_dir) if rank0 else None, tensorboard_dir=lg.tensorboard_dir,
                           tensorboard_loss_scale=lg.log_loss_scale_to_tensorboard,
                           tensorboard_validation_ppl=lg.log_validation_ppl_to_tensorboard)
    timers, profiler = _observers(c, log_dir)
    straggler = None
    if lg.log_straggler:
        straggler = StragglerDetector(world_size=c.groups.world_size, collectives=backend.collectives,
                                      device=backend.current_device(), minmax_count=lg.straggler_minmax_count,
                                      host_clock_only=backend.capabilities().streams, rank=c.groups.rank)
    stop = signals.adopt(ck)  # installed at the rank's start: holds a start-up signal
    # NOTE: from the job's start, not the loop's: a job sized to a scheduler's time limit must save before it
    deadline = settings.started_at + 60.0 * t.exit_duration_in_mins if t.exit_duration_in_mins else None

    def time_up() -> bool:  # --exit-duration-in-mins or a stop signal, agreed over the ranks
        return stop.agreed_or_past(deadline, backend.collectives, backend.current_device())
    train_iter = timers.timed_iterator("batch-generator", data_iterator(c, c.train_data, c.consumed_samples))
    losses, validation, saved_at, logged_at = {}, [], None, c.iteration
    # Megatron's report_memory_flag: a memory line at the process's first iteration and at the next logged one
    memory_reports, first = 2, c.iteration + 1
    valid, stopping = ValidationStream(c), False  # one validation stream over the run, as Megatron
    skips = SkipCounter(settings.precision.max_consecutive_skipped_iterations if c.optimizer.loss_scaler else 0)
    house = Housekeeping(t, backend)
    house.start()
    if t.skip_train and rank0:
        log.info("skipping training (--skip-train): evaluating the model of iteration %d", c.iteration)
    try:
        stopping = _stopped_in_start_up(c, stop)
        while c.iteration < t.train_iters and not t.skip_train and not stopping:
            logs = log_due(c.iteration + 1, lg.log_interval, t.train_iters)
            batch = c.batches.global_batch(c.consumed_samples)
            c.schedule = c.schedule_for(c.batches.num_microbatches(c.consumed_samples))
            with profiler.step(c.iteration + 1):  # NOTE: starting and exporting a trace stays out of the step time
                t0 = time.perf_counter()
                with timers.phase("train-step"), watchdog.deadline(f"iteration {c.iteration + 1}"):
                    values = _guarded_step(c, train_iter, timers, logs)
                backend.synchronize()
                step_time = time.perf_counter() - t0
            c.iteration += 1
            c.consumed_samples += batch
            values.update(_throughput(c, step_time, batch), consumed_samples=c.consumed_samples,
                          global_batch_size=batch)
            losses[c.iteration] = values["lm_loss"]
            if straggler is not None:
                straggler.record(step_time, values.pop("compute_sections", None))
            if logs:
                values.update(logged_values(c, timers, c.iteration - logged_at, straggler))
                logged_at = c.iteration
            logger.step(c.iteration, values)
            if memory_reports and line_due(c.iteration, lg.log_interval, first):  # training_log's, with its line
                memory_reports -= 1
                if c.groups.dp.rank == 0:
                    log.info(memory_line(c.groups.rank, c.iteration, backend.memory_stats()))
            skips.update(values["skipped"], c.iteration, c.groups.rank, values["loss_scale"])
            house.after_step(c.iteration)
            if _due(c.iteration, t.eval_interval) and c.valid_data is not None and (
                    t.start_eval_at_iter is None or c.iteration >= t.start_eval_at_iter):
                record = _evaluate_split(c, valid, "validation", house, watchdog, logger, time_up)
                validation += [record] if record is not None else []  # None: time_up() below says so too
            stopping = time_up() or _due(c.iteration, t.exit_interval)
            persist = ck.save and (_due(c.iteration, ck.save_interval) or stopping or c.iteration == t.train_iters)
            transient = ck.save and not persist and _due(c.iteration, ck.non_persistent_save_interval)  # Megatron's
            if persist or transient:
                _check_before_save(c)
                house.before_eval_or_save()
                if rank0:
                    log.info("saving %scheckpoint at iteration %d under %s ...", "non-persistent " * transient,
                             c.iteration, checkpointing.non_persistent_dir(ck, ck.save) if transient else ck.save)
                began = time.perf_counter()
                with timers.phase("save-checkpoint"):
                    checkpointing.save(c, non_persistent=transient)
                _write_expert_load(c)
                if rank0:
                    log.info("checkpoint save at iteration %d took %.1f s", c.iteration, time.perf_counter() - began)
                saved_at = c.iteration if persist else saved_at
            if stopping:
                if rank0:
                    log.info("stopping after iteration %d%s", c.iteration,
                             f" (checkpoint saved at {saved_at})" if saved_at == c.iteration else "")
                break
        test = _final_evaluations(c, valid, validation, house, watchdog, logger, time_up) if not stopping else None
        checkpointing.finish_saves(c)  # --async-save: the last background write, committed
        if saved_at != c.iteration:  # written with the last save otherwise
            _write_expert_load(c)
        if saved_at is not None and saved_at >= logged_at:  # a save no log line has reported yet
            _report_last_save(c, timers, rank0)
    finally:
        house.close()
        stop.restore()
        profiler.close()
        logger.close()
    result = {"losses": losses, "validation": validation, "test": test, "iteration": c.iteration, "components": c}
    if settings.prompt and settings.sample_tokens > 0:
        from omnitron.core.inference.sample import print_sample

        print_sample(c, settings.prompt, settings.sample_tokens, top_k=settings.sample_top_k,
                     temperature=settings.sample_temperature)
    return result


def _stopped_in_start_up(c, stop) -> bool:
    """Whether a stop signal reached any rank during start-up (joining, building, loading: collective), said in
    one line: the run then stops before its first iteration, with nothing new to save."""
    if not stop.agreed(c.backend.collectives, c.backend.current_device()):
        return False
    if c.groups.rank == 0:
        log.info("stopping before iteration %d: a stop signal arrived during start-up (nothing new to save: %s)",
                 c.iteration + 1, f"the run resumes from the checkpoint of iteration {c.iteration}" if c.iteration
                 else "no iteration had run")
    return True


def _write_expert_load(c) -> None:
    """--moe-expert-load-out: the routing histogram so far (collective; every rank calls it)."""
    path = c.settings.logging.moe_expert_load_out
    if path:
        expert_load.write(path, c.modules, c.model, c.groups, c.groups.config.sequence_parallel)


def _wandb_run(settings, log_dir: str):
    """The run's wandb logger with --wandb-project (global rank 0), else None."""
    if not settings.logging.wandb_project:
        return None
    from omnitron.core.training.wandb_log import WandbRun

    return WandbRun(settings.logging, log_dir=log_dir, config=settings.flat)


def _report_last_save(c, timers: Timers, rank0: bool) -> None:
    """Log the time of a save made after the last log line (collective, like every timer reduction)."""
    save = timers.reduce(1).get("save-checkpoint")
    if rank0 and save is not None:
        log.info("%s", format_timers({"save-checkpoint": save}, c.settings.logging.timing_log_option))
