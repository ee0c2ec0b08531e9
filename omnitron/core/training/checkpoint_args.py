"""``--use-checkpoint-args``: the model's shape and tokenizer come from the checkpoint under ``--load`` that the
run resumes (:func:`_resumed`: with ``--non-persistent-ckpt-type global``, the non-persistent one when it is at least
as new, as Megatron's load_args_from_checkpoint through _load_base_checkpoint).

As Megatron: the checkpoint's architecture settings override the command line's (a launch line for
fine-tuning or evaluation needs only ``--load``), and each value that changes is said in the log. Training
choices (dropout, initialisation, recomputation, precision, loss coefficients) stay the command line's.
Only the checkpoint's ``metadata.json`` is read (JSON: nothing is unpickled).

Without the flag, ``--load`` compares the same architecture settings with the command line's and refuses a
difference (:func:`omnitron.core.training.model_check.check_model_settings`, called where the checkpoint's
shapes are checked).
"""
from __future__ import annotations

import logging
from typing import Any

from omnitron.core.config.parallel import ConfigError

log = logging.getLogger("omnitron.train")

NOT_ARCHITECTURE = frozenset({
    "hidden_dropout", "attention_dropout", "init_method_std", "apply_scaled_init",  # regularisation, new weights
    "recompute_granularity", "recompute_method", "recompute_num_layers",  # memory
    "params_dtype", "moe_router_dtype",  # precision
    "cpu_offloading", "cpu_offloading_num_layers", "fine_grained_activation_offloading", "offload_modules",
    "min_offloaded_tensor_size", "cpu_offloading_activations", "cpu_offloading_weights",  # offloading
    "cpu_offloading_retain_pinned_cpu_buffers",
    "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_load_balancing_type", "moe_router_bias_update_rate",
    "mtp_loss_scaling_factor",  # losses and balancing
    "moe_grouped_gemm", "moe_shared_expert_overlap", "moe_expert_capacity_factor", "moe_token_drop_policy",
    "moe_pad_expert_input_to_capacity",  # how the experts run (Megatron's checkpoint args leave them too)
    "freeze_vision_model", "freeze_language_model", "vocab_size"})
"""Model config fields that are the run's choices, not the model's (the rest of every family's config is the
architecture): a checkpoint's values of these neither replace the command line's (--use-checkpoint-args) nor
have to match it on --load (:func:`omnitron.core.training.model_check.check_model_settings`)."""
LENGTHS = ("seq_length", "encoder_seq_length", "decoder_seq_length")
"""The sequence lengths: taken by --use-checkpoint-args (as Megatron's) but free on --load (no weight or
function depends on them; the learned position table's size is --max-position-embeddings)."""
_TOKENIZER = ("model_type", "tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size",
              "vocab_extra_ids", "tiktoken_pattern", "tiktoken_num_special_tokens", "tokenizer_special_tokens",
              "tokenizer_prompt_format", "image_tag_type", "tokenizer_hf_no_include_special_tokens")


UNFLAGGED = ("moe_router_bias",)
"""Model fields no flag sets (a preset may): a run loading a checkpoint takes the checkpoint's value when its own
command line leaves them unset (a checkpoint written before the router bias followed --add-bias-linear holds
False, and its routers no bias)."""


def saved_position_type(model: dict[str, Any]) -> Any:
    """A checkpoint's --position-embedding-type as this omnitron spells it: ``yarn`` where one written before that
    spelling was taken holds ``rope`` with --rotary-scaling-factor above 1 and no MLA (omnitron then ran YaRN)."""
    kind = model.get("position_embedding_type")
    old_yarn = not model.get("multi_latent_attention") and model.get("rotary_scaling_factor", 1.0) != 1.0
    return "yarn" if kind == "rope" and old_yarn else kind


def apply_checkpoint_args(merged: dict[str, Any]) -> dict[str, Any]:
    """``merged`` with the checkpoint's model and tokenizer settings when ``--use-checkpoint-args`` is on (else
    with the checkpoint's :data:`UNFLAGGED` fields the run leaves unset)."""
    if not merged.pop("use_checkpoint_args", False):
        return _keep_unflagged(merged)
    from omnitron.core.checkpoint import CheckpointError
    from omnitron.core.checkpoint.io import read_metadata

    load = merged.get("load")
    if not load:
        raise ConfigError("--use-checkpoint-args needs --load DIR (the checkpoint whose settings to use)")
    path = _resumed(merged)
    if path is None:
        raise ConfigError(f"--use-checkpoint-args: no checkpoint under --load {load}")
    try:
        meta = read_metadata(path)
    except CheckpointError as err:
        raise ConfigError(f"--use-checkpoint-args: {err}") from None
    taken = {k: v for k, v in meta.get("model", {}).items() if k not in NOT_ARCHITECTURE}
    if "position_embedding_type" in taken:
        taken["position_embedding_type"] = saved_position_type(taken)
    flat = meta.get("config", {})
    taken.update({k: flat[k] for k in _TOKENIZER if flat.get(k) is not None})
    changed = [k for k, v in taken.items() if k in merged and merged[k] != v]
    out = {**merged, **taken}
    log.info("--use-checkpoint-args: model and tokenizer settings from %s%s", path,
             f" (replacing the command line's {', '.join('--' + k.replace('_', '-') for k in changed)})"
             if changed else "")
    return out


def _keep_unflagged(merged: dict[str, Any]) -> dict[str, Any]:
    """``merged`` plus the :data:`UNFLAGGED` model fields of the checkpoint under ``--load``, where it sets none
    (no checkpoint, or one that cannot be read: unchanged, the resume check reports it)."""
    unset = [k for k in UNFLAGGED if merged.get(k) is None]
    if not (merged.get("load") and merged.get("num_experts") and unset):  # (all of them MoE settings)
        return merged
    from omnitron.core.checkpoint import CheckpointError
    from omnitron.core.checkpoint.io import read_metadata

    try:
        path = _resumed(merged)
        saved = read_metadata(path).get("model", {}) if path else {}
    except CheckpointError:
        return merged
    return {**merged, **{k: saved[k] for k in unset if saved.get(k) is not None}}


def _resumed(merged: dict[str, Any]) -> str | None:
    """The checkpoint the run will load (:func:`~omnitron.core.training.resume_choice.resume_path`), from the flat
    settings: its args are the ones to read, not those of ``--load``'s latest when the non-persistent one wins."""
    from types import SimpleNamespace

    from omnitron.core.training.resume_choice import resume_path

    keys = ("load", "ckpt_step", "non_persistent_ckpt_type", "non_persistent_global_ckpt_dir")
    return resume_path(SimpleNamespace(**{k: merged.get(k) for k in keys}), quiet=True)
