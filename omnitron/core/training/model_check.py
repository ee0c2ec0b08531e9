"""``--load``'s check of the model settings no weight shape shows (window, softmax, RoPE, norm epsilon, activation,
routing...): a checkpoint's model and the run's must compute alike (:func:`check_model_settings`). Apart from
:mod:`omnitron.core.training.checkpoint_args` because it reads the command line's flags (the parser's own table),
which that module's caller builds."""
from __future__ import annotations

import shlex
from typing import Any

from omnitron.core.training.checkpoint_args import LENGTHS, NOT_ARCHITECTURE, saved_position_type

_POSITION_PREFIXES = ("rotary_", "rope_", "yarn_", "mscale", "position_embedding_type")
"""The position encoding's settings: a --finetune may change them (context extension: a larger RoPE base or a
scaling added to a trained model), so there they are reported, not refused."""


def check_model_settings(saved: dict[str, Any], now: dict[str, Any], path: str, *,
                         finetune: bool = False) -> list[str]:
    """Before any weight loads (resume or --finetune): CheckpointError in one line when this run's model (``now``,
    its config as a dict) computes otherwise than the checkpoint's (``saved``, its metadata ``model``) in a setting
    no weight shape shows (window, softmax, RoPE, norm epsilon, activation, routing...). Every architecture field
    (all but :data:`NOT_ARCHITECTURE` and the lengths) that either model reads (:func:`_reads`) is compared as
    the model uses it (:func:`_canonical`); each difference is named with both values, then the flags that give
    the checkpoint's. Megatron's check_checkpoint_args compares the shape only. A checkpoint older than a field
    holds its default. Under ``finetune`` (--finetune, or a weights-only checkpoint) the position encoding's
    settings may differ (context extension): returned as lines to log, not refused."""
    from omnitron.core.training.arguments import options, setting_words

    opts = options()
    keys = [k for k in now if k in opts and k not in NOT_ARCHITECTURE and k not in LENGTHS]
    defaults = {k: opts[k].default for k in keys}
    old = {**defaults, **{k: v for k, v in saved.items() if k in defaults}}
    differ = [k for k in keys if (_reads(old, k) or _reads(now, k)) and _canonical(old, k) != _canonical(now, k)]
    extended = [k for k in differ if finetune and k.startswith(_POSITION_PREFIXES)]
    notes = [f"--load {path}: finetuning with {opts[k].flag} {_shown(now[k])} (the checkpoint's: {_shown(old[k])}), "
             f"a change of the position encoding" for k in extended]
    differ = [k for k in differ if k not in extended]
    if not differ:
        return notes
    from omnitron.core.checkpoint import CheckpointError

    shown = "; ".join(f"{opts[k].flag} checkpoint {_shown(old[k])}, this run {_shown(now[k])}" for k in differ)
    give = setting_words({k: old[k] for k in differ if old[k] not in (None, defaults[k])})
    drop = [opts[k].flag for k in differ if old[k] == defaults[k]]  # the checkpoint's value is the default
    none = [opts[k].flag for k in differ if old[k] is None and defaults[k] is not None]
    fix = "; ".join(p for p in (f"give {shlex.join(give)}" if give else "", f"drop {' '.join(drop)}" if drop else "",
                                f"set {', '.join(none)} to null in a --config file" if none else "") if p)
    raise CheckpointError(f"--load {path}: the checkpoint's model differs from this run's where no weight shape "
                          f"shows it: {shown}; train with the checkpoint's settings ({fix}) or --use-checkpoint-args")


def _shown(value: Any) -> str:
    return "none" if value is None else str(value)


def _reads(model: dict[str, Any], key: str) -> bool:
    """Whether a model of settings ``model`` reads setting ``key``: not the experts' settings of a dense model,
    MLA's widths of another attention, YaRN's without its scaling, RoPE's without RoPE, the skip pattern without a
    window, the GeLU fusion without the biased GeLU (a difference there changes nothing)."""
    kind = model.get("position_embedding_type")
    mla, rope = bool(model.get("multi_latent_attention")), kind in ("rope", "yarn")
    plain_rope = model.get("rotary_scaling_factor", 1.0) == 1.0 or not (mla or kind == "yarn")
    unread = {"moe_": not model.get("num_experts"), "yarn_": plain_rope, "mscale": plain_rope,
              "rotary_": not (rope or mla), "rope_": not (rope or mla),
              "window_attn_skip_freq": model.get("window_size") is None,
              "bias_gelu_fusion": bool(model.get("swiglu") or model.get("squared_relu"))
              or not model.get("add_bias_linear", True)}
    return not (any(key.startswith(p) and off for p, off in unread.items()) or (key in _MLA_ONLY and not mla))


def _canonical(model: dict[str, Any], key: str) -> Any:
    """Setting ``key`` of ``model`` as the model uses it: a per-layer pattern as its list (``2`` and ``[1,0,1,0]``
    are one; the skip pattern as if a window were set), a window as its pair, YaRN's defaults for its Nones, an
    older checkpoint's spelling of YaRN as ``yarn``."""
    from omnitron.core.transformer.yarn import BETA_FAST, BETA_SLOW, ORIGINAL_MAX_POSITIONS

    v = model.get(key)
    if key == "moe_layer_freq":
        from omnitron.core.transformer.moe.pattern import moe_layer_pattern

        return moe_layer_pattern(v, model["num_layers"])
    if key in ("window_size", "window_attn_skip_freq"):
        from types import SimpleNamespace

        from omnitron.core.transformer.window import parse_window, window_layers

        return parse_window(v) if key == "window_size" else window_layers(
            SimpleNamespace(window_size="0,0", window_attn_skip_freq=v, num_layers=model["num_layers"]))
    if key == "position_embedding_type":
        return saved_position_type(model)
    defaults = {"yarn_beta_fast": BETA_FAST, "yarn_beta_slow": BETA_SLOW, "moe_router_topk_scaling_factor": 1.0,
                "yarn_original_max_position_embeddings": ORIGINAL_MAX_POSITIONS}
    return defaults.get(key) if v is None else v


_MLA_ONLY = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
"""Multi-latent attention's own widths (read only with --multi-latent-attention)."""
