"""``--use-checkpoint-args``: the model's shape and tokenizer come from the checkpoint under ``--load``.

As Megatron: the checkpoint's architecture settings override the command line's (a launch line for
fine-tuning or evaluation needs only ``--load``), and each value that changes is said in the log. Training
choices (dropout, initialisation, recomputation, precision, loss coefficients) stay the command line's.
Only the checkpoint's ``metadata.json`` is read (JSON: nothing is unpickled).
"""
from __future__ import annotations

import logging
from typing import Any

from omnitron.core.config.parallel import ConfigError

log = logging.getLogger("omnitron.train")

_NOT_ARCHITECTURE = {"hidden_dropout", "attention_dropout", "init_method_std", "apply_scaled_init",
                     "recompute_granularity", "recompute_method", "recompute_num_layers", "params_dtype",
                     "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate", "vocab_size"}
_TOKENIZER = ("model_type", "tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size",
              "vocab_extra_ids", "tiktoken_pattern", "tiktoken_num_special_tokens", "tokenizer_special_tokens",
              "tokenizer_prompt_format", "image_tag_type")


def apply_checkpoint_args(merged: dict[str, Any]) -> dict[str, Any]:
    """``merged`` with the checkpoint's model and tokenizer settings when ``--use-checkpoint-args`` is on."""
    if not merged.pop("use_checkpoint_args", False):
        return merged
    from omnitron.core.checkpoint import CheckpointError
    from omnitron.core.checkpoint.io import find_latest, read_metadata

    load = merged.get("load")
    if not load:
        raise ConfigError("--use-checkpoint-args needs --load DIR (the checkpoint whose settings to use)")
    path = find_latest(load, quiet=True)
    if path is None:
        raise ConfigError(f"--use-checkpoint-args: no checkpoint under --load {load}")
    try:
        meta = read_metadata(path)
    except CheckpointError as err:
        raise ConfigError(f"--use-checkpoint-args: {err}") from None
    taken = {k: v for k, v in meta.get("model", {}).items() if k not in _NOT_ARCHITECTURE}
    flat = meta.get("config", {})
    taken.update({k: flat[k] for k in _TOKENIZER if flat.get(k) is not None})
    changed = [k for k, v in taken.items() if k in merged and merged[k] != v]
    out = {**merged, **taken}
    log.info("--use-checkpoint-args: model and tokenizer settings from %s%s", path,
             f" (replacing the command line's {', '.join('--' + k.replace('_', '-') for k in changed)})"
             if changed else "")
    return out
