"""Everything one rank trains with, built once from validated :class:`Settings`.

Order matters and is fixed here: seeds, groups, model chunks (one per virtual stage), the
data-parallel wrapper, optimizer + scheduler + loss scaler, tokenizer and datasets. Nothing in
here runs a step; :mod:`omnitron.core.training.step` does.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from omnitron.core.models.bert import BertConfig, BertModel
from omnitron.core.models.gpt.config import GPTConfig
from omnitron.core.models.gpt.model import GPTModel
from omnitron.core.models.multimodal import LLaVAModel, MultimodalConfig
from omnitron.core.models.t5 import T5Config, T5Model, decoder_length
from omnitron.core.optim import DistributedOptimizer, LRScheduler, MixedPrecisionOptimizer
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.core.parallel.pipeline.layout import pipeline_layer_ranges
from omnitron.core.parallel.pipeline.schedules import build_schedule
from omnitron.core.parallel.tensor.random import default_seed
from omnitron.core.precision import build_loss_scaler


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
    """The pipeline schedule table (validation runs its forwards only)."""
    train_data: Any
    valid_data: Any
    iteration: int = 0
    consumed_samples: int = 0
    extra: dict = field(default_factory=dict)


def seed_everything(seed: int, pp_rank: int, backend) -> None:
    """Default generators: the same on every tp rank of a stage (Megatron's seed + 100 * pp)."""
    s = default_seed(seed, pp_rank)
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
    backend.manual_seed(s)


def build_model_chunks(cfg: GPTConfig, groups: ParallelGroups, seed: int, backend) -> list[GPTModel]:
    """This pipeline rank's chunks (one per virtual stage), each a GPTModel (a BertModel for a BERT
    config) over its layer range (a T5 / multimodal config: the one T5Model / LLaVAModel chunk; no stages)."""
    for config_cls, model_cls in ((T5Config, T5Model), (MultimodalConfig, LLaVAModel)):
        if isinstance(cfg, config_cls):
            return [model_cls(cfg, groups, backend=backend, seed=seed).to(backend.current_device())]
    pp, vp = groups.pp.size, groups.config.virtual_pipeline_model_parallel_size or 1
    pc = groups.config
    ranges = pipeline_layer_ranges(cfg.num_layers, pp, vp, pc.decoder_first_pipeline_num_layers,
                                   pc.decoder_last_pipeline_num_layers)
    rank = groups.pp.rank if pp > 1 else 0
    chunks = []
    for c in range(vp):
        offset, n = ranges[(rank, c)]
        first, last = rank == 0 and c == 0, rank == pp - 1 and c == vp - 1
        stage_cls = BertModel if isinstance(cfg, BertConfig) else GPTModel
        chunk = stage_cls(cfg, groups, pre_process=first, post_process=last, layer_offset=offset, num_layers=n,
                          backend=backend, seed=seed)
        chunks.append(chunk.to(backend.current_device()))
    return chunks


def wrap_data_parallel(modules: list[GPTModel], settings, groups):
    """Chunks wrapped by the data-parallel package when it is present, else the modules themselves
    (gradients are then reduced by :func:`omnitron.core.training.grads.finalize_grads`)."""
    try:
        from omnitron.core.parallel.data import DistributedDataParallel
    except ImportError:
        return list(modules)
    return [DistributedDataParallel(m, groups, settings.ddp) for m in modules]


def duplicate_params(modules: list[GPTModel]) -> list[torch.nn.Parameter]:
    """The last stage's copy of a tied word embedding: excluded from the gradient norm."""
    return [p for m in modules for p in m.parameters() if getattr(p, "shared_embedding", False)]


def build_data(settings, tokenizer, groups, collectives):
    """(train, valid) datasets sized for the whole run; rank 0 builds index caches, others wait.
    GPT datasets, or BERT's (two segments, masked LM) for a BERT model, or T5's (span corruption)."""
    from omnitron.core.data import build_gpt_datasets

    build, kw = build_gpt_datasets, {}
    if isinstance(settings.model, BertConfig):
        from omnitron.core.data.bert_dataset import build_bert_datasets

        build, kw = build_bert_datasets, {"binary_head": settings.model.bert_binary_head}
    if isinstance(settings.model, T5Config):
        from omnitron.core.data.t5_dataset import build_t5_datasets

        build, kw = build_t5_datasets, {"decoder_seq_length": decoder_length(settings.model)}
    if isinstance(settings.model, MultimodalConfig):  # synthetic image captions
        from omnitron.core.data.multimodal_dataset import build_multimodal_datasets
        from omnitron.core.models.multimodal import num_image_tokens

        m = settings.model
        build, kw = build_multimodal_datasets, {"img_h": m.img_h, "img_w": m.img_w, "num_channels": m.num_channels,
                                                "num_image_tokens": num_image_tokens(m)}
    t = settings.training
    gbs = t.global_batch_size
    evals = (t.train_iters // t.eval_interval + 1) if t.eval_interval else 0
    barrier = (lambda: collectives.barrier()) if collectives.is_initialized() else None
    train, valid, _ = build(settings.data, tokenizer, train_samples=t.train_iters * gbs,
                            valid_samples=t.eval_iters * gbs if evals else 0,
                            test_samples=0, is_builder_rank=groups.rank == 0, barrier=barrier, **kw)
    return train, valid


def enable_fp8_if_asked(modules, settings, groups, cfg, backend) -> dict:
    """FP8 linears when --fp8-format/--fp8-recipe was given; returns checkpoint hooks for their state."""
    if settings.fp8 is None:
        return {}
    from omnitron.core.precision.fp8 import enable_fp8, fp8_state_dict, load_fp8_state_dict

    enable_fp8(modules, settings.fp8, groups, num_layers=cfg.num_layers, backend=backend)
    return {"fp8_state": lambda: fp8_state_dict(modules), "fp8_load": lambda st: load_fp8_state_dict(modules, st)}


def build_optimizer(named, settings, groups, backend, chunks, duplicates) -> MixedPrecisionOptimizer:
    """The distributed (ZeRO-1) optimizer with --use-distributed-optimizer, else the replicated one."""
    kw = {"backend": backend, "loss_scaler": build_loss_scaler(settings.precision), "duplicates": duplicates}
    if getattr(settings.ddp, "use_distributed_optimizer", False):
        return DistributedOptimizer(named, settings.optim, groups, chunks=chunks, **kw)
    return MixedPrecisionOptimizer(named, settings.optim, groups, **kw)


def build_components(settings, backend) -> Components:
    from omnitron.core.data import build_tokenizer

    groups = ParallelGroups.build(settings.parallel, backend.collectives)
    seed_everything(settings.training.seed, groups.pp.rank, backend)
    d = settings.data
    tokenizer = build_tokenizer(d.tokenizer_type, vocab_file=d.vocab_file, merge_file=d.merge_file,
                                tokenizer_model=d.tokenizer_model, vocab_size=d.vocab_size,
                                vocab_extra_ids=getattr(settings.model, "vocab_extra_ids", 0))  # T5's sentinels
    cfg = replace(settings.model, vocab_size=tokenizer.vocab_size)
    modules = build_model_chunks(cfg, groups, settings.training.seed, backend)
    extra = enable_fp8_if_asked(modules, settings, groups, cfg, backend)
    chunks = wrap_data_parallel(modules, settings, groups)
    named = [(f"chunk{i}.{n}", p) for i, m in enumerate(modules) for n, p in m.named_parameters()]
    optimizer = build_optimizer(named, settings, groups, backend, chunks, duplicate_params(modules))
    scheduler = LRScheduler(settings.optim, settings.training.train_iters)
    pp, vp = groups.pp.size, settings.parallel.virtual_pipeline_model_parallel_size
    schedule = build_schedule(settings.training.pipeline_schedule, pp, vp, settings.num_microbatches)
    train, valid = build_data(settings, tokenizer, groups, backend.collectives)
    return Components(settings=settings, backend=backend, groups=groups, model=cfg, chunks=chunks, modules=modules,
                      optimizer=optimizer, scheduler=scheduler, tokenizer=tokenizer, schedule=schedule,
                      train_data=train, valid_data=valid, extra=extra)
