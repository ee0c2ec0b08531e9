"""MoE settings against each other and against the parallel layout (errors name the flag and the fix)."""
from __future__ import annotations

from omnitron.core.config.parallel import ConfigError, ParallelConfig
from omnitron.core.transformer.moe.capacity import DROP_POLICIES

LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "none")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
_NOT_HERE = {"global_aux_loss": "the balance loss over the whole global batch (counts summed over data parallelism "
                                "and accumulated over the step's micro-batches) is not implemented",
             "sinkhorn": "Sinkhorn routing (S-BASE) is not implemented",
             "quantile_balancing": "quantile balancing is not implemented"}


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
    _normalise_balancing(c)
    _check_extras(c)


def _normalise_balancing(c) -> None:
    """--moe-router-load-balancing-type and --moe-aux-loss-coeff as Megatron reads them: one value, or a list of
    types with one coefficient each (the losses added); a one-entry list is its entry. Coefficients become floats
    (the command line gives strings)."""
    types, coeffs = c.moe_router_load_balancing_type, c.moe_aux_loss_coeff
    types = list(types) if isinstance(types, (list, tuple)) else [types]
    try:
        coeffs = [float(v) for v in coeffs] if isinstance(coeffs, (list, tuple)) else [float(coeffs)]
    except (TypeError, ValueError):
        raise ConfigError(f"--moe-aux-loss-coeff expects numbers, got {c.moe_aux_loss_coeff!r}") from None
    for t in types:
        if t in _NOT_HERE:
            raise ConfigError(f"--moe-router-load-balancing-type {t}: {_NOT_HERE[t]}; use aux_loss, seq_aux_loss "
                              f"(or both, with one --moe-aux-loss-coeff each) or none")
        if t not in LOAD_BALANCING:
            raise ConfigError(f"--moe-router-load-balancing-type {t!r} is not one of {', '.join(LOAD_BALANCING)}")
    if len(set(types)) < len(types):
        raise ConfigError(f"--moe-router-load-balancing-type {' '.join(types)} names a type twice; give each once")
    if len(coeffs) != len(types) and (len(types) > 1 or len(coeffs) > 1):
        raise ConfigError(f"--moe-router-load-balancing-type {' '.join(types)} needs one --moe-aux-loss-coeff per "
                          f"type ({len(types)}), got {len(coeffs)}: {' '.join(map(str, coeffs))}")
    if any(v < 0 for v in coeffs):
        raise ConfigError(f"--moe-aux-loss-coeff must be >= 0, got {' '.join(map(str, coeffs))}")
    c.moe_router_load_balancing_type = types[0] if len(types) == 1 else types
    c.moe_aux_loss_coeff = coeffs[0] if len(coeffs) == 1 else coeffs


def balancing_losses(c) -> dict[str, float]:
    """``{'aux_loss' | 'seq_aux_loss': coefficient}`` of the load-balancing losses the router adds (coefficient
    > 0; 'none' adds nothing). A single type takes --moe-aux-loss-coeff; a list, its own entry of the list."""
    types, coeffs = c.moe_router_load_balancing_type, c.moe_aux_loss_coeff
    pairs = zip(types, coeffs) if isinstance(types, list) else [(types, coeffs)]
    return {t: float(v) for t, v in pairs if t != "none" and float(v) > 0}


def _check_extras(c) -> None:
    """Layer pattern, shared expert, capacity and router-score settings."""
    from omnitron.core.transformer.moe.pattern import moe_layer_pattern

    moe_layer_pattern(c.moe_layer_freq, c.num_layers)  # raises on a bad pattern
    shared = c.moe_shared_expert_intermediate_size
    if shared is not None and (not isinstance(shared, int) or shared < 1):
        raise ConfigError(f"--moe-shared-expert-intermediate-size must be a positive integer, got {shared!r}")
    f = c.moe_expert_capacity_factor
    if f is not None and f < 0:  # Megatron's TransformerConfig: a negative factor is dropless
        c.moe_expert_capacity_factor = f = None
    if f is not None and not f > 0:
        raise ConfigError(f"--moe-expert-capacity-factor must be > 0 (or negative / unset for dropless), got {f}")
    _check_choices(c)
    if c.moe_pad_expert_input_to_capacity and f is None:
        raise ConfigError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor (the capacity "
                          "to pad to); set it or drop the padding flag")
    if c.moe_router_dtype not in (None, "fp32"):
        raise ConfigError(f"--moe-router-dtype {c.moe_router_dtype}: omnitron routes in the model's dtype (the "
                          "flag unset, Megatron's default) or in float32 (fp32); drop the flag or give fp32")
    if c.moe_z_loss_coeff is not None and c.moe_z_loss_coeff < 0:
        raise ConfigError(f"--moe-z-loss-coeff must be >= 0, got {c.moe_z_loss_coeff}")
    _check_deepseek_routing(c)


def _check_deepseek_routing(c) -> None:
    """Group-limited top-k and the expert bias, as Megatron's TransformerConfig checks them."""
    if c.moe_router_enable_expert_bias and c.moe_router_score_function != "sigmoid":
        raise ConfigError("--moe-router-enable-expert-bias (auxiliary-loss-free balancing) needs sigmoid scores: "
                          "add --moe-router-score-function sigmoid or drop the flag")
    if c.moe_router_bias_update_rate < 0:
        raise ConfigError(f"--moe-router-bias-update-rate must be >= 0, got {c.moe_router_bias_update_rate}")
    g, gk, k, e = c.moe_router_num_groups, c.moe_router_group_topk, c.moe_router_topk, c.num_experts
    if gk is None:
        return
    if not g:
        raise ConfigError("--moe-router-group-topk needs --moe-router-num-groups (the number of expert groups)")
    if e % g:
        raise ConfigError(f"--num-experts {e} is not divisible by --moe-router-num-groups {g}; change one of them")
    if not 1 <= gk <= g:
        raise ConfigError(f"--moe-router-group-topk {gk} must be between 1 and --moe-router-num-groups {g}")
    if not gk <= k <= gk * (e // g):
        raise ConfigError(f"--moe-router-topk {k} must be between --moe-router-group-topk {gk} (each group is scored "
                          f"by its top topk // group-topk experts) and {gk} x the {e // g} experts of a group")


def check_router_trains(c) -> None:
    """Top-1 softmax routing after the pick gives every token the weight softmax([z]) = 1: the LM loss would send
    the router no gradient. Megatron's TransformerConfig refuses it; so does a training run here (an imported
    model that only runs keeps it: it computes the same)."""
    if c.moe_router_topk == 1 and c.moe_router_score_function == "softmax" and not c.moe_router_pre_softmax:
        raise ConfigError("--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax: the softmax over "
                          "the one picked logit is always 1, so the router would learn nothing from the LM loss; "
                          "add --moe-router-pre-softmax (as Megatron requires) or use --moe-router-topk > 1")


def _check_choices(c) -> None:
    """The choice flags, with or without experts: Megatron's parser takes them from TransformerConfig's
    ``Literal`` types as argparse choices, so a misspelt value stops a dense run too."""
    if c.moe_token_drop_policy not in DROP_POLICIES:
        raise ConfigError(f"--moe-token-drop-policy {c.moe_token_drop_policy!r} is not one of "
                          f"{', '.join(DROP_POLICIES)}")
    if c.moe_router_score_function not in SCORE_FUNCTIONS:
        raise ConfigError(f"--moe-router-score-function {c.moe_router_score_function!r} is not one of "
                          f"{', '.join(SCORE_FUNCTIONS)}")


def validate_moe(c, parallel: ParallelConfig) -> None:
    """The expert layout: ep divides the experts, expert tensor parallelism 1 or tp (and the choice flags, which
    a dense model's config does not check when it is built)."""
    _check_choices(c)
    ep, tp = parallel.expert_model_parallel_size, parallel.tensor_model_parallel_size
    if c.num_experts is None:
        if ep > 1:
            raise ConfigError(f"--expert-model-parallel-size {ep} needs an MoE model: set --num-experts "
                              f"(a multiple of {ep}) or use --expert-model-parallel-size 1")
        return
    if c.num_experts % ep:
        raise ConfigError(f"--num-experts {c.num_experts} is not divisible by --expert-model-parallel-size {ep}; "
                          f"each expert-parallel rank holds the same number of experts")
    etp = parallel.etp
    if etp not in (1, tp):
        raise ConfigError(f"--expert-tensor-parallel-size {etp} is neither 1 nor --tensor-model-parallel-size {tp}; "
                          f"experts are split like the dense MLP or not at all: pass 1 or {tp}")
    expert_ffn = c.moe_ffn_hidden_size or c.ffn_hidden_size or 4 * c.hidden_size
    if expert_ffn % etp:
        raise ConfigError(f"--moe-ffn-hidden-size {expert_ffn} is not divisible by --expert-tensor-parallel-size "
                          f"{etp}; change one of them")
    shared = c.moe_shared_expert_intermediate_size
    if shared is not None and shared % tp:
        raise ConfigError(f"--moe-shared-expert-intermediate-size {shared} is not divisible by "
                          f"--tensor-model-parallel-size {tp}; change one of them")
    # NOTE: no condition on --seq-length: under --sequence-parallel the layer gets the sequence's tp slices (which
    # validate_model requires to be even), without it each tp rank dispatches a padded slice of the tokens
    cp = parallel.context_parallel_size
    if cp > 1 and c.moe_expert_capacity_factor is not None:
        # NOTE: the capacity is decided over the whole micro-batch in token order; cp slices are not contiguous
        raise ConfigError(f"--moe-expert-capacity-factor with --context-parallel-size {cp} is not supported yet; "
                          f"drop the capacity factor (dropless) or use --context-parallel-size 1")
