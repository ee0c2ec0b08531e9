"""What a training checkpoint holds, and putting it back.

Per rank: every model chunk's state dict, optimizer (fp32 masters, moments, loss scaler),
scheduler, the RNG state of every generator (incl. each chunk's tensor-parallel tracker) and
FP8 scaling state when FP8 is on. Metadata: iteration, consumed samples, the full flat config,
model shape and parallel layout (checked on --load).
"""
from __future__ import annotations

import dataclasses
import logging
import os

from omnitron.core.checkpoint import (CheckpointError, check_compatible, find_latest, get_rng_state,
                                      load_checkpoint, read_metadata, save_checkpoint, set_rng_state)
from omnitron.core.checkpoint.io import MODEL_SHAPE_KEYS

log = logging.getLogger("omnitron.train")


def _jsonable(v):
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return str(v)


def model_dict(model_cfg) -> dict:
    return {k: _jsonable(v) for k, v in dataclasses.asdict(model_cfg).items()}


def layout_dict(settings) -> dict:
    p = settings.parallel
    return {"tensor_model_parallel_size": p.tensor_model_parallel_size,
            "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
            "virtual_pipeline_model_parallel_size": p.virtual_pipeline_model_parallel_size,
            "context_parallel_size": p.context_parallel_size, "data_parallel_size": settings.dp}


def check_resume(settings) -> None:
    """Before any process group: the checkpoint under --load (if any) fits this run's model and layout."""
    path = find_latest(settings.checkpoint.load)
    if path is None:
        if settings.checkpoint.finetune:
            raise CheckpointError(f"--finetune: no checkpoint under --load {settings.checkpoint.load}")
        return
    meta = read_metadata(path)
    model = model_dict(settings.model)
    model["vocab_size"] = meta["model"].get("vocab_size")  # comes from the tokenizer; checked again in the worker
    check_compatible(meta, model, layout_dict(settings), path)


def save(c) -> str:
    """Collective: write this rank's shard; rank 0 commits the directory."""
    s = c.settings
    shard = {"model": [m.state_dict() for m in c.modules], "optimizer": c.optimizer.state_dict(),
             "scheduler": c.scheduler.state_dict(),
             "rng": get_rng_state(c.backend), "trackers": [m.rng_tracker.get_states() for m in c.modules]}
    fp8 = c.extra.get("fp8_state")
    if fp8 is not None:
        shard["fp8"] = fp8()
    meta = {"consumed_samples": c.consumed_samples, "config": _jsonable(s.flat), "model": model_dict(c.model),
            "layout": layout_dict(s)}
    coll = c.backend.collectives

    def barrier():
        if coll.is_initialized():
            coll.barrier()

    path = save_checkpoint(s.checkpoint.save, c.iteration, shard, meta, rank=c.groups.rank,
                           world_size=c.groups.world_size, barrier=barrier, keep_last_n=s.checkpoint.keep_last_n)
    if c.groups.rank == 0:
        log.info("saved checkpoint %s", path)
    return path


def load(c) -> bool:
    """Restore from --load when it holds a checkpoint; returns True when something was loaded."""
    ck = c.settings.checkpoint
    if not ck.load:
        return False
    path = find_latest(ck.load)
    if path is None:
        if c.groups.rank == 0:
            log.info("--load %s holds no checkpoint yet: starting from scratch", ck.load)
        return False
    meta, shard = load_checkpoint(path, c.groups.rank)
    check_compatible(meta, model_dict(c.model), layout_dict(c.settings), path)
    for m, sd in zip(c.modules, shard["model"]):
        m.load_state_dict(sd)
    if ck.finetune:
        c.optimizer.reload_masters()
        if c.groups.rank == 0:
            log.info("--finetune: loaded weights from %s; iteration 0, fresh optimizer", path)
        return True
    if ck.no_load_optim:
        c.optimizer.reload_masters()
    else:
        c.optimizer.load_state_dict(shard["optimizer"])
        c.scheduler.load_state_dict(shard["scheduler"])
    if not ck.no_load_rng:
        set_rng_state(shard["rng"], c.backend)
        for m, st in zip(c.modules, shard["trackers"]):
            m.rng_tracker.set_states(st)
    if "fp8" in shard and c.extra.get("fp8_load") is not None:
        c.extra["fp8_load"](shard["fp8"])
    c.iteration = int(meta["iteration"])
    c.consumed_samples = int(meta["consumed_samples"])
    if c.groups.rank == 0:
        log.info("resumed from %s (iteration %d, %d samples consumed)", path, c.iteration, c.consumed_samples)
    return True


def save_dir_exists(settings) -> bool:
    return bool(settings.checkpoint.save) and os.path.isdir(settings.checkpoint.save)


__all__ = ["check_resume", "load", "save", "MODEL_SHAPE_KEYS"]
