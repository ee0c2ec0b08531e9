"""The training loop, top to bottom: build, resume, then step / log / validate / save until done.

``train(settings, backend)`` runs on every rank (the process group already initialised) and
returns the per-iteration losses of this run, which the resume tests compare bit for bit.
"""
from __future__ import annotations

import importlib
import logging
import time

import torch

from omnitron.core.models.gpt.config import flops_per_iteration, num_parameters
from omnitron.core.training import checkpointing
from omnitron.core.training.components import build_components
from omnitron.core.training.metrics import MetricsLogger, default_log_dir
from omnitron.core.training.signals import StopFlag
from omnitron.core.training.step import evaluate, train_step

log = logging.getLogger("omnitron.train")


def data_iterator(c, dataset, consumed: int):
    """Micro-batches for this data-parallel rank from sample ``consumed`` on (RNG untouched)."""
    from omnitron.core.data import PretrainingSampler, build_data_loader

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


def _throughput(c, step_time: float) -> dict:
    t = c.settings.training
    tokens = t.global_batch_size * c.model.seq_length
    out = {"step_time_s": step_time, "tokens_per_sec": tokens / step_time, "tflops_per_device": None, "mfu": None,
           "peak_memory_bytes": c.backend.memory_stats().get("peak_allocated")}
    flops = flops_per_iteration(c.model, t.global_batch_size) / step_time / c.groups.world_size
    out["tflops_per_device"] = flops / 1e12
    peak = c.backend.capabilities().peak(c.model.params_dtype)
    if peak:
        out["mfu"] = flops / peak
    return out


def _due(iteration: int, interval: int | None) -> bool:
    return bool(interval) and iteration % interval == 0


def model_parameters(cfg) -> int:
    """Total parameters by the model family's own count: each family's config module (gpt, bert, t5,
    multimodal) defines ``num_parameters``; GPT's formula is the fall-back."""
    family = importlib.import_module(type(cfg).__module__)
    return getattr(family, "num_parameters", num_parameters)(cfg)


def train(settings, backend) -> dict:
    """Train to ``--train-iters``; returns ``{"losses": {iteration: lm_loss}, "validation": [...]}``."""
    c = build_components(settings, backend)
    checkpointing.load(c)
    t, ck = settings.training, settings.checkpoint
    rank0 = c.groups.rank == 0
    if rank0:
        layout = (c.groups.describe() or "").splitlines()
        log.info("omnitron: %s | %.2fM parameters | %s | %d micro-batches/step | backend %s",
                 layout[0] if layout else "", model_parameters(c.model) / 1e6,
                 settings.precision.params_dtype_name, settings.num_microbatches, backend.name)
    logger = MetricsLogger(log_dir=settings.logging.log_dir or default_log_dir(ck.save),
                           log_interval=settings.logging.log_interval, train_iters=t.train_iters, enabled=rank0,
                           tensorboard=settings.logging.tensorboard, progress_bar=settings.logging.progress_bar,
                           start_iteration=c.iteration)
    stop = StopFlag(enabled=ck.save_on_signal)
    train_iter = data_iterator(c, c.train_data, c.consumed_samples)
    losses, validation, saved_at = {}, [], None
    try:
        while c.iteration < t.train_iters:
            t0 = time.perf_counter()
            values = train_step(c, train_iter)
            backend.synchronize()
            c.iteration += 1
            c.consumed_samples += t.global_batch_size
            values.update(_throughput(c, time.perf_counter() - t0))
            losses[c.iteration] = values["lm_loss"]
            logger.step(c.iteration, values)
            if _due(c.iteration, t.eval_interval) and c.valid_data is not None:
                val = evaluate(c, data_iterator(c, c.valid_data, 0), t.eval_iters)
                validation.append({"iteration": c.iteration, **val})
                logger.validation(c.iteration, val)
            stopping = stop.agreed(backend.collectives, backend.current_device()) or _due(c.iteration, t.exit_interval)
            if ck.save and (_due(c.iteration, ck.save_interval) or stopping or c.iteration == t.train_iters):
                checkpointing.save(c)
                saved_at = c.iteration
            if stopping:
                if rank0:
                    log.info("stopping after iteration %d%s", c.iteration,
                             f" (checkpoint saved at {saved_at})" if saved_at == c.iteration else "")
                break
    finally:
        stop.restore()
        logger.close()
    result = {"losses": losses, "validation": validation, "iteration": c.iteration, "components": c}
    if settings.prompt:
        from omnitron.core.inference.sample import print_sample

        print_sample(c, settings.prompt, settings.sample_tokens, top_k=settings.sample_top_k)
    return result
