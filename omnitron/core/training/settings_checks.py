"""Cross-flag refusals: settings of two or more concerns that cannot run together, each refused before any
work with a :class:`ConfigError` naming the flags and the fix (called by
:func:`omnitron.core.training.arguments.build_settings`)."""
from __future__ import annotations

from typing import Any

from omnitron.core.config.parallel import ConfigError, ParallelConfig
from omnitron.core.config.training import CheckpointConfig, OptimizerConfig, PrecisionConfig, TrainingConfig


def _check_mtp(merged: dict[str, Any], family: str, training: TrainingConfig) -> None:
    """Multi-token prediction runs in the GPT family, weighted per micro-batch, on unpacked documents."""
    if not merged.get("mtp_num_layers"):
        return
    if family != "gpt":
        raise ConfigError(f"--mtp-num-layers: multi-token prediction is built for the gpt family only, not "
                          f"{family}; drop the flag")
    if training.calculate_per_token_loss:
        raise ConfigError("--mtp-num-layers with --calculate-per-token-loss: the MTP loss is weighted per "
                          "micro-batch, not per token, yet; drop --calculate-per-token-loss")
    if merged.get("reset_attention_mask"):
        raise ConfigError("--mtp-num-layers with --reset-attention-mask: the shifted tokens would cross document "
                          "boundaries; drop --reset-attention-mask")


def _check_data_sources(merged: dict[str, Any], data) -> None:
    """Megatron's rules for where the data comes from: one source (``--mock-data``, ``--data-path`` or the per-split
    paths; validate_args asserts it), and ``--split`` only with ``--data-path`` (BlendedMegatronDatasetConfig: "split
    and blend_per_split are incompatible"; a per-split file is read whole)."""
    given = [flag for flag, _ in data.path_flags()]
    if data.mock_data and given:
        raise ConfigError(f"--mock-data with {' '.join(given)}: give one data source (Megatron refuses both: synthetic "
                          "tokens or the files); drop --mock-data or the paths")
    if data.per_split and merged.get("split") is not None:
        raise ConfigError(f"--split {merged['split']} with {' '.join(given)}: each split reads all of its own files, "
                          "so there is nothing to cut (Megatron refuses both); drop --split, or give --data-path")


def _check_onebit(optim: OptimizerConfig, ddp, precision: PrecisionConfig, parallel: ParallelConfig, model) -> None:
    """What --optimizer onebit_adam cannot combine with, each refused with the reason and the fix."""
    if optim.optimizer != "onebit_adam":
        if optim.onebit_freeze_step is not None:
            raise ConfigError("--onebit-freeze-step applies to --optimizer onebit_adam only; add it or drop the flag")
        return
    why = "--optimizer onebit_adam"
    if ddp is not None and ddp.use_distributed_optimizer:
        raise ConfigError(f"{why} all-reduces the full momentum on every data-parallel rank, which "
                          "--use-distributed-optimizer shards; drop --use-distributed-optimizer or use "
                          "--optimizer adam")
    if ddp is not None and getattr(ddp, "use_torch_fsdp2", False):
        raise ConfigError(f"{why} all-reduces the full momentum on every data-parallel rank, which "
                          "--use-torch-fsdp2 shards; drop --use-torch-fsdp2 or use --optimizer adam")
    if precision.fp16:
        raise ConfigError(f"{why} has no fp16 loss-scale skipping over local gradients; use --bf16 (or fp32)")
    if precision.loss_scale is not None and precision.bf16:
        raise ConfigError(f"{why} has no loss-scale skipping over local gradients; drop --loss-scale")
    if parallel.context_parallel_size > 1:
        raise ConfigError(f"{why} is not implemented with context parallelism; use --context-parallel-size 1")
    if getattr(model, "num_experts", None):
        raise ConfigError(f"{why} is not implemented for MoE experts (reduced over expert-data-parallel ranks); "
                          "drop --num-experts or use --optimizer adam")


def _check_muon_whole_qkv(optim: OptimizerConfig, model, parallel: ParallelConfig) -> None:
    """--muon-no-split-qkv orthogonalises the fused QKV weight whole; with fewer query groups than tp ranks the
    attention keeps it as two parameters (linear_q sharded, linear_kv replicated), so no rank holds it."""
    if (optim.optimizer != "muon" or optim.muon_split_qkv or not getattr(model, "num_attention_heads", None)
            or getattr(model, "multi_latent_attention", False)):
        return
    from omnitron.core.transformer.shapes import query_groups

    groups, tp = query_groups(model), parallel.tensor_model_parallel_size
    if groups < tp:
        raise ConfigError(f"--muon-no-split-qkv orthogonalises the fused QKV weight whole, but --num-query-groups "
                          f"{groups} < --tensor-model-parallel-size {tp} keeps it as a sharded query and a replicated "
                          "key/value weight; drop --muon-no-split-qkv or use a tensor-parallel size <= the groups")


def _check_t5_corruption(family: str, model, data) -> None:
    """T5: the decoder and the sentinels hold the most a sample's span corruption can make at --mask-prob (the
    dataset's own check, here before any work)."""
    if family != "t5" or not getattr(model, "vocab_extra_ids", 0):
        return
    from omnitron.core.data.t5_dataset import corruption_problem
    from omnitron.core.models.t5.config import decoder_length

    problem = corruption_problem(model.seq_length, decoder_length(model), model.vocab_extra_ids, data.mask_prob)
    if problem:
        raise ConfigError(problem)


def _check_run(training: TrainingConfig, data, checkpoint: CheckpointConfig) -> None:
    """Cross-checks between the run's configs: validation needs a validation split; --finetune needs --load."""
    if training.eval_interval and data.per_split and not data.valid_data_path:
        raise ConfigError(f"--eval-interval {training.eval_interval} needs --valid-data-path when the splits have "
                          "their own files; add it or use --eval-interval 0")
    if data.split and not data.mock_data and not data.per_split:
        from omnitron.core.data.config import split_weights

        weights = split_weights(data.split)
        if weights[0] == 0:
            raise ConfigError(f"--split {data.split} gives training no documents; give the first (training) share a "
                              f"weight, e.g. --split 969,30,1")
        if training.eval_interval and weights[1] == 0:
            raise ConfigError(f"--eval-interval {training.eval_interval} needs a validation split, but --split "
                              f"{data.split} gives it none; use e.g. --split 969,30,1 or --eval-interval 0")
    if training.skip_train and not training.eval_iters:
        raise ConfigError("--skip-train with --eval-iters 0 evaluates nothing; give --eval-iters N (batches of the "
                          "validation and test splits to evaluate)")
    if checkpoint.finetune and not checkpoint.load:
        raise ConfigError("--finetune needs --load DIR (the checkpoint whose weights to start from)")
    if checkpoint.override_opt_param_scheduler and checkpoint.use_checkpoint_opt_param_scheduler:
        raise ConfigError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler contradict each "
                          "other (the command line's schedule, or the checkpoint's): give one")
