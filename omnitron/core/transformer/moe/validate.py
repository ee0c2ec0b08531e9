"""MoE settings against each other and against the parallel layout (errors name the flag and the fix)."""
from __future__ import annotations

from omnitron.core.config.parallel import ConfigError, ParallelConfig

LOAD_BALANCING = ("aux_loss", "none")


def check_moe_fields(c) -> None:
    """Local invariants of the MoE fields of a model config (called from its ``__post_init__``)."""
    if c.num_experts is None:
        return
    if not isinstance(c.num_experts, int) or c.num_experts < 1:
        raise ConfigError(f"--num-experts must be a positive integer, got {c.num_experts!r}")
    if not 1 <= c.moe_router_topk <= c.num_experts:
        raise ConfigError(f"--moe-router-topk {c.moe_router_topk} must be between 1 and --num-experts "
                          f"{c.num_experts}; lower --moe-router-topk or add experts")
    if c.moe_ffn_hidden_size is not None and c.moe_ffn_hidden_size < 1:
        raise ConfigError(f"--moe-ffn-hidden-size must be a positive integer, got {c.moe_ffn_hidden_size}")
    if c.moe_router_load_balancing_type not in LOAD_BALANCING:
        raise ConfigError(f"--moe-router-load-balancing-type {c.moe_router_load_balancing_type!r} is not one of "
                          f"{', '.join(LOAD_BALANCING)}")
    if c.moe_aux_loss_coeff < 0:
        raise ConfigError(f"--moe-aux-loss-coeff must be >= 0, got {c.moe_aux_loss_coeff}")


def validate_moe(c, parallel: ParallelConfig) -> None:
    """The expert layout: ep divides the experts, expert tensor parallelism 1, tp shards of the sequence."""
    ep, tp = parallel.expert_model_parallel_size, parallel.tensor_model_parallel_size
    if c.num_experts is None:
        if ep > 1:
            raise ConfigError(f"--expert-model-parallel-size {ep} needs an MoE model: set --num-experts "
                              f"(a multiple of {ep}) or use --expert-model-parallel-size 1")
        return
    if c.num_experts % ep:
        raise ConfigError(f"--num-experts {c.num_experts} is not divisible by --expert-model-parallel-size {ep}; "
                          f"each expert-parallel rank holds the same number of experts")
    if parallel.etp != 1:
        raise ConfigError(f"expert tensor parallelism {parallel.etp} is not supported (it defaults to "
                          f"--tensor-model-parallel-size); pass --expert-tensor-parallel-size 1")
    if tp > 1 and c.seq_length % tp:
        raise ConfigError(f"--seq-length {c.seq_length} is not divisible by --tensor-model-parallel-size {tp}: MoE "
                          f"layers dispatch one sequence slice per tensor-parallel rank; change --seq-length")
    if parallel.context_parallel_size > 1:
        raise ConfigError("MoE layers with --context-parallel-size > 1 are not supported yet; use "
                          "--context-parallel-size 1")
