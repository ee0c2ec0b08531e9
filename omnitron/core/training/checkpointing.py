"""What a training checkpoint holds, and putting it back.

Per rank: every model chunk's state dict, optimizer (fp32 masters, moments, loss scaler),
scheduler, the RNG state of every generator (incl. each chunk's tensor-parallel tracker) and
FP8 scaling state when FP8 is on. Metadata: iteration, consumed samples, the full flat config,
model shape and parallel layout (checked on --load: a different model shape, or a model setting that no
shape shows, is refused; a different layout is resharded).
"""
from __future__ import annotations

import dataclasses
import logging
import os

import torch

from omnitron.core.checkpoint import (CheckpointError, check_compatible, dist, find_latest, get_rng_state,
                                      read_metadata, reshard, save_checkpoint, set_rng_state)
from omnitron.core.checkpoint.io import MODEL_SHAPE_KEYS, read_shard
from omnitron.core.checkpoint.name_mismatch import mismatch_error
from omnitron.core.parallel.pipeline.schedules import schedule_style
from omnitron.core.parallel.tensor.mappings import local_rank
from omnitron.core.precision.loss_scaler import loaded_scale_note
from omnitron.core.training.arguments import resolved_config
from omnitron.core.training.model_check import check_model_settings
from omnitron.core.training.outputs import lock_identity, locked_dirs, recheck_lock
from omnitron.core.training.resume_choice import NON_PERSISTENT_SUBDIR, non_persistent_dir, resume_path  # noqa: F401

DIST_FORMAT = "torch_dist"  # omnitron.core.checkpoint.dist.FORMAT, without importing it


def _dist():
    """``omnitron.core.checkpoint.dist``, imported on first use: it brings torch.distributed.checkpoint and
    DTensor (about 0.8 s per process), which runs that never touch a torch_dist checkpoint do without."""
    return dist


def _async_saver(c):
    from omnitron.core.checkpoint.dist_async import AsyncSaver

    return c.extra.setdefault("async_saver", AsyncSaver(c.backend.collectives))


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
            "context_parallel_size": p.context_parallel_size, "data_parallel_size": settings.dp,
            "decoder_first_pipeline_num_layers": p.decoder_first_pipeline_num_layers,
            "decoder_last_pipeline_num_layers": p.decoder_last_pipeline_num_layers,
            "account_for_embedding_in_pipeline_split": p.account_for_embedding_in_pipeline_split,
            "account_for_loss_in_pipeline_split": p.account_for_loss_in_pipeline_split,
            "expert_model_parallel_size": p.expert_model_parallel_size,
            # experts' tensor-parallel split (meaningful for MoE models only; dense models record 1)
            "expert_tensor_parallel_size": p.etp if getattr(settings.model, "num_experts", None) else 1,
            # which chunk holds which stage: `v` under --pipeline-schedule zb-v / dualpipe-v
            "pipeline_chunk_placement": schedule_style(settings.training.pipeline_schedule)}


def check_resume(settings) -> None:
    """Before any process group: the checkpoint under --load (if any) fits this run's model (a
    different parallel layout is resharded on load)."""
    path = resume_path(settings.checkpoint, quiet=True)  # rank 0 says which
    if path is None:
        for flag, on in (("--finetune", settings.checkpoint.finetune),
                         ("--exit-on-missing-checkpoint", settings.checkpoint.exit_on_missing_checkpoint)):
            if on:
                raise CheckpointError(f"{flag}: no checkpoint under --load {settings.checkpoint.load}")
        return
    meta = read_metadata(path)
    missing = [n for n in meta["shards"] if not os.path.isfile(os.path.join(path, n))]
    if missing:
        raise CheckpointError(f"--load {path}: shard {missing[0]} is missing ({len(missing)} of {len(meta['shards'])}"
                              f"); the checkpoint is incomplete: copy every rank_*.pt, or load an earlier iteration")
    if meta.get("ckpt_format") == DIST_FORMAT:  # DCP's index: present, its checksum, DCP's classes only
        from omnitron.core.checkpoint.dist_planner import VerifiedReader

        VerifiedReader(path, meta.get("checksums") or {}).read_metadata()
    model = model_dict(settings.model)
    model["vocab_size"] = meta["model"].get("vocab_size")  # comes from the tokenizer; checked again in the worker
    check_compatible(meta, model, layout_dict(settings), path, reshard=True)
    ck = settings.checkpoint
    weights_only = isinstance(meta.get("optimizer"), dict) and meta["optimizer"].get("weights_only")
    for line in check_model_settings(meta["model"], model, path, finetune=bool(ck.finetune or weights_only)):
        log.info(line)
    keep = ck.override_opt_param_scheduler or ck.use_checkpoint_opt_param_scheduler
    if isinstance(meta.get("scheduler"), dict) and meta["scheduler"] and not (weights_only or ck.finetune or
                                                                               ck.no_load_optim or keep):
        from omnitron.core.training.components import make_scheduler

        make_scheduler(settings).load_state_dict(meta["scheduler"])  # a changed schedule: one line, before launch


def _optimizer_shard(c) -> dict:
    """The optimizer state this rank writes. Every replica holds the same per-parameter state (the
    distributed optimizer gathers its slices), so each entry is written once, as Megatron does: dense
    parameters' by data x context parallel rank 0, MoE experts' by expert-data-parallel rank 0. The other
    ranks keep step, counters and loss scaler, and name under ``tensors_from`` the world rank whose shard
    holds each of their entries (:func:`_complete_optimizer_state` reads them back)."""
    state, opt, g = c.optimizer.state_dict(), c.optimizer, c.groups
    kept, elsewhere = {}, {}
    for name, p in zip(opt.names, opt.params):
        writer = (g.edp if getattr(p, "expert", False) else g.dp_cp).ranks[0]
        if writer == g.rank:
            kept[name] = state["tensors"][name]
        else:
            elsewhere.setdefault(writer, []).append(name)
    state["tensors"] = kept
    if elsewhere:
        state["tensors_from"] = elsewhere
    return state


def _complete_optimizer_state(path: str, shard: dict) -> None:
    """Add the optimizer entries this rank's shard left to another rank's (see :func:`_optimizer_shard`)."""
    opt = shard["optimizer"]
    for rank, names in opt.pop("tensors_from", {}).items():
        other = read_shard(path, rank)["optimizer"]["tensors"]
        opt["tensors"].update({n: other[n] for n in names})


def _masters_from_weights(shard: dict) -> None:
    """A torch-format shard saved with fp32 (or float64) weights keeps no masters (the weights were the masters):
    give each entry without one the shard's weight, so that a run whose weights are bf16 / fp16 resumes its fp32
    masters from them, a float64 weight rounded to nearest (not from its own initialisation, which the first step
    would copy back into the model)."""
    for name, entry in shard["optimizer"]["tensors"].items():
        chunk, _, param = name.partition(".")  # the optimizer names chunk<c>.<name>
        weight = shard["model"][int(chunk.removeprefix("chunk"))].get(param)
        if "master" not in entry and weight is not None and weight.dtype in (torch.float32, torch.float64):
            entry["master"] = weight


def _weights_from_masters(shard: dict, modules) -> None:
    """Where this run's weight dtype is not the shard's (a resume between --bf16 and --fp16), the weight is taken
    from the shard's fp32 master, rounded once into the run's dtype, rather than from the shard's bf16 / fp16
    weight (the master rounded already: rounding it again gives fp16 weights bf16's precision, and bf16 weights
    another value than the master rounded wherever fp16's rounding lands on a bf16 midpoint)."""
    live = [m.state_dict() for m in modules]
    for name, entry in shard["optimizer"]["tensors"].items():
        chunk, _, param = name.partition(".")  # the optimizer names chunk<c>.<name>
        c = int(chunk.removeprefix("chunk"))
        weight, mine = shard["model"][c].get(param), live[c].get(param)
        if "master" in entry and weight is not None and mine is not None and weight.dtype != mine.dtype:
            shard["model"][c][param] = entry["master"]


def save(c, *, non_persistent: bool = False) -> str:
    """Collective: write this rank's shard; rank 0 commits the directory. ``non_persistent``: into the
    non-persistent directory (:func:`non_persistent_dir`), which keeps only this newest checkpoint."""
    s, ck = c.settings, c.settings.checkpoint
    where = (non_persistent_dir(ck, ck.save), 1, None) if non_persistent else \
        (ck.save, ck.keep_last_n, ck.save_retain_interval)  # directory, --keep-last-n, --save-retain-interval
    for directory in dict.fromkeys((ck.save, where[0])):  # --save's lock always, the one written into too
        _check_lock(c, directory)
    for chunk in c.chunks:  # --overlap-param-gather: the weights must be gathered before they are read
        if hasattr(chunk, "finish_param_sync"):
            chunk.finish_param_sync()
    if s.checkpoint.ckpt_format == DIST_FORMAT:
        return _save_dist(c, *where)
    shard = {"model": [m.state_dict() for m in c.modules], "optimizer": _optimizer_shard(c),
             "scheduler": c.scheduler.state_dict(),
             "rng": get_rng_state(c.backend), "trackers": [m.rng_tracker.get_states() for m in c.modules]}
    fp8 = c.extra.get("fp8_state")
    if fp8 is not None:
        shard["fp8"] = fp8()
    meta = {"consumed_samples": c.consumed_samples, "consumed_valid_samples": c.consumed_valid_samples,
            "config": _jsonable(resolved_config(s)), "model": model_dict(c.model), "layout": layout_dict(s)}
    coll = c.backend.collectives

    def barrier():
        if coll.is_initialized():
            coll.barrier()

    path = save_checkpoint(where[0], c.iteration, shard, meta, rank=c.groups.rank, world_size=c.groups.world_size,
                           barrier=barrier, keep_last_n=where[1], retain_interval=where[2])
    if c.groups.rank == 0:
        log.info("saved checkpoint %s", path)
    return path


def _check_lock(c, directory: str) -> None:
    """Rank 0, before a save into ``directory``: its lock (--save's, or a --non-persistent-global-ckpt-dir's
    elsewhere) is still the job's (:func:`~omnitron.core.training.outputs.recheck_lock`: a lock, or a whole
    directory, deleted during the run is said and taken again; another job's there stops the run)."""
    flag, held = c.extra.get("save_locks", {}).get(directory, (None, None))
    if held is not None and c.groups.rank == 0:
        c.extra["save_locks"][directory] = flag, recheck_lock(flag, directory, held)


def _barrier(c):
    coll = c.backend.collectives
    return (lambda: coll.barrier()) if coll.is_initialized() else (lambda: None)


def _save_dist(c, directory: str, keep_last_n: int | None, retain_interval: int | None) -> str:
    """``--ckpt-format torch_dist`` (:mod:`omnitron.core.checkpoint.dist`) into ``directory``."""
    s = c.settings
    meta = {"consumed_samples": c.consumed_samples, "consumed_valid_samples": c.consumed_valid_samples,
            "config": _jsonable(resolved_config(s)), "model": model_dict(c.model), "layout": layout_dict(s),
            "optimizer": _dist().optimizer_meta(c), "scheduler": c.scheduler.state_dict()}
    save = _dist().save
    if s.checkpoint.async_save:
        save = _async_saver(c).save
    path = save(c, directory, c.iteration, meta, _dist().rank_state(c, get_rng_state), barrier=_barrier(c),
                keep_last_n=keep_last_n, retain_interval=retain_interval)
    if c.groups.rank == 0:
        log.info("%s checkpoint %s (torch_dist)", "saving in the background:" if s.checkpoint.async_save else
                 "saved", path)
    return path


def prepare_saves(c) -> None:
    """Collective, before the first step: rank 0 notes the locks of the directories saves write (:func:`_check_lock`);
    ``--async-save`` makes its writer's process group and its host staging buffers now, so that the first save
    blocks the step for its copy into them only."""
    ck = c.settings.checkpoint
    if ck.save and c.groups.rank == 0:  # the locks the job took (--save, a non-persistent dir elsewhere): rechecked
        c.extra["save_locks"] = {d: (flag, lock_identity(d)) for flag, d in locked_dirs(c.settings)
                                 if d in (ck.save, non_persistent_dir(ck, ck.save))}
    if ck.async_save and ck.save and ck.ckpt_format == "torch_dist":
        _async_saver(c).prepare(c)


def finish_saves(c) -> None:
    """Collective: wait for a ``--async-save`` write in flight and commit it (the end of training)."""
    saver = c.extra.get("async_saver")
    if saver is not None:
        saver.wait(c, _barrier(c))


FP8_RESTART = ("--load %s: FP8 amax histories and scales belong to the layout they were reduced in and do not "
               "carry to another layout: FP8 scaling restarts from its first steps")


def _holds_tensors(state) -> bool:
    """True when ``state`` (nested dicts / lists) holds a tensor: delayed scaling's histories do, the
    stateless recipes' empty per-module dicts do not (nothing restarts, so nothing is said)."""
    if isinstance(state, dict):
        return any(_holds_tensors(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return any(_holds_tensors(v) for v in state)
    return hasattr(state, "shape")


def _load_dist(c, path: str, meta: dict, changes: list) -> dict:
    """Read a ``torch_dist`` checkpoint into the live tensors; returns the rest in :func:`load`'s shard
    form (optimizer counters, scheduler; RNG and FP8 under the same layout only)."""
    ck = c.settings.checkpoint
    if changes and c.groups.rank == 0:
        log.info("--load %s: reading the torch_dist checkpoint under another layout (%s)", path, ", ".join(changes))
    _dist().load(c, path, meta, with_optimizer=not (ck.finetune or ck.no_load_optim))
    shard = {"model": None, "optimizer": dict(meta["optimizer"], loaded=True), "scheduler": meta["scheduler"]}
    if not changes:
        shard.update(read_shard(path, c.groups.rank, meta))
        return shard
    if c.groups.rank == 0 and _holds_tensors(read_shard(path, 0, meta).get("fp8")):
        log.info(FP8_RESTART, path)
    if meta["model"].get("moe_router_enable_expert_bias"):  # buffers in the rank files: each stage's own, by name
        from omnitron.core.checkpoint.reshard import expert_biases

        shard["expert_bias"] = [expert_biases(path, meta)]
    return shard


def load(c) -> bool:
    """Restore from --load when it holds a checkpoint; returns True when something was loaded.

    Under the checkpoint's own layout every rank reads its shard (bit-exact resume). Under another
    layout every rank assembles its shard from the checkpoint's full tensors
    (:mod:`omnitron.core.checkpoint.reshard`): weights, optimizer state, step, loss scaler and
    scheduler carry over, RNG streams and FP8 amax histories restart (logged). A weights-only
    checkpoint (``omnitron checkpoint import-hf``) loads as under ``--finetune``."""
    ck = c.settings.checkpoint
    if not ck.load:
        return False
    path = resume_path(ck, quiet=c.groups.rank != 0)
    if path is None:
        if c.groups.rank == 0:
            log.info("--load %s holds no checkpoint yet: starting from scratch", ck.load)
        return False
    meta = read_metadata(path)
    changes = check_compatible(meta, model_dict(c.model), layout_dict(c.settings), path, reshard=True)
    finetune = ck.finetune or (meta.get("optimizer") or {}).get("weights_only")
    for line in check_model_settings(meta["model"], model_dict(c.model), path, finetune=bool(finetune)):
        if c.groups.rank == 0:
            log.info(line)
    if meta.get("ckpt_format") == DIST_FORMAT:
        shard = _load_dist(c, path, meta, changes)
    else:
        shard = _load_torch(c, path, meta, changes)
    if ck.finetune or shard["optimizer"].get("weights_only"):
        c.optimizer.reload_masters()
        if c.groups.rank == 0:
            why = "--finetune" if ck.finetune else "the checkpoint holds weights only (imported), so as --finetune"
            log.info("%s: loaded weights from %s; iteration 0, fresh optimizer", why, path)
        return True
    if ck.no_load_optim:
        c.optimizer.reload_masters()
    else:
        note = loaded_scale_note(c.optimizer.loss_scaler, shard["optimizer"].get("loss_scaler"))
        if note and c.groups.rank == 0:
            log.info("--load %s: %s", path, note)
        if shard["optimizer"].get("loaded"):  # torch_dist: the tensors are in place, the counters remain
            c.optimizer.load_counters(shard["optimizer"])
            c.optimizer.load_rank_state_dict(shard.get("optimizer_rank"))
        else:
            c.optimizer.load_state_dict(shard["optimizer"])
        keep = "command line" if ck.override_opt_param_scheduler else \
            "checkpoint" if ck.use_checkpoint_opt_param_scheduler else None
        # NOTE: an import with its optimizer's moments (import-megatron of a distrib_optim.pt) holds no schedule
        lines = c.scheduler.load_state_dict(shard["scheduler"], keep) if shard["scheduler"] else \
            ["the checkpoint holds no learning-rate schedule (imported with its optimizer state): this command "
             "line's, from its start"]
        for line in lines:
            if c.groups.rank == 0:
                log.info("--load %s: %s", path, line)
    if not ck.no_load_rng and "rng" in shard:
        set_rng_state(shard["rng"], c.backend)
        for m, st in zip(c.modules, shard["trackers"]):
            m.rng_tracker.set_states(st)
    elif not ck.no_load_rng and c.groups.rank == 0:
        log.info("--load %s: the checkpoint holds no RNG state for this layout: dropout and other random streams "
                 "start fresh from --seed; the data order continues from sample %d", path, meta["consumed_samples"])
    if "fp8" in shard and c.extra.get("fp8_load") is not None:
        c.extra["fp8_load"](shard["fp8"])
    if "expert_bias" in shard:  # torch_dist (the torch format has it in the model's state)
        from omnitron.core.transformer.moe.router import load_expert_bias_state

        load_expert_bias_state(c.modules, shard["expert_bias"])
    c.iteration = int(meta["iteration"])
    c.consumed_samples = int(meta["consumed_samples"])
    c.consumed_valid_samples = meta.get("consumed_valid_samples")  # None in older checkpoints: computed instead
    if c.groups.rank == 0:
        log.info("resumed from %s (iteration %d, %d samples consumed)", path, c.iteration, c.consumed_samples)
    return True


def _load_torch(c, path: str, meta: dict, changes: list) -> dict:
    """Read a ``torch``-format checkpoint's shard for this rank (cut from the full tensors under another layout)
    and load its weights into the model; returns the shard (optimizer state completed from the other ranks'
    files, each entry with its master, under the checkpoint's own layout)."""
    ck = c.settings.checkpoint
    shard = _resharded_shard(c, path, meta) if changes else read_shard(path, c.groups.rank, meta)
    if not (changes or ck.finetune or ck.no_load_optim or shard["optimizer"].get("weights_only")):
        _complete_optimizer_state(path, shard)
        _masters_from_weights(shard)
        _weights_from_masters(shard, c.modules)
    for m, sd in zip(c.modules, shard["model"]):
        names = m.state_dict().keys()
        if names != sd.keys():  # another model's weights: one line naming them (strict loading's is lines)
            raise mismatch_error(path, names - sd.keys(), sd.keys() - names)
        m.load_state_dict(sd)
    return shard


def _resharded_shard(c, path: str, meta: dict) -> dict:
    """This rank's shard cut from the checkpoint's full tensors (no RNG and FP8 state: see :func:`load`)."""
    ck = c.settings.checkpoint
    src, dst = reshard.Layout.from_dict(meta["layout"]), reshard.Layout.from_dict(layout_dict(c.settings))
    if c.groups.rank == 0:
        log.info("--load %s: resharding the checkpoint from %s to %s", path, src, dst)
    full = reshard.read_full_state(path, owners=reshard.needed_owners(c.modules),
                                   with_optimizer=not (ck.finetune or ck.no_load_optim))
    if "fp8" in full.dropped and c.groups.rank == 0 and _holds_tensors(read_shard(path, 0, meta).get("fp8")):
        log.info(FP8_RESTART, path)
    return reshard.rank_shard(full, c.modules, c.groups.tp.size, local_rank(c.groups.tp))


def save_dir_exists(settings) -> bool:
    return bool(settings.checkpoint.save) and os.path.isdir(settings.checkpoint.save)


__all__ = ["check_resume", "finish_saves", "load", "save", "MODEL_SHAPE_KEYS"]
