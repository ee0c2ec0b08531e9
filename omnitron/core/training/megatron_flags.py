"""Megatron-LM flags with no field of their own, so that a Megatron launch script runs unchanged.

Two kinds:

* **aliases** onto omnitron's settings (``--use-rotary-position-embeddings`` is
  ``--position-embedding-type rope``; ``--recompute-activations`` is ``--recompute-granularity selective``;
  ``--tensorboard-dir D`` is ``--log-dir D``; ``--lr-warmup-fraction F`` sets the warm-up to ``F`` of the
  decay iterations, as Megatron does; ``--group-query-attention`` asks for ``--num-query-groups``);
* **implementation selectors** (``--use-flash-attn``, ``--transformer-impl``, ``--no-masked-softmax-fusion``,
  ...): omnitron picks the fused kernel per backend itself (``omnitron info`` lists them), so these are
  accepted and each says in one line what runs instead.

:func:`add_megatron_flags` puts them in their own help group; :func:`translate` turns the given values
into omnitron's (called on command-line and config-file settings alike) and returns the lines to log.
A contradiction (an alias against the setting it stands for) is a :class:`ConfigError` naming both.
"""
from __future__ import annotations

import argparse
from typing import Any

from omnitron.core.config.parallel import ConfigError

_KERNELS = "the backend's kernel table picks the fused kernels (see `omnitron info`)"
SELECTORS: dict[str, tuple[str | None, str]] = {
    # dest: (metavar for a flag with a value, or None for a switch; what runs instead)
    "use_flash_attn": (None, "attention runs the backend's fused attention where it has one"),
    "attention_backend": ("NAME", "attention runs the backend's fused attention where it has one"),
    "transformer_impl": ("NAME", "omnitron's own transformer layers run (no Transformer Engine binding)"),
    "use_mcore_models": (None, "omnitron's models are Megatron-Core's layout already"),
    "no_masked_softmax_fusion": (None, _KERNELS),
    "no_bias_gelu_fusion": (None, _KERNELS),
    "no_bias_swiglu_fusion": (None, _KERNELS),
    "no_bias_dropout_fusion": (None, _KERNELS),
    "no_rope_fusion": (None, _KERNELS),
    "no_persist_layer_norm": (None, _KERNELS),
    "no_gradient_accumulation_fusion": (None, "gradients accumulate into the fp32 main_grad buffers as always"),
    "attention_softmax_in_fp32": (None, "the softmax is computed in fp32 always"),
}
ALIASES: dict[str, tuple[str, dict]] = {
    # dest: (help, argparse keywords)
    "group_query_attention": ("with --num-query-groups N: grouped-query attention (omnitron reads "
                              "--num-query-groups alone too)", {"action": "store_true"}),
    "use_rotary_position_embeddings": ("same as --position-embedding-type rope", {"action": "store_true"}),
    "recompute_activations": ("same as --recompute-granularity selective", {"action": "store_true"}),
    "tensorboard_dir": ("same as --log-dir DIR (TensorBoard events and metrics.jsonl)", {"metavar": "DIR"}),
    "lr_warmup_fraction": ("warm up over this fraction of --lr-decay-iters (else --train-iters), as Megatron",
                           {"type": float, "metavar": "F"}),
    "exit_signal_handler": ("SIGTERM / SIGINT finish the step, save and exit (on by default: --no-save-on-signal "
                            "turns it off)", {"action": "store_true"}),
}
KEYS = frozenset(SELECTORS) | frozenset(ALIASES)
"""Setting names these flags add (also accepted as config-file keys)."""


def add_megatron_flags(parser: argparse.ArgumentParser) -> None:
    """Add every flag of this module to ``parser`` (defaults suppressed, as for the other flags)."""
    group = parser.add_argument_group("Megatron compatibility (accepted so that Megatron scripts run)")
    for dest, (metavar, instead) in SELECTORS.items():
        flag = "--" + dest.replace("_", "-")
        if metavar is None:
            group.add_argument(flag, dest=dest, action="store_true", help=f"accepted: {instead}")
        else:
            group.add_argument(flag, dest=dest, metavar=metavar, help=f"accepted: {instead}")
    for dest, (text, kwargs) in ALIASES.items():
        group.add_argument("--" + dest.replace("_", "-"), dest=dest, help=text, **kwargs)


def translate(given: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``given`` with this module's settings replaced by omnitron's; and one line per selector to log."""
    out = {k: v for k, v in given.items() if k not in KEYS}
    notes = [f"--{k.replace('_', '-')}: accepted; {SELECTORS[k][1]}" for k in SELECTORS if given.get(k)]
    if given.get("group_query_attention") and not given.get("num_query_groups"):
        raise ConfigError("--group-query-attention needs --num-query-groups N (the key/value heads)")
    _alias(out, given, "use_rotary_position_embeddings", "position_embedding_type", "rope")
    _alias(out, given, "recompute_activations", "recompute_granularity", "selective")
    _alias(out, given, "exit_signal_handler", "save_on_signal", True)
    if given.get("tensorboard_dir"):
        _alias(out, given, "tensorboard_dir", "log_dir", given["tensorboard_dir"])
        out.setdefault("tensorboard", True)
    if "lr_warmup_fraction" in given:  # resolved on the merged settings: the iterations may come from elsewhere
        out["lr_warmup_fraction"] = given["lr_warmup_fraction"]
    return out, notes


def resolve_warmup_fraction(merged: dict[str, Any]) -> dict[str, Any]:
    """``--lr-warmup-fraction F`` as warm-up iterations of the merged settings (preset, file and flags)."""
    fraction = merged.pop("lr_warmup_fraction", None)
    if fraction is None:
        return merged
    if not 0.0 <= fraction <= 1.0:
        raise ConfigError(f"--lr-warmup-fraction must lie in [0, 1], got {fraction}")
    if merged.get("lr_warmup_iters"):
        raise ConfigError("give --lr-warmup-fraction or --lr-warmup-iters, not both")
    from omnitron.core.config.training import TrainingConfig

    decay = merged.get("lr_decay_iters") or merged.get("train_iters") or TrainingConfig.train_iters
    merged["lr_warmup_iters"] = int(fraction * decay)  # Megatron: lr_warmup_steps = fraction * lr_decay_steps
    return merged


def _alias(out: dict, given: dict, key: str, target: str, value: Any) -> None:
    if not given.get(key):
        return
    if given.get(target) not in (None, value):
        raise ConfigError(f"--{key.replace('_', '-')} means --{target.replace('_', '-')} {value}, but "
                          f"--{target.replace('_', '-')} {given[target]} was given: drop one of them")
    out[target] = value
