"""Everything one rank trains with, built once from validated :class:`Settings`.

Order matters and is fixed here: seeds, groups, model chunks (one per virtual stage), the
data-parallel wrapper, optimizer + scheduler + loss scaler, tokenizer and datasets. Nothing in
here runs a step; :mod:`omnitron.core.training.step` does.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from omnitron.core.data import DataError, build_tokenizer
from omnitron.core.data.config import default_cache_dir
from omnitron.core.data.tokenizers import tokenizer_kwargs
from omnitron.core.models.family import family_of
from omnitron.core.models.gpt.config import GPTConfig
from omnitron.core.models.gpt.model import GPTModel
from omnitron.core.optim import DistributedOptimizer, LRScheduler, MixedPrecisionOptimizer
from omnitron.core.optim.muon import DistributedMuon, Muon
from omnitron.core.optim.onebit import OneBitAdam, resolve_freeze_step
from omnitron.core.parallel.data import DistributedDataParallel, FullyShardedDataParallel
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.core.parallel.pipeline.layout import config_layer_ranges
from omnitron.core.parallel.pipeline.combined import combine_1f1b
from omnitron.core.parallel.pipeline.schedules import build_schedule, schedule_style
from omnitron.core.parallel.tensor.random import default_seed
from omnitron.core.parallel.tensor.sharding import to_device
from omnitron.core.precision import build_loss_scaler
from omnitron.core.training.arguments import batch_ramp

log = logging.getLogger("omnitron.train")


@dataclass
class Components:
    """One rank's training objects (see the module docstring)."""

    settings: Any
    backend: Any
    groups: ParallelGroups
    model: GPTConfig
    chunks: list
    """What the pipeline runtime calls: model chunks, wrapped for data parallelism when available."""
    modules: list[GPTModel]
    """The unwrapped GPTModel chunks."""
    optimizer: MixedPrecisionOptimizer
    scheduler: LRScheduler
    tokenizer: Any
    schedule: Any
    """The pipeline schedule table of the current step (validation runs its forwards only)."""
    train_data: Any
    valid_data: Any
    test_data: Any = None
    """The test split, evaluated once after training (as Megatron)."""
    iteration: int = 0
    consumed_samples: int = 0
    consumed_valid_samples: int | None = None
    """Validation samples the run's evaluations have read (Megatron's consumed_valid_samples, saved in the
    checkpoint); None until the validation stream starts (a fresh run, or a checkpoint without the count)."""
    extra: dict = field(default_factory=dict)
    batches: Any = None
    """The run's :class:`~omnitron.core.training.batches.BatchRamp` (the batch size of each step)."""
    schedules: dict = field(default_factory=dict)
    """Schedule tables by micro-batch count (a --rampup-batch-size run steps through several)."""

    def schedule_for(self, num_microbatches: int):
        """The schedule table for ``num_microbatches`` (built once, like the run's first)."""
        if num_microbatches not in self.schedules:
            s, pc = self.settings, self.groups.config
            schedule = build_schedule(s.training.pipeline_schedule, self.groups.pp.size,
                                      pc.virtual_pipeline_model_parallel_size, num_microbatches,
                                      pc.microbatch_group_size_per_vp_stage)
            if pc.overlap_moe_expert_parallel_comm:  # forward/backward pairs (pipeline/combined.py)
                schedule = combine_1f1b(schedule)
            self.schedules[num_microbatches] = schedule
        return self.schedules[num_microbatches]


def seed_everything(seed: int, pp_rank: int, backend) -> None:
    """Default generators: the same on every tp rank of a stage (Megatron's seed + 100 * pp)."""
    s = default_seed(seed, pp_rank)
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
    backend.manual_seed(s)


def build_model_chunks(cfg: GPTConfig, groups: ParallelGroups, seed: int, backend,
                       schedule: str | None = None, *, on_device: bool = True) -> list[GPTModel]:
    """This pipeline rank's chunks (one per virtual stage), each its family's stage over its layer range
    (a family that is not pipelined, T5 / LLaVA: its one chunk; no stages). ``schedule``
    (``--pipeline-schedule``) places the chunks in a V for ``zb-v`` / ``dualpipe-v``; on the backend's device
    unless not ``on_device`` (sliced inference loading builds meta parameters and places them itself)."""
    family, pc = family_of(cfg), groups.config
    pp, vp = groups.pp.size, pc.virtual_pipeline_model_parallel_size or 1
    style = schedule_style(schedule)
    ranges = config_layer_ranges(cfg.num_layers, pc, style) if family.pipelined else {}
    rank = groups.pp.rank if pp > 1 else 0
    chunks = family.build_chunks(cfg, groups, ranges, rank, pp, vp, backend=backend, seed=seed, style=style)
    return [to_device(chunk, backend.current_device()) if on_device else chunk for _, chunk in sorted(chunks.items())]


def wrap_data_parallel(modules: list[GPTModel], settings, groups, backend):
    """Chunks wrapped by the data-parallel package (gradient buckets; their reduction, the sequence-parallel and
    the tied-embedding sums: :func:`omnitron.core.parallel.data.finalize_model_grads`); with --use-torch-fsdp2,
    each sharded in place by FSDP2 (:mod:`omnitron.core.parallel.data.fsdp`)."""
    if uses_fsdp2(settings):
        scales = fp8_weight_scales(settings, groups, backend)
        return [FullyShardedDataParallel(m, groups, compute_dtype=settings.model.params_dtype,
                                         device_type=backend.device_type, collectives=backend.collectives,
                                         reduce_every_microbatch=settings.ddp.fsdp2_reduce_every_microbatch,
                                         fp8_scales=scales)
                for m in modules]
    # NOTE: Megatron buckets the first chunk of the first pipeline stage only (get_model's disable_bucketing)
    return [DistributedDataParallel(m, groups, settings.ddp, bucketing=i == 0 and groups.pp.rank == 0)
            for i, m in enumerate(modules)]


def fp8_weight_scales(settings, groups, backend):
    """With FP8 and --use-torch-fsdp2: the :class:`~omnitron.core.precision.fp8.fsdp.WeightScales` that makes FSDP2
    all-gather the FP8 linears' weights in FP8 (over the amax reduction group, made here by every rank); else None."""
    if settings.fp8 is None:
        return None
    from omnitron.core.precision.fp8.enable import amax_reduction_group
    from omnitron.core.precision.fp8.fsdp import WeightScales

    return WeightScales(amax_reduction_group(groups, backend.collectives), backend.collectives,
                        margin=settings.fp8.scale_margin)


def fp8_refresh_hook(chunks) -> dict:
    """``{"fp8_refresh": ...}``: the FP8-gathered weights' scale refresh (one batched amax all-reduce), which
    train_step calls after each optimizer step and train after loading; empty without FP8 weight gathers."""
    scales = {id(s): s for ch in chunks for s in [getattr(ch, "fp8_scales", None)] if s is not None}
    if not scales:
        return {}
    return {"fp8_refresh": lambda: [s.refresh() for s in scales.values()]}


def holds_fp8_weights(settings) -> bool:
    """Whether compiled or captured layers read FP8 weights quantized once per step outside their graphs
    (:mod:`omnitron.core.precision.fp8.static_weights`). Not with FSDP2, which gathers a weight (in FP8) in its
    module's hook. ``--overlap-param-gather`` is fine: each layer's refresh runs after the layer's gather waits."""
    t = settings.training
    return (t.torch_compile or t.cuda_graph_impl == "local") and settings.fp8 is not None and not uses_fsdp2(settings)


def uses_fsdp2(settings) -> bool:
    return bool(getattr(settings.ddp, "use_torch_fsdp2", False))


def duplicate_params(modules: list[GPTModel]) -> list[torch.nn.Parameter]:
    """The last stage's copy of a tied word embedding: excluded from the gradient norm."""
    return [p for m in modules for p in m.parameters() if getattr(p, "shared_embedding", False)]


def evaluations_by(t, iteration: int) -> int:
    """How many --eval-interval evaluations a run has made by the end of ``iteration``: the multiples of the
    interval from --start-eval-at-iter on. Megatron's resume and sizing subtract ``start // interval``, one too
    many where the start is itself a multiple (its loop evaluates there): omnitron counts the evaluations its
    loop makes, so a resumed run reads on where the uninterrupted one would."""
    skipped = max(0, (t.start_eval_at_iter or 0) - 1) // t.eval_interval
    return max(0, iteration // t.eval_interval - skipped)


def eval_samples(t, resumed: tuple[int, int] | None = None) -> tuple[int, int]:
    """(validation, test) samples the run evaluates, as Megatron's get_train_valid_test_num_samples: every
    evaluation (one each --eval-interval iterations from --start-eval-at-iter on, one more after training)
    reads --eval-iters new global batches of the validation split, and the test split is evaluated once after
    training; none without --eval-interval or --eval-iters. --skip-train: one evaluation of each.
    ``resumed``: (iteration, validation samples read) of the checkpoint the run continues; its stream reads on
    from there, so the split holds at least that many more than this run's evaluations from the iteration on
    (more than the formula where --eval-interval / --eval-iters changed since)."""
    if not t.eval_iters or not (t.eval_interval or t.skip_train):
        return 0, 0
    per_eval = t.eval_iters * t.eval_batch
    if t.skip_train:
        return per_eval, per_eval
    total = (evaluations_by(t, t.train_iters) + 1) * per_eval
    if resumed is not None:
        iteration, read = resumed
        total = max(total, read + (evaluations_by(t, t.train_iters) - evaluations_by(t, iteration) + 1) * per_eval)
    return total, per_eval


def resumed_validation(settings) -> tuple[int, int] | None:
    """(iteration, consumed_valid_samples) of the checkpoint --load resumes, None when there is none, it does
    not hold the count (older checkpoints: the stream's position is computed, :class:`ValidationStream`), or
    the run starts its counts afresh (--finetune)."""
    from omnitron.core.checkpoint import find_latest, read_metadata

    ck = settings.checkpoint
    path = find_latest(ck.load, quiet=True, step=ck.ckpt_step) if ck.load and not ck.finetune else None
    meta = read_metadata(path) if path is not None else {}
    read = meta.get("consumed_valid_samples")
    return (int(meta["iteration"]), int(read)) if read is not None else None


def build_data(settings, tokenizer, groups, collectives):
    """(train, valid, test) datasets sized for the whole run, the model family's own (GPT's indexed documents,
    BERT's masked LM, T5's span corruption, LLaVA's synthetic captions, ...); rank 0 builds index caches, then
    each node's first rank where its node's cache lacks them, others wait."""
    t = settings.training
    gbs = t.global_batch_size
    barrier = (lambda: collectives.barrier()) if collectives.is_initialized() else None
    valid_samples, test_samples = eval_samples(t, None if t.skip_train else resumed_validation(settings))
    sizes = {"train_samples": t.train_samples or t.train_iters * gbs, "valid_samples": valid_samples,
             "test_samples": test_samples}
    if t.step_batch_size_schedule:  # every step's batch, the last one's overshoot of --train-samples included
        sizes["train_samples"] = batch_ramp(t, settings.dp, settings.model.seq_length).samples(t.train_iters)
    start, rank0 = time.perf_counter(), groups.rank == 0
    if rank0:
        cache_dir = settings.data.data_cache_path or default_cache_dir()
        where = "" if settings.data.mock_data else f" (index caches under {cache_dir})"
        log.info("building datasets: %d training, %d validation and %d test samples%s ...", sizes["train_samples"],
                 sizes["valid_samples"], sizes["test_samples"], where)
    # each node's first rank builds the caches its node lacks (a cache on each node's own disk)
    node_first = barrier is not None and torch.distributed.get_node_local_rank(fallback_rank=groups.rank) == 0
    datasets = family_of(settings.model).datasets(settings, tokenizer, **sizes, is_builder_rank=rank0,
                                                  barrier=barrier, is_node_builder=node_first)
    for ds, split, need in zip(datasets, ("training", "validation", "test"), sizes.values()):
        if ds is not None and len(ds) < need:  # several prefixes without weights: each is read once
            raise DataError(f"the {split} data holds {len(ds)} samples, the run reads {need}: --data-path prefixes "
                            "without weights are each read once (as Megatron); give WEIGHT PREFIX pairs, or "
                            "fewer --train-iters / --eval-iters")
    if rank0:
        log.info("datasets ready in %.1f s", time.perf_counter() - start)
    return datasets


def enable_fp8_if_asked(modules, settings, groups, cfg, backend) -> dict:
    """FP8 linears when --fp8-format/--fp8-recipe was given; returns checkpoint hooks for their state."""
    if settings.fp8 is None:
        return {}
    from omnitron.core.precision.fp8 import enable_fp8, fp8_state_dict, load_fp8_state_dict
    from omnitron.core.precision.fp8.enable import fp8_step

    # delayed scaling: one packed amax reduction per step (train_step calls fp8_step), as Transformer Engine
    enabled = enable_fp8(modules, settings.fp8, groups, num_layers=cfg.num_layers, backend=backend, per_step=True)
    return {"fp8_state": lambda: fp8_state_dict(modules), "fp8_load": lambda st: load_fp8_state_dict(modules, st),
            "fp8_step": lambda: fp8_step(enabled)}


def build_optimizer(named, settings, groups, backend, chunks, duplicates) -> MixedPrecisionOptimizer:
    """The distributed (ZeRO-1) optimizer with --use-distributed-optimizer, FSDP2's sharded-parameter one with
    --use-torch-fsdp2, else the replicated one."""
    scaler = build_loss_scaler(settings.precision, getattr(settings.ddp, "use_distributed_optimizer", False))
    kw = {"backend": backend, "loss_scaler": scaler, "duplicates": duplicates}
    if uses_fsdp2(settings):
        from omnitron.core.optim.fsdp import FSDP2Optimizer

        return FSDP2Optimizer(named, settings.optim, groups, **kw)
    muon = settings.optim.optimizer == "muon"
    if getattr(settings.ddp, "use_distributed_optimizer", False):
        cls = DistributedMuon if muon else DistributedOptimizer
        return cls(named, settings.optim, groups, chunks=chunks, **kw)
    if muon:
        return Muon(named, settings.optim, groups, **kw)
    if settings.optim.optimizer == "onebit_adam":
        shared = [p for c in chunks for p in (getattr(getattr(c, "module", c), "shared_embedding_parameters",
                                                      None) or list)()]
        return OneBitAdam(named, settings.optim, groups, freeze_step=resolve_freeze_step(
            settings.optim, settings.training.train_iters), isolate=shared, **kw)
    return MixedPrecisionOptimizer(named, settings.optim, groups, **kw)


def make_scheduler(settings) -> LRScheduler:
    """The run's learning-rate schedule from its settings (also built before launch to check a resume's)."""
    t = settings.training
    return LRScheduler(settings.optim, t.train_iters, t.train_samples, t.global_batch_size,
                       varying_batch=bool(t.step_batch_size_schedule))


def build_components(settings, backend) -> Components:

    groups = ParallelGroups.build(settings.parallel, backend=backend)
    seed_everything(settings.training.seed, groups.pp.rank, backend)
    d = settings.data
    family_kw = family_of(settings.model).tokenizer_kwargs(settings.model)  # T5's sentinels
    tokenizer = build_tokenizer(**tokenizer_kwargs(d), **family_kw)
    cfg = replace(settings.model, vocab_size=tokenizer.vocab_size)
    modules = build_model_chunks(cfg, groups, settings.training.seed, backend, settings.training.pipeline_schedule)
    extra = enable_fp8_if_asked(modules, settings, groups, cfg, backend)
    t = settings.training
    if t.cuda_graph_impl == "local":  # after FP8, so the captured (and compiled) layers run its linears
        from omnitron.core.capture import capture_layers

        capture_layers(modules, backend, compiled=t.torch_compile)
    elif t.torch_compile:  # after FP8 swaps the linears, so the compiled layers trace them
        from omnitron.core.compile import compile_layers

        compile_layers(modules, backend)
    if holds_fp8_weights(settings):
        from omnitron.core.precision.fp8.static_weights import hold_static_weights

        hold_static_weights(modules)  # the FP8 weights quantized once per step, outside the layers' graphs
    chunks = wrap_data_parallel(modules, settings, groups, backend)
    extra.update(fp8_refresh_hook(chunks))
    named = [(f"chunk{i}.{n}", p) for i, m in enumerate(modules) for n, p in m.named_parameters()]
    optimizer = build_optimizer(named, settings, groups, backend, chunks, duplicate_params(modules))
    scheduler = make_scheduler(settings)
    train, valid, test = build_data(settings, tokenizer, groups, backend.collectives)
    c = Components(settings=settings, backend=backend, groups=groups, model=cfg, chunks=chunks, modules=modules,
                   optimizer=optimizer, scheduler=scheduler, tokenizer=tokenizer, schedule=None, train_data=train,
                   valid_data=valid, test_data=test, extra=extra,
                   batches=batch_ramp(t, settings.dp, settings.model.seq_length))
    c.schedule = c.schedule_for(settings.num_microbatches)
    return c
