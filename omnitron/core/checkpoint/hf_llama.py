"""Hugging Face Llama's conventions, the base the other architectures' conversions build on (:mod:`.hf` for
GPT-2 / Llama / Qwen2, :mod:`.hf_moe` for DeepSeek-V3, gpt-oss and Qwen3-MoE): the conversion error, config field
checks, Llama's (and Qwen2's: Llama with q/k/v biases) config fields both ways and its tensor rules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from omnitron.core.checkpoint.io import CheckpointError
from omnitron.core.transformer.qkv import fuse_qkv, split_qkv


class HFConversionError(CheckpointError):
    """A Hugging Face checkpoint or config omnitron cannot map (the message names the field)."""


_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""The Llama-3.1 rope-scaling constants omnitron's ``rope_inv_freq`` implements."""


def _need(hf: dict, field: str):
    if hf.get(field) is None:
        raise HFConversionError(f"config.json has no {field}, which a {hf.get('model_type')} config needs")
    return hf[field]


def _check(hf: dict, field: str, ok: Callable, why: str) -> None:
    if field in hf and hf[field] is not None and not ok(hf[field]):
        raise HFConversionError(f"config.json: {field}={hf[field]!r} is not supported: {why}")


def _rope(hf: dict) -> tuple[float, float]:
    """(rope theta, Llama-3.1 scaling factor) from ``rope_parameters`` (transformers 5) or
    ``rope_theta`` + ``rope_scaling`` (transformers 4)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), 1.0
    if kind != "llama3":
        raise HFConversionError(f"config.json: {field} rope_type {kind!r} is not supported; omnitron implements "
                                f"plain RoPE and Llama-3.1 scaling ('llama3')")
    for key, want in _LLAMA3_ROPE.items():
        if float(params.get(key, -1)) != want:
            raise HFConversionError(f"config.json: {field} {key}={params.get(key)!r} is not supported; omnitron's "
                                    f"Llama-3.1 rope scaling uses {key}={want}")
    return float(theta), float(params["factor"])


def _llama_fields(hf: dict, positions: int = 2048) -> dict:
    """GPTConfig fields of a Llama-style config.json; ``positions``: the model type's own default
    ``max_position_embeddings`` (transformers': Llama 2048, Qwen2 and Qwen3-MoE 32768), read where it is absent."""
    _check(hf, "hidden_act", lambda v: v == "silu", "omnitron's Llama MLP is SwiGLU (silu)")
    _check(hf, "partial_rotary_factor", lambda v: v == 1.0, "Llama rotates every channel")
    bias = bool(hf.get("attention_bias", False))
    if bool(hf.get("mlp_bias", False)) != bias:
        raise HFConversionError(f"config.json: attention_bias={bias} but mlp_bias={hf.get('mlp_bias')}: omnitron's "
                                f"--add-bias-linear puts biases on every linear layer or on none")
    h, heads = _need(hf, "hidden_size"), _need(hf, "num_attention_heads")
    head_dim, groups = hf.get("head_dim") or h // heads, hf.get("num_key_value_heads") or heads
    theta, factor = _rope(hf)
    n = hf.get("max_position_embeddings", positions)
    # defaults stay None (as a run's own flags leave them), so the checkpoint's shape check agrees
    return dict(num_layers=_need(hf, "num_hidden_layers"), hidden_size=h, num_attention_heads=heads,
                num_query_groups=None if groups == heads else groups,
                kv_channels=None if head_dim * heads == h else head_dim,
                ffn_hidden_size=_need(hf, "intermediate_size"), vocab_size=_need(hf, "vocab_size"),
                max_position_embeddings=n, seq_length=min(n, 4096), normalization="RMSNorm",
                layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
                swiglu=True, position_embedding_type="rope", rotary_base=theta, rope_scaling_factor=factor,
                untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
                hidden_dropout=0.0, attention_dropout=float(hf.get("attention_dropout", 0.0)),
                add_bias_linear=bias, init_method_std=hf.get("initializer_range", 0.02))


def _qwen2_fields(hf: dict) -> dict:
    """Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): Llama's maths with a bias on q/k/v only (o_proj and the MLP have
    none), i.e. Megatron's ``--disable-bias-linear --add-qkv-bias``."""
    # Qwen2Config has no attention_bias / mlp_bias: its q/k/v biases are fixed in the model
    return {**_llama_fields({**hf, "attention_bias": False, "mlp_bias": False}, positions=32768), "add_qkv_bias": True,
            **_qwen2_window(hf)}


def _qwen2_window(hf: dict) -> dict:
    """--window-size / --window-attn-skip-freq of Qwen2's sliding window: with ``use_sliding_window``, the layers
    that ``layer_types`` marks (else those from ``max_window_layers`` on, as transformers derives them) see keys
    i-W+1..i (``sliding_window`` W); the others, and every layer without ``use_sliding_window``, attend fully."""
    L = _need(hf, "num_hidden_layers")
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    types = hf.get("layer_types") or ["sliding_attention" if window and i >= hf.get("max_window_layers", 28)
                                      else "full_attention" for i in range(L)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != L:
        raise HFConversionError(f"config.json: layer_types must give one of full_attention / sliding_attention for "
                                f"each of the {L} layers; got {types!r:.120}")
    layers = [t == "sliding_attention" for t in types]
    if not any(layers):
        return {}
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise HFConversionError(f"config.json: layer_types marks sliding_attention layers but the window is "
                                f"{window!r} (use_sliding_window={hf.get('use_sliding_window')!r}, sliding_window="
                                f"{hf.get('sliding_window')!r}); set use_sliding_window true with a window >= 1")
    return dict(window_size=f"{window - 1},0",
                window_attn_skip_freq=None if all(layers) else "[" + ",".join(str(int(w)) for w in layers) + "]")


def _qwen2_window_config(cfg) -> dict:
    """Qwen2's window fields of ``cfg``: none windowed, or a bounded window on the last layers (Qwen2's
    ``max_window_layers`` form; ``layer_types`` written out too)."""
    from omnitron.core.transformer.window import parse_window, window_layers

    window = parse_window(cfg.window_size)
    if window is None:
        return dict(use_sliding_window=False, max_window_layers=cfg.num_layers)
    layers = [bool(w) for w in window_layers(cfg)]
    first = layers.index(True) if any(layers) else cfg.num_layers
    if window[0] < 0 or layers != [False] * first + [True] * (cfg.num_layers - first):
        raise HFConversionError("a Hugging Face Qwen2 model windows its layers from max_window_layers on, with a "
                                "bounded window; this model's --window-size / --window-attn-skip-freq differ")
    return dict(use_sliding_window=True, sliding_window=window[0] + 1, max_window_layers=first,
                layer_types=["sliding_attention" if w else "full_attention" for w in layers])


def _qwen2_config(cfg, dtype: str) -> dict:
    """The ``Qwen2ForCausalLM`` config.json of ``cfg`` (q/k/v biases, no other: see :func:`_qwen2_fields`)."""
    out = {k: v for k, v in _llama_config(cfg, dtype).items() if k not in ("attention_bias", "mlp_bias")}
    out.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", **_qwen2_window_config(cfg))
    return out


def _llama_config(cfg, dtype: str) -> dict:
    """The ``LlamaForCausalLM`` config.json of ``cfg`` (also the base of Qwen3-MoE's)."""
    from omnitron.core.models.gpt.config import ffn_size, head_dim, max_positions, query_groups

    out = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": cfg.num_layers,
           "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_attention_heads,
           "num_key_value_heads": query_groups(cfg), "head_dim": head_dim(cfg), "intermediate_size": ffn_size(cfg),
           "vocab_size": cfg.vocab_size, "max_position_embeddings": max_positions(cfg), "hidden_act": "silu",
           "rms_norm_eps": cfg.layernorm_epsilon, "rope_theta": cfg.rotary_base,
           "attention_bias": cfg.add_bias_linear, "mlp_bias": cfg.add_bias_linear,
           "attention_dropout": cfg.attention_dropout, "initializer_range": cfg.init_method_std,
           "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights, "torch_dtype": dtype}
    if cfg.rope_scaling_factor != 1.0:
        out["rope_scaling"] = dict(rope_type="llama3", factor=cfg.rope_scaling_factor, **_LLAMA3_ROPE)
    return out


@dataclass(frozen=True)
class Rule:
    """One omnitron tensor and the HF tensors it is made of: ``to_omni(*hf) -> omni`` and
    ``to_hf(omni) -> tuple of hf`` (inverse functions)."""

    omni: str
    hf: tuple[str, ...]
    to_omni: Callable = lambda t: t
    to_hf: Callable = lambda t: (t,)


def _half_rope_rows(t, d: int):
    """Rows of each ``d``-row head reordered from interleaved-pair RoPE (2i, 2i+1) to HF's halves (i, i+d/2)."""
    perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    return t.reshape(-1, d, *t.shape[1:])[:, perm].reshape(t.shape)


def _llama_rules(cfg) -> list[Rule]:
    from omnitron.core.models.gpt.config import head_dim, query_groups

    g, hq, d = query_groups(cfg), cfg.num_attention_heads, head_dim(cfg)
    rope_rows = (lambda t: _half_rope_rows(t, d)) if cfg.rotary_interleaved else (lambda t: t)
    rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
             Rule("decoder.final_layernorm.weight", ("model.norm.weight",))]
    if cfg.untie_embeddings_and_output_weights:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",)))
    kinds = ("weight", "bias") if cfg.add_bias_linear else ("weight",)
    qkv_kinds = ("weight", "bias") if cfg.add_bias_linear or getattr(cfg, "add_qkv_bias", False) else ("weight",)
    for i in range(cfg.num_layers):
        o, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        rules += [Rule(o + "input_layernorm.weight", (h + "input_layernorm.weight",)),
                  Rule(o + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",))]
        for k in qkv_kinds:  # a bias's rows are permuted as the weight's (RoPE rotates the biased q, k)
            def qkv_to_hf(t, k=k):
                q, kk, v = split_qkv(t, g, hq)
                return rope_rows(q), rope_rows(kk), v

            rules.append(Rule(o + "self_attention.linear_qkv." + k,
                              tuple(f"{h}self_attn.{p}_proj.{k}" for p in "qkv"),
                              lambda q, kk, v: fuse_qkv(q, kk, v, g), qkv_to_hf))
        for k in kinds:
            rules += [Rule(o + "self_attention.linear_proj." + k, (f"{h}self_attn.o_proj.{k}",)),
                      Rule(o + "mlp.linear_fc1." + k, (f"{h}mlp.gate_proj.{k}", f"{h}mlp.up_proj.{k}"),
                           lambda a, b: torch.cat([a, b], 0), lambda t: tuple(t.chunk(2, 0))),
                      Rule(o + "mlp.linear_fc2." + k, (f"{h}mlp.down_proj.{k}",))]
    return rules
