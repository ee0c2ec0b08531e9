"""Command-line and config-file settings -> validated dataclasses, before any process group exists.

How a flag comes to exist (no flag is written out by hand except the launch options): the flag table
(:mod:`omnitron.core.training.flag_table`) makes every field of the config dataclasses a flag with Megatron's
spelling, and :mod:`omnitron.core.training.flag_parser` builds ``omnitron train``'s parser from it.

Precedence: dataclass default < ``--model PRESET`` < ``--config FILE`` < command line
(:func:`merge_settings`, :mod:`omnitron.core.training.flag_merge`); :func:`build_settings` then builds and
cross-checks the configs (the cross-flag refusals: :mod:`omnitron.core.training.settings_checks`; batch sizes
and the run's length: :mod:`omnitron.core.training.batch_settings`). This module keeps the public names of all
of them (:func:`parse_settings`, :func:`add_arguments`, :func:`options`, ...).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, fields
from typing import Any

from omnitron.core.config.parallel import ConfigError, ParallelConfig, data_parallel_size
from omnitron.core.config.training import (CheckpointConfig, LoggingConfig, OptimizerConfig, PrecisionConfig,
                                           TrainingConfig)
from omnitron.core.training.batch_settings import _check_schedules, _training_settings, batch_ramp
from omnitron.core.training.flag_merge import load_config_file, merge_settings
from omnitron.core.training.flag_parser import (MEGATRON_ENTRIES, add_arguments, megatron_flag_names, model_words,
                                                preload_family_modules, setting_words, train_parser)
from omnitron.core.training.flag_table import Option, _build, _ddp_config_class, _fp8_config_class, field_docs, options
from omnitron.core.training.settings_checks import (_check_data_sources, _check_mtp, _check_muon_whole_qkv,
                                                    _check_onebit, _check_run, _check_t5_corruption)

__all__ = ["MEGATRON_ENTRIES", "Option", "Settings", "add_arguments", "batch_ramp", "build_settings", "field_docs",
           "load_config_file", "megatron_flag_names", "merge_settings", "model_words", "options", "parse_settings",
           "preload_family_modules", "resolved_config", "setting_words", "train_parser"]

log = logging.getLogger("omnitron.train")


def _sample_temperature(value) -> float:
    """--sample-temperature, default 0.8; it must be positive (top-k 1 is the greedy choice)."""
    t = 0.8 if value is None else float(value)
    if not t > 0:
        raise ConfigError(f"--sample-temperature {value} must be positive; for greedy sampling give --sample-top-k 1")
    return t


def _sample_count(value, flag: str, default: int) -> int:
    """--sample-tokens (default 40; 0: no sample) and --sample-top-k (default 20; 0: no top-k filter): a given 0
    is kept (``value or default`` turned it into the default), a negative count is refused."""
    n = default if value is None else int(value)
    if n < 0:
        raise ConfigError(f"{flag} {value} must be 0 or more (0 turns it off)")
    return n


@dataclass
class Settings:
    """Every validated config of one training run, plus launch options."""

    model: Any
    parallel: ParallelConfig
    data: Any
    training: TrainingConfig
    optim: OptimizerConfig
    precision: PrecisionConfig
    ddp: Any
    """DataParallelConfig (gradient buckets, overlap), when the data-parallel package is present."""
    fp8: Any
    """FP8Config when --fp8-format was given, else None."""
    logging: LoggingConfig
    checkpoint: CheckpointConfig
    world_size: int
    nproc_per_node: int
    backend: str | None
    threads: int | None
    prompt: str | None
    sample_tokens: int
    sample_top_k: int
    sample_temperature: float
    flat: dict[str, Any]
    """The merged flat settings: what was given (preset, file, flags)."""
    model_type: str = "gpt"
    """``--model-type``: the model family's registered name (``gpt``, ``bert``, ``t5``, ``multimodal``, ...)."""
    started_at: float = field(default_factory=time.time, compare=False)
    """When the job started (``time.time()`` as the settings were built; spawned workers get the launcher's):
    --exit-duration-in-mins counts from here, so the startup (model build, data indexes, checkpoint load) counts
    towards the limit, as Megatron counts from its program's start."""

    @property
    def dp(self) -> int:
        return data_parallel_size(self.parallel, self.world_size)

    @property
    def num_microbatches(self) -> int:
        return self.training.global_batch_size // (self.training.micro_batch_size * self.dp)

    @property
    def eval_microbatches(self) -> int:
        """Micro-batches a rank runs for one evaluation batch (--eval-global-batch-size)."""
        return self.training.eval_batch // (self.training.micro_batch_size * self.dp)


def resolved_config(settings: Settings) -> dict[str, Any]:
    """What a checkpoint records as the run's config: every setting's value, defaults included (an export or
    a later reader must not guess a default, e.g. the default tokenizer), the given ones over them, and the
    values the configs resolved (the global batch size, the iterations of a --train-samples run)."""
    from omnitron.core.models.family import families

    others = {k for name, fam in families().items() if name != settings.model_type for k in fam.own_fields()}
    out = {dest: opt.default for dest, opt in options().items() if dest not in others}  # not other families' own
    # NOTE: not the model's vocab_size (the tokenizer's, padded rows excluded): --vocab-size is NullTokenizer's V
    out.update({f.name: getattr(settings.model, f.name) for f in fields(settings.model)
                if f.name in out and f.name != "vocab_size"})
    for cfg in (settings.data, settings.training, settings.optim, settings.logging, settings.checkpoint):
        out.update({f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name in out})
    out.update(settings.flat)
    for key in _TOKENIZER_FILES:  # a reader (generate, serve, export) may run from another directory
        if isinstance(out.get(key), str) and not os.path.isabs(out[key]) and os.path.exists(out[key]):
            out[key] = os.path.abspath(out[key])
    return out


_TOKENIZER_FILES = ("vocab_file", "merge_file", "tokenizer_model")
"""Settings naming the tokenizer's files, recorded as absolute paths (a hub name that is no file stays as given)."""


def build_settings(merged: dict[str, Any], world_size: int | None = None) -> Settings:
    """Construct and cross-validate every config; raises ConfigError naming the flag and fix. One helper per
    concern below builds its configs and checks what it alone can, in this order."""
    if "num_layers" not in merged and merged.get("encoder_num_layers"):  # Megatron's T5: --num-layers is the encoder's
        merged = {**merged, "num_layers": merged["encoder_num_layers"]}
    missing = [o for o in ("num_layers", "hidden_size", "num_attention_heads") if o not in merged]
    if missing:
        flags = ", ".join("--" + m.replace("_", "-") for m in missing)
        raise ConfigError(f"the model is not defined: give {flags}, or start from a preset with --model gpt2_tiny")
    given_nproc = merged.get("nproc_per_node")
    nproc = 1 if given_nproc is None else int(given_nproc)  # NOTE: not ``or 1``: 0 is a setting to refuse
    if nproc < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1 (worker processes on this node), got {nproc}")
    world = world_size or int(os.environ.get("WORLD_SIZE", nproc))
    precision = _build(PrecisionConfig, merged)
    merged = _nan_check_default(merged, precision)
    family, model, parallel = _model_settings(merged, precision)
    training = _training_settings(merged, data_parallel_size(parallel, world), model.seq_length)
    if training.calculate_per_token_loss and getattr(model, "num_experts", None):
        raise ConfigError("--calculate-per-token-loss with MoE: the load-balancing loss is weighted per micro-batch, "
                          "not per token, yet; drop --calculate-per-token-loss (or train a dense model)")
    if getattr(model, "num_experts", None):
        from omnitron.core.transformer.moe.validate import check_router_trains

        check_router_trains(model)
    _check_mtp(merged, family.name, training)
    if parallel.overlap_moe_expert_parallel_comm:
        from omnitron.core.parallel.pipeline.combined import check_schedule

        check_schedule(training.pipeline_schedule)
    _check_schedules(training, parallel, data_parallel_size(parallel, world), model.seq_length)
    data = _data_settings(merged, model, parallel, training)
    _check_t5_corruption(family.name, model, data)
    fp8 = _fp8_settings(merged)
    if fp8 is not None:
        fp8.check_layers(model.num_layers, parallel.pipeline_model_parallel_size)
    logging_cfg = _build(LoggingConfig, merged)
    logging_cfg.check_world(world)
    checkpoint = _build(CheckpointConfig, merged, **({"no_load_optim": True} if training.skip_train else {}))
    optim = _build(OptimizerConfig, merged)
    if not training.skip_train:  # Megatron builds no scheduler for --skip-train
        from omnitron.core.optim.schedules import check_lengths

        check_lengths(optim, training.train_iters, training.train_samples)
    ddp = _ddp_settings(merged, precision)
    if ddp is not None:
        from omnitron.core.parallel.data.config import check_fsdp2

        check_fsdp2(ddp, family=family.name, model=model, parallel=parallel, dp=data_parallel_size(parallel, world),
                    fp8=fp8, checkpoint=checkpoint, training=training)
    _check_onebit(optim, ddp, precision, parallel, model)
    if optim.optimizer == "muon" and ddp is not None and getattr(ddp, "use_torch_fsdp2", False):
        raise ConfigError("--optimizer muon orthogonalises whole matrices, which --use-torch-fsdp2 shards by rows "
                          "without a gather step yet; use --use-distributed-optimizer or drop --use-torch-fsdp2")
    _check_muon_whole_qkv(optim, model, parallel)
    _check_run(training, data, checkpoint)
    from omnitron.core.capture import check_settings

    check_settings(training, model, parallel, fp8, ddp)
    model_type = family.name
    return Settings(model=model, parallel=parallel, data=data, training=training, optim=optim, precision=precision,
                    ddp=ddp, fp8=fp8, logging=logging_cfg, checkpoint=checkpoint, world_size=world,
                    nproc_per_node=nproc,
                    backend=merged.get("backend"), threads=merged.get("threads_per_process"),
                    prompt=merged.get("prompt"),
                    sample_tokens=_sample_count(merged.get("sample_tokens"), "--sample-tokens", 40),
                    sample_top_k=_sample_count(merged.get("sample_top_k"), "--sample-top-k", 20),
                    sample_temperature=_sample_temperature(merged.get("sample_temperature")),
                    flat={k: v for k, v in merged.items() if k not in ("config", "nproc_per_node")},
                    model_type=model_type)


def _model_settings(merged: dict[str, Any], precision: PrecisionConfig):
    """(family, model config, parallel config): the family's config class, the virtual pipeline size from
    ``--num-layers-per-virtual-pipeline-stage`` or ``--num-virtual-stages-per-pipeline-rank``, the family's and the
    shared model checks."""
    from omnitron.core.models.gpt.config import validate_model
    from omnitron.core.parallel.pipeline.layout import config_layer_ranges, virtual_pipeline_size
    from omnitron.core.precision import params_dtype

    # the model's vocabulary comes from the tokenizer (--vocab-size is NullTokenizer's setting)
    family = _model_family(merged)
    model = _build(family.config_cls, {k: v for k, v in merged.items() if k != "vocab_size"},
                   params_dtype=params_dtype(precision))
    pp = int(merged.get("pipeline_model_parallel_size", 1))
    vp = virtual_pipeline_size(model.num_layers, pp, merged.get("num_layers_per_virtual_pipeline_stage"),
                               merged.get("num_virtual_stages_per_pipeline_rank"),
                               merged.get("decoder_first_pipeline_num_layers"),
                               merged.get("decoder_last_pipeline_num_layers"),
                               bool(merged.get("account_for_embedding_in_pipeline_split")),
                               bool(merged.get("account_for_loss_in_pipeline_split")))
    parallel = _build(ParallelConfig, merged, virtual_pipeline_model_parallel_size=vp)
    if family.validate is not None:
        family.validate(model, parallel)
    validate_model(model, parallel, check_layers=not parallel.uneven_pipeline)
    if parallel.uneven_pipeline:  # the layer split itself is checked here, naming the flags
        from omnitron.core.parallel.pipeline.schedules import schedule_style

        config_layer_ranges(model.num_layers, parallel, schedule_style(merged.get("pipeline_schedule")))
    return family, model, parallel


def _nan_check_default(merged: dict[str, Any], precision: PrecisionConfig) -> dict[str, Any]:
    """``merged`` with --check-for-nan-in-loss-and-grad off under --fp16 with dynamic loss scaling, as Megatron's
    validate_args sets it whatever was asked: there a non-finite loss or gradient is the scaler's signal (the step
    is skipped, counted in nan_iters, and the scale backs off), not a reason to stop; kept on, the check would stop
    the run at the first overflow (iteration 1 at the initial scale 2^32). A run that names the flag is told."""
    if not (precision.fp16 and precision.loss_scale is None):
        return merged
    if merged.get("check_for_nan_in_loss_and_grad", False):  # named (a flag, a file): it cannot hold here
        log.warning("--check-for-nan-in-loss-and-grad is off: --fp16 with dynamic loss scaling skips non-finite steps "
                    "and backs off the scale (Megatron's validate_args turns the check off the same way); for the "
                    "check under fp16 give a constant --loss-scale")
    else:
        log.info("--check-for-nan-in-loss-and-grad is off: --fp16 with dynamic loss scaling skips non-finite steps "
                 "(as Megatron)")
    return {**merged, "check_for_nan_in_loss_and_grad": False}


def _data_settings(merged: dict[str, Any], model, parallel: ParallelConfig, training: TrainingConfig):
    """The data config, at the model's sequence length and the run's seed."""
    from omnitron.core.data.config import DataConfig

    data = _build(DataConfig, merged, seq_length=model.seq_length, seed=training.seed)
    _check_data_sources(merged, data)
    if data.reset_attention_mask and parallel.context_parallel_size > 1:
        raise ConfigError(f"--reset-attention-mask with --context-parallel-size {parallel.context_parallel_size}: "
                          "ring attention has no per-document mask; use --context-parallel-size 1 or drop "
                          "--reset-attention-mask")
    return data


def _fp8_settings(merged: dict[str, Any]):
    """FP8Config when ``--fp8-format`` switches FP8 on, else None (other ``--fp8-*`` flags alone are errors)."""
    fp8_cls = _fp8_config_class()
    fp8_on = merged.get("fp8_format") is not None  # as Megatron: --fp8-format switches FP8 on
    fp8 = _build(fp8_cls, merged) if (fp8_cls is not None and fp8_on) else None
    if fp8_on and fp8_cls is None:
        raise ConfigError("--fp8-format needs omnitron.core.precision.fp8, which this build lacks; drop the FP8 flags")
    if fp8 is None and any(k.startswith("fp8_") for k in merged):
        raise ConfigError("--fp8-recipe and the other --fp8-* settings need --fp8-format e4m3|hybrid to switch FP8 on")
    return fp8


def _ddp_settings(merged: dict[str, Any], precision: PrecisionConfig):
    """The data-parallel config, as Megatron's validate_args sets it: with --bf16 gradients are accumulated and
    all-reduced in fp32 unless --grad-reduce-in-bf16, which wins over --accumulate-allreduce-grads-in-fp32 (Megatron
    drops the latter without a word; here a warning says so). Without --bf16 both flags stay as given (there
    --grad-reduce-in-bf16 changes nothing, as in Megatron)."""
    from dataclasses import replace

    ddp = _build(_ddp_config_class(), merged) if _ddp_config_class() else None
    if ddp is None or not precision.bf16:
        return ddp
    if ddp.grad_reduce_in_bf16:
        if ddp.accumulate_allreduce_grads_in_fp32:
            log.warning("--accumulate-allreduce-grads-in-fp32 is off: --grad-reduce-in-bf16 with --bf16 accumulates "
                        "and reduces gradients in bf16 (Megatron lets it win the same way); drop one of the two flags")
        return replace(ddp, accumulate_allreduce_grads_in_fp32=False)
    # as Megatron: bf16 training accumulates and all-reduces gradients in fp32 (bf16 sums of
    # many micro-batches lose the small contributions) unless --grad-reduce-in-bf16 asks for bf16
    return replace(ddp, accumulate_allreduce_grads_in_fp32=True)


def _entry_model_type(merged: dict[str, Any]) -> None:
    """``--entry pretrain_bert`` (or ``path/to/pretrain_bert.py``): set ``model_type`` to the script's family;
    ConfigError naming both when ``--model-type`` or a preset says otherwise."""
    entry = merged.get("entry")
    if entry is None:
        return
    name = os.path.basename(str(entry)).removesuffix(".py")
    if name not in MEGATRON_ENTRIES:
        raise ConfigError(f"--entry {entry}: not a Megatron training script omnitron runs; use one of "
                          f"{', '.join(MEGATRON_ENTRIES)}")
    want, have = MEGATRON_ENTRIES[name], merged.get("model_type")
    if have not in (None, want):
        raise ConfigError(f"--entry {name} trains {want}, but --model-type (or the --model preset) says {have}; "
                          f"drop one of them")
    merged["model_type"] = want


def _model_family(merged: dict[str, Any]):
    """The ``--model-type`` family (a preset implies its own); another family's own flags without it are
    errors, then the family's ``check_flags`` refuses what does not apply to it and sets its defaults (BERT
    and T5: the BertWordPieceLowerCase tokenizer; T5's ``--encoder-seq-length`` sets ``--seq-length``)."""
    from omnitron.core.models.family import families, get_family

    _entry_model_type(merged)
    family = get_family(merged.get("model_type") or "gpt")
    for other in families().values():
        only = [k for k in other.own_fields() if k in merged and k not in family.own_fields()]
        if other is not family and only:
            raise ConfigError(f"--{only[0].replace('_', '-')} only applies to {other.name.upper()}; add --model-type "
                              f"{other.name}")
    if family.check_flags is not None:
        family.check_flags(merged)
    return family


def parse_settings(argv: list[str], world_size: int | None = None) -> Settings:
    """argv -> Settings (argparse exits with code 2 on unknown flags; ConfigError on bad values)."""
    preload_family_modules(argv)
    given = vars(train_parser().parse_args(argv))
    return build_settings(merge_settings(given), world_size)
