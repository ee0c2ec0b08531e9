"""Hugging Face DeepSeek-V3 (``DeepseekV3ForCausalLM``) and gpt-oss (``GptOssForCausalLM``) layouts: their
``config.json`` to and from :class:`GPTConfig`, and their tensors as :class:`~omnitron.core.checkpoint.hf.Rule`
lists (used by :mod:`omnitron.core.checkpoint.hf`).

DeepSeek-V3: MLA's projections map one to one (``q_a_proj`` / ``q_b_proj`` / ``kv_a_proj_with_mqa`` /
``kv_b_proj``: the rows per head are ``[nope | rope]`` and ``[k_nope | v]`` in both; HF's
``rope_interleave`` rotates the same channel pairs omnitron does); experts are saved per expert
(``mlp.experts.{e}.gate_proj``), the gate and up halves of ``linear_fc1``. The routing bias
``e_score_correction_bias`` is a buffer in both models, omnitron's ``expert_bias``: it travels both ways (the
export writes zeros where a checkpoint holds none). The MTP layers (``num_nextn_predict_layers``) are HF's
layers ``num_hidden_layers + d``, which transformers itself does not build (nor save: a config naming MTP layers
whose weights are absent imports the main model, with a note). What transformers computes otherwise than omnitron
is mapped exactly or refused: at top-1 ``norm_topk_prob`` false is omnitron's raw-score weight (true, a constant
weight, is refused); the latent norms' eps is fixed at 1e-6 in transformers (another ``rms_norm_eps`` is refused,
another --norm-epsilon exported with a warning); ``n_shared_experts`` 0 is saved as zero-size tensors; the gate
stays float32 on export, as transformers keeps it. YaRN: :mod:`.hf_yarn`.

gpt-oss: q/k/v and their biases fuse as Llama's; ``sinks`` are the attention's ``softmax_offset``; the experts
are stacked ``gate_up_proj [E, h, 2f]`` with gate and up in alternating columns (``::2`` gate, ``1::2`` up),
``down_proj [E, f, h]``, each with a bias; the router has a bias. YaRN RoPE maps to --rotary-scaling-factor and
its settings (HF's ``truncate`` is --yarn-correction-range-round-to-int).
"""
from __future__ import annotations

import dataclasses

import torch

from omnitron.core.checkpoint.hf_llama import (HFConversionError, Rule, _check, _llama_config, _llama_fields,
                                               _llama_rules, _need)
from omnitron.core.checkpoint.hf_yarn import _gqa_rope, _rope_kind, _yarn_rope, _yarn_to_hf
from omnitron.core.models.gpt.config import router_bias
from omnitron.core.transformer.shapes import ffn_size


# ---- config ----------------------------------------------------------------------------------
def deepseek_fields(hf: dict) -> dict:
    """GPTConfig fields of a ``deepseek_v3`` config.json."""
    _check(hf, "hidden_act", lambda v: v == "silu", "DeepSeek-V3's MLPs are SwiGLU (silu)")
    _check(hf, "attention_bias", lambda v: not v, "omnitron's MLA has no projection biases")
    _check(hf, "rope_interleave", bool, "omnitron's MLA rotates interleaved channel pairs")
    _check(hf, "rms_norm_eps", lambda v: float(v) == 1e-6, "transformers builds DeepSeek-V3's latent norms "
           "(q_a_layernorm, kv_a_layernorm) with eps 1e-6 whatever rms_norm_eps says, omnitron (as Megatron) every "
           "norm with --norm-epsilon; only rms_norm_eps 1e-6 gives transformers' model")
    L, k = _need(hf, "num_hidden_layers"), int(hf.get("first_k_dense_replace", 0))
    groups, group_topk, topk = hf.get("n_group") or 1, hf.get("topk_group") or 1, _need(hf, "num_experts_per_tok")
    _check_topk_norm(hf, topk)
    if groups > 1 and topk // group_topk != 2:
        raise HFConversionError(f"config.json: num_experts_per_tok={topk} / topk_group={group_topk}: Hugging Face "
                                "scores a group by its best 2 experts, omnitron (as Megatron) by its best "
                                "topk / group-topk; they agree only when that is 2")
    shared = hf.get("n_shared_experts") or 0
    scale = float(hf.get("routed_scaling_factor", 1.0))
    out = dict(num_layers=L, hidden_size=_need(hf, "hidden_size"), num_attention_heads=_need(hf, "num_attention_heads"),
               ffn_hidden_size=_need(hf, "intermediate_size"), vocab_size=_need(hf, "vocab_size"),
               max_position_embeddings=hf.get("max_position_embeddings", 4096),
               seq_length=min(hf.get("max_position_embeddings", 4096), 4096), normalization="RMSNorm",
               layernorm_epsilon=hf.get("rms_norm_eps", 1e-6), swiglu=True, position_embedding_type="rope",
               untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False), hidden_dropout=0.0,
               attention_dropout=float(hf.get("attention_dropout", 0.0)), add_bias_linear=False,
               init_method_std=hf.get("initializer_range", 0.02), multi_latent_attention=True, qk_layernorm=True,
               q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=_need(hf, "kv_lora_rank"),
               qk_head_dim=_need(hf, "qk_nope_head_dim"), qk_pos_emb_head_dim=_need(hf, "qk_rope_head_dim"),
               v_head_dim=_need(hf, "v_head_dim"), num_experts=_need(hf, "n_routed_experts"), moe_router_topk=topk,
               moe_ffn_hidden_size=_need(hf, "moe_intermediate_size"),
               moe_shared_expert_intermediate_size=shared * hf["moe_intermediate_size"] if shared else None,
               moe_layer_freq=f"[0]*{k}+[1]*{L - k}", moe_router_score_function="sigmoid",
               moe_router_enable_expert_bias=True, moe_router_num_groups=groups if groups > 1 else None,
               moe_router_group_topk=group_topk if groups > 1 else None,
               moe_router_topk_scaling_factor=None if scale == 1.0 else scale,
               mtp_num_layers=hf.get("num_nextn_predict_layers") or None)
    out.update(_yarn_rope(hf))
    return out


def _check_topk_norm(hf: dict, topk: int) -> None:
    """transformers divides the picked sigmoid scores by their sum whenever ``norm_topk_prob`` (DeepseekV3Config's
    default: true), omnitron (as Megatron) only for k > 1: a single pick keeps its raw score. So k > 1 needs
    ``norm_topk_prob`` true and top-1 false (at top-1, true weights the pick by routed_scaling_factor alone)."""
    norm = bool(hf.get("norm_topk_prob", True))
    if norm != (topk > 1):
        why = ("omnitron (as Megatron) normalises k > 1 picked sigmoid scores to sum 1" if topk > 1 else
               "transformers then weights the one pick by routed_scaling_factor alone, omnitron's sigmoid router (as "
               "Megatron) by its score, which is norm_topk_prob=false; no omnitron router weights a pick by a constant")
        raise HFConversionError(f"config.json: norm_topk_prob={norm} with num_experts_per_tok={topk} is not "
                                f"supported: {why}")


def gpt_oss_fields(hf: dict) -> dict:
    """GPTConfig fields of a ``gpt_oss`` config.json."""
    _check(hf, "attention_bias", bool, "gpt-oss's experts carry biases, and omnitron puts biases on every linear "
                                       "(--add-bias-linear) or on none")
    _check(hf, "swiglu_alpha", lambda v: float(v) == 1.702, "omnitron's quick GeGLU uses alpha 1.702")
    L = _need(hf, "num_hidden_layers")
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]
    window = hf.get("sliding_window")
    n = hf.get("max_position_embeddings", 131072)  # GptOssConfig's default
    return dict(num_layers=L, hidden_size=_need(hf, "hidden_size"),
                num_attention_heads=_need(hf, "num_attention_heads"),
                num_query_groups=_need(hf, "num_key_value_heads"), kv_channels=_need(hf, "head_dim"),
                ffn_hidden_size=_need(hf, "intermediate_size"), moe_ffn_hidden_size=hf["intermediate_size"],
                vocab_size=_need(hf, "vocab_size"), max_position_embeddings=n, seq_length=min(n, 4096),
                normalization="RMSNorm", layernorm_epsilon=hf.get("rms_norm_eps", 1e-5), swiglu=True,
                **_gqa_rope(hf),
                untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False), hidden_dropout=0.0,
                attention_dropout=float(hf.get("attention_dropout", 0.0)), add_bias_linear=True,
                init_method_std=hf.get("initializer_range", 0.02), num_experts=_need(hf, "num_local_experts"),
                moe_router_topk=_need(hf, "num_experts_per_tok"), moe_router_bias=True,
                window_size=None if not window else f"{window - 1},0",
                window_attn_skip_freq=None if not window else
                "[" + ",".join("1" if t == "sliding_attention" else "0" for t in types) + "]",
                softmax_type="learnable", quick_geglu=True, glu_linear_offset=1.0,
                activation_func_clamp_value=float(hf.get("swiglu_limit", 7.0)))


def qwen3_moe_fields(hf: dict) -> dict:
    """GPTConfig fields of a ``qwen3_moe`` config.json (Llama's attention with QK-norm, softmax-routed experts;
    plain, Llama-3.1 or YaRN RoPE, the last as gpt-oss's)."""
    _check(hf, "attention_bias", lambda v: not v, "Qwen3-MoE then biases q, k, v and o_proj but not its MLPs; "
                                                  "omnitron biases every linear (--add-bias-linear) or q, k and v "
                                                  "only (--add-qkv-bias)")
    kind = _rope_kind(hf)[1]
    if kind not in ("default", "llama3", "yarn"):
        raise HFConversionError(f"config.json: rope_type {kind!r} is not supported; omnitron implements plain RoPE, "
                                "Llama-3.1 ('llama3') and YaRN ('yarn') for Qwen3-MoE")
    yarn = kind == "yarn"
    out = _llama_fields({k: v for k, v in hf.items() if not (yarn and k in ("rope_parameters", "rope_scaling"))},
                        positions=32768)  # Qwen3MoeConfig's default
    if yarn:
        out.update(_gqa_rope(hf))
    L, step = out["num_layers"], int(hf.get("decoder_sparse_step", 1))
    dense = set(hf.get("mlp_only_layers") or [])
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(L)]
    experts = hf.get("num_experts") or hf.get("num_local_experts")  # transformers 5 writes the latter
    if not experts:
        raise HFConversionError("config.json has no num_experts, which a qwen3_moe config needs")
    out.update(qk_layernorm=True, num_experts=experts, moe_router_topk=_need(hf, "num_experts_per_tok"),
               moe_ffn_hidden_size=_need(hf, "moe_intermediate_size"),
               moe_layer_freq="[" + ",".join(map(str, pattern)) + "]",  # one shell word
               moe_router_pre_softmax=not hf.get("norm_topk_prob", False))
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    if window:  # transformers 5 windows every layer (max_window_layers is no longer read): keys i-W+1..i
        out.update(window_size=f"{window - 1},0")  # every layer (no --window-attn-skip-freq)
    return out


def qwen3_moe_to_hf(cfg, dtype: str) -> dict:
    """The ``config.json`` of a Qwen3-MoE-layout ``cfg`` (Llama's fields plus QK-norm and the experts)."""
    from omnitron.core.transformer.moe.pattern import moe_layer_pattern

    if cfg.moe_shared_expert_intermediate_size or cfg.moe_router_score_function != "softmax" or \
            cfg.moe_router_group_topk or cfg.moe_router_topk_scaling_factor or router_bias(cfg):
        raise HFConversionError("a Hugging Face Qwen3-MoE model routes on a softmax without groups, scaling, bias or "
                                "shared experts; this model differs")
    pattern = moe_layer_pattern(cfg.moe_layer_freq, cfg.num_layers)
    out = _llama_config(cfg, dtype)
    window = _all_layer_window(cfg)
    out.update(use_sliding_window=window is not None, sliding_window=window, max_window_layers=cfg.num_layers)
    out.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=cfg.num_experts,
               num_experts_per_tok=cfg.moe_router_topk, moe_intermediate_size=cfg.moe_ffn_hidden_size or ffn_size(cfg),
               norm_topk_prob=not cfg.moe_router_pre_softmax, decoder_sparse_step=1,
               mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe])
    out.pop("mlp_bias", None)
    if cfg.rotary_scaling_factor != 1.0:
        out["rope_parameters"] = _yarn_to_hf(cfg)
    return out


def _all_layer_window(cfg) -> int | None:
    """HF's ``sliding_window`` (keys ``i-W+1..i``) of a model windowed on every layer, None without a window;
    another pattern has no Qwen3-MoE form."""
    from omnitron.core.transformer.window import parse_window, window_layers

    window = parse_window(cfg.window_size)
    if window is None:
        return None
    if not all(window_layers(cfg)) or window[0] < 0:
        raise HFConversionError("a Hugging Face Qwen3-MoE model windows every layer or none, with a bounded "
                                "window; give --window-attn-skip-freq with every layer windowed")
    return window[0] + 1


def qwen3_moe_rules(cfg) -> list[Rule]:
    """Llama's rules for attention (plus ``q_norm`` / ``k_norm``) and dense layers; MoE layers' router and
    per-expert SwiGLU."""
    from omnitron.core.transformer.moe.pattern import is_moe_layer

    moe = {i for i in range(cfg.num_layers) if is_moe_layer(cfg, i)}
    rules = [r for r in _llama_rules(cfg) if not any(r.omni.startswith(f"decoder.layers.{i}.mlp.") for i in moe)]
    for i in range(cfg.num_layers):
        o, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        rules += [Rule(o + "self_attention.q_layernorm.weight", (h + "self_attn.q_norm.weight",)),
                  Rule(o + "self_attention.k_layernorm.weight", (h + "self_attn.k_norm.weight",))]
        if i in moe:
            rules.append(Rule(o + "mlp.router.weight", (h + "mlp.gate.weight",)))
            for e in range(cfg.num_experts):
                rules += _swiglu_mlp(f"{o}mlp.experts.{e}.", f"{h}mlp.experts.{e}.")
    return rules


def deepseek_to_hf(cfg, dtype: str) -> dict:
    """The ``config.json`` of a DeepSeek-V3-layout ``cfg``."""
    from omnitron.core.transformer.moe.pattern import moe_layer_pattern

    pattern = moe_layer_pattern(cfg.moe_layer_freq, cfg.num_layers)
    k = pattern.index(True) if True in pattern else cfg.num_layers
    if pattern != [False] * k + [True] * (cfg.num_layers - k) or not cfg.qk_layernorm or cfg.add_bias_linear:
        raise HFConversionError("a Hugging Face DeepSeek-V3 model has dense layers first then MoE layers "
                                "(--moe-layer-freq), latent norms (--qk-layernorm) and no biases; this model differs")
    if cfg.moe_router_score_function != "sigmoid":
        raise HFConversionError("a Hugging Face DeepSeek-V3 model routes on sigmoid scores; give "
                                "--moe-router-score-function sigmoid")
    shared = cfg.moe_shared_expert_intermediate_size
    if shared and shared % cfg.moe_ffn_hidden_size:
        raise HFConversionError(f"--moe-shared-expert-intermediate-size {shared} is not a multiple of "
                                f"--moe-ffn-hidden-size {cfg.moe_ffn_hidden_size} (HF counts shared experts)")
    out = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
           "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
           "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_attention_heads,
           "intermediate_size": ffn_size(cfg), "moe_intermediate_size": cfg.moe_ffn_hidden_size,
           "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings or cfg.seq_length,
           "rms_norm_eps": cfg.layernorm_epsilon, "hidden_act": "silu", "q_lora_rank": cfg.q_lora_rank,
           "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_head_dim,
           "qk_rope_head_dim": cfg.qk_pos_emb_head_dim, "v_head_dim": cfg.v_head_dim,
           "head_dim": cfg.qk_pos_emb_head_dim, "n_routed_experts": cfg.num_experts,
           "n_shared_experts": shared // cfg.moe_ffn_hidden_size if shared else 0,
           "num_experts_per_tok": cfg.moe_router_topk, "first_k_dense_replace": k,
           "n_group": cfg.moe_router_num_groups or 1, "topk_group": cfg.moe_router_group_topk or 1,
           "routed_scaling_factor": cfg.moe_router_topk_scaling_factor or 1.0,
           "norm_topk_prob": cfg.moe_router_topk > 1,  # top-1: the raw score (_check_topk_norm)
           "rope_interleave": True, "attention_bias": False, "attention_dropout": cfg.attention_dropout,
           "initializer_range": cfg.init_method_std, "num_nextn_predict_layers": cfg.mtp_num_layers or 0,
           "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights, "torch_dtype": dtype,
           "rope_parameters": _yarn_to_hf(cfg)}
    return out


def gpt_oss_to_hf(cfg, dtype: str) -> dict:
    """The ``config.json`` of a gpt-oss-layout ``cfg``."""
    from omnitron.core.models.gpt.config import head_dim, query_groups
    from omnitron.core.transformer.window import parse_window, window_layers

    window = parse_window(cfg.window_size)
    if (not cfg.add_bias_linear or not router_bias(cfg) or cfg.glu_linear_offset != 1.0
            or cfg.activation_func_clamp_value is None or cfg.moe_shared_expert_intermediate_size
            or cfg.moe_ffn_hidden_size not in (None, ffn_size(cfg)) or cfg.moe_router_score_function != "softmax"
            or cfg.moe_router_pre_softmax or (window is not None and window[0] < 0)):
        raise HFConversionError("a Hugging Face gpt-oss model has biases everywhere, a router bias, the clamped GeGLU "
                                "with offset 1, experts of --ffn-hidden-size, no shared expert, softmax over the picks "
                                "and a bounded window; this model differs")
    layers = window_layers(cfg)
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_hidden_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": query_groups(cfg), "head_dim": head_dim(cfg),
            "intermediate_size": ffn_size(cfg), "num_local_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.moe_router_topk, "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_position_embeddings or cfg.seq_length,
            "rms_norm_eps": cfg.layernorm_epsilon, "sliding_window": None if window is None else window[0] + 1,
            "layer_types": ["sliding_attention" if w else "full_attention" for w in layers],
            "swiglu_limit": cfg.activation_func_clamp_value, "attention_bias": True,
            "attention_dropout": cfg.attention_dropout, "initializer_range": cfg.init_method_std,
            "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights, "torch_dtype": dtype,
            "rope_parameters": _yarn_to_hf(cfg)}


# ---- weights ---------------------------------------------------------------------------------
def _swiglu_mlp(o: str, h: str) -> list[Rule]:
    """A SwiGLU MLP without biases: ``linear_fc1 = [gate_proj; up_proj]``, ``linear_fc2 = down_proj``."""
    return [Rule(o + "linear_fc1.weight", (h + "gate_proj.weight", h + "up_proj.weight"),
                 lambda a, b: torch.cat([a, b], 0), lambda t: tuple(t.chunk(2, 0))),
            Rule(o + "linear_fc2.weight", (h + "down_proj.weight",))]


def _common(cfg) -> list[Rule]:
    rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
             Rule("decoder.final_layernorm.weight", ("model.norm.weight",))]
    if cfg.untie_embeddings_and_output_weights:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",)))
    return rules


def deepseek_rules(cfg) -> list[Rule]:
    """The decoder's layers, then each MTP depth d as HF's layer ``num_hidden_layers + d``: its transformer layer
    (the last decoder layer's kind), ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm`` (omnitron's
    ``final_layernorm``); ``embed_tokens`` and ``shared_head.head`` are the shared embedding and head
    (:func:`take_deepseek_extras`, :func:`deepseek_extras`)."""
    from omnitron.core.transformer.moe.pattern import is_moe_layer

    rules = _common(cfg)
    for i in range(cfg.num_layers):
        rules += _deepseek_layer(cfg, f"decoder.layers.{i}.", f"model.layers.{i}.", is_moe_layer(cfg, i))
    for d in range(cfg.mtp_num_layers or 0):
        o, h = f"mtp.layers.{d}.", f"model.layers.{cfg.num_layers + d}."
        rules += _deepseek_layer(cfg, o + "transformer_layer.", h, is_moe_layer(cfg, cfg.num_layers - 1))
        rules += [Rule(o + n, (h + m,)) for n, m in (("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"),
                                                     ("eh_proj.weight", "eh_proj.weight"),
                                                     ("final_layernorm.weight", "shared_head.norm.weight"))]
    return rules


def _deepseek_layer(cfg, o: str, h: str, moe: bool) -> list[Rule]:
    """One DeepSeek-V3 decoder layer: omnitron names under ``o``, HF's under ``h``."""
    a, sa = o + "self_attention.", h + "self_attn."
    rules = [Rule(o + "input_layernorm.weight", (h + "input_layernorm.weight",)),
             Rule(o + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",)),
             Rule(a + "linear_kv_down_proj.weight", (sa + "kv_a_proj_with_mqa.weight",)),
             Rule(a + "kv_layernorm.weight", (sa + "kv_a_layernorm.weight",)),
             Rule(a + "linear_kv_up_proj.weight", (sa + "kv_b_proj.weight",)),
             Rule(a + "linear_proj.weight", (sa + "o_proj.weight",))]
    if cfg.q_lora_rank is None:
        rules.append(Rule(a + "linear_q_proj.weight", (sa + "q_proj.weight",)))
    else:
        rules += [Rule(a + "linear_q_down_proj.weight", (sa + "q_a_proj.weight",)),
                  Rule(a + "q_layernorm.weight", (sa + "q_a_layernorm.weight",)),
                  Rule(a + "linear_q_up_proj.weight", (sa + "q_b_proj.weight",))]
    if not moe:
        return rules + _swiglu_mlp(o + "mlp.", h + "mlp.")
    # transformers keeps the gate in float32 (_keep_in_fp32_modules_strict); both routers compute in float32
    rules.append(Rule(o + "mlp.router.weight", (h + "mlp.gate.weight",), to_hf=lambda t: (t.float(),)))
    for e in range(cfg.num_experts):
        rules += _swiglu_mlp(f"{o}mlp.experts.{e}.", f"{h}mlp.experts.{e}.")
    if cfg.moe_shared_expert_intermediate_size:
        rules += _swiglu_mlp(o + "mlp.shared_experts.", h + "mlp.shared_experts.")
    return rules


def gpt_oss_rules(cfg) -> list[Rule]:
    """Per-expert HF names ``mlp.experts.{e}.gate_up_proj`` etc. stand for slices of the stacked tensors
    (:func:`unstack_gpt_oss_experts` / :func:`stack_gpt_oss_experts`)."""
    from omnitron.core.models.gpt.config import query_groups
    from omnitron.core.transformer.qkv import fuse_qkv, split_qkv

    g, hq = query_groups(cfg), cfg.num_attention_heads
    rules = _common(cfg)
    for i in range(cfg.num_layers):
        o, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        rules += [Rule(o + "input_layernorm.weight", (h + "input_layernorm.weight",)),
                  Rule(o + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",)),
                  Rule(o + "self_attention.softmax_offset", (h + "self_attn.sinks",)),
                  Rule(o + "mlp.router.weight", (h + "mlp.router.weight",)),
                  Rule(o + "mlp.router.bias", (h + "mlp.router.bias",))]
        for k in ("weight", "bias"):
            rules += [Rule(o + "self_attention.linear_qkv." + k, tuple(f"{h}self_attn.{p}_proj.{k}" for p in "qkv"),
                           lambda q, kk, v: fuse_qkv(q, kk, v, g), lambda t: split_qkv(t, g, hq)),
                      Rule(o + "self_attention.linear_proj." + k, (f"{h}self_attn.o_proj.{k}",))]
        for e in range(cfg.num_experts):
            x, y = f"{o}mlp.experts.{e}.", f"{h}mlp.experts.{e}."
            rules += [Rule(x + "linear_fc1.weight", (y + "gate_up_proj",),  # [h, 2f], gate/up alternating columns
                           lambda t: torch.cat([t[:, 0::2], t[:, 1::2]], 1).t(),
                           lambda w: (torch.stack([c.t() for c in w.chunk(2, 0)], -1).flatten(1),)),
                      Rule(x + "linear_fc1.bias", (y + "gate_up_proj_bias",),
                           lambda b: torch.cat([b[0::2], b[1::2]]), lambda b: (torch.stack(b.chunk(2), -1).flatten(),)),
                      Rule(x + "linear_fc2.weight", (y + "down_proj",), lambda t: t.t(), lambda w: (w.t(),)),
                      Rule(x + "linear_fc2.bias", (y + "down_proj_bias",))]
    return rules


_STACKED = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def unstack_gpt_oss_experts(hf: dict) -> dict:
    """``mlp.experts.X [E, ...]`` -> ``mlp.experts.{e}.X`` (views), for the per-expert rules."""
    out = {}
    for name, t in hf.items():
        head, _, last = name.rpartition(".")
        if head.endswith("mlp.experts") and last in _STACKED:
            out.update({f"{head}.{e}.{last}": t[e] for e in range(t.shape[0])})
        else:
            out[name] = t
    return out


def stack_gpt_oss_experts(hf: dict) -> dict:
    """Inverse of :func:`unstack_gpt_oss_experts`: per-expert tensors stacked in expert order."""
    out, parts = {}, {}
    for name, t in hf.items():
        head, _, last = name.rpartition(".")
        base, _, e = head.rpartition(".")
        if base.endswith("mlp.experts") and last in _STACKED:
            parts.setdefault(f"{base}.{last}", {})[int(e)] = t
        else:
            out[name] = t
    for name, by_expert in parts.items():
        out[name] = torch.stack([by_expert[e] for e in sorted(by_expert)]).contiguous()
    return out


def _moe_layers(cfg) -> dict[str, str]:
    """{HF layer prefix: omnitron's} of every MoE layer, MTP's too."""
    from omnitron.core.transformer.moe.pattern import is_moe_layer

    names = {f"model.layers.{i}.": f"decoder.layers.{i}." for i in range(cfg.num_layers) if is_moe_layer(cfg, i)}
    if is_moe_layer(cfg, cfg.num_layers - 1):
        names.update({f"model.layers.{cfg.num_layers + d}.": f"mtp.layers.{d}.transformer_layer."
                      for d in range(cfg.mtp_num_layers or 0)})
    return names


def _bias_names(cfg) -> dict[str, str]:
    """{HF ``e_score_correction_bias`` name: omnitron's ``expert_bias`` buffer} of every MoE layer, MTP's too."""
    return {h + "mlp.gate.e_score_correction_bias": o + "mlp.router.expert_bias" for h, o in _moe_layers(cfg).items()}


def _empty_shared_experts(cfg, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The zero-size shared-expert MLP transformers builds and saves in every MoE layer when ``n_shared_experts``
    is 0 (omnitron: no shared experts); {} when the model has shared experts."""
    if cfg.moe_shared_expert_intermediate_size:
        return {}
    h = cfg.hidden_size
    shapes = {"gate_proj": (0, h), "up_proj": (0, h), "down_proj": (h, 0)}
    return {f"{p}mlp.shared_experts.{n}.weight": torch.empty(shape, dtype=dtype) for p in _moe_layers(cfg)
            for n, shape in shapes.items()}


def drop_absent_mtp(cfg, hf: dict, say=None):
    """``cfg`` without multi-token prediction when config.json names MTP layers (``num_nextn_predict_layers``,
    1 by default in DeepseekV3Config) but the weights ``hf`` hold none of them: transformers builds and saves none,
    so its own checkpoints have only the main model. ``say(text)``: told so in one line."""
    n = cfg.mtp_num_layers or 0
    prefixes = tuple(f"layers.{cfg.num_layers + d}." for d in range(n))
    if not n or any(name.removeprefix("model.").startswith(prefixes) for name in hf):
        return cfg
    if say:
        say(f"config.json names {n} multi-token-prediction layer(s) (num_nextn_predict_layers) but the weights hold "
            "none (transformers saves none): imported the main model without MTP")
    return dataclasses.replace(cfg, mtp_num_layers=None)


def latent_norm_warning(cfg) -> str | None:
    """One line when an MLA model's --norm-epsilon is not the 1e-6 transformers gives DeepSeek-V3's latent norms
    (``q_a_layernorm`` / ``kv_a_layernorm``, whatever ``rms_norm_eps`` says); None otherwise."""
    if not cfg.multi_latent_attention or cfg.layernorm_epsilon == 1e-6:
        return None
    return (f"--norm-epsilon {cfg.layernorm_epsilon} is written as rms_norm_eps, but transformers' DeepSeek-V3 "
            "builds its latent norms (q_a_layernorm, kv_a_layernorm) with eps 1e-6, so its logits differ slightly "
            "from this model's")


def take_deepseek_extras(hf: dict, cfg) -> dict[str, torch.Tensor]:
    """Remove from ``hf`` what no rule maps: the routing biases, returned under omnitron's buffer names (float32,
    as the buffer), the zero-size shared experts of ``n_shared_experts`` 0, and each MTP layer's copies of the
    embedding and the head, which must equal the model's (omnitron shares them, as DeepSeek-V3 does)."""
    out = {o: hf.pop(h).float() for h, o in _bias_names(cfg).items() if h in hf}
    for name in _empty_shared_experts(cfg, torch.float32):
        if name in hf and hf[name].numel() == 0:
            hf.pop(name)
    head = "lm_head.weight" if cfg.untie_embeddings_and_output_weights else "model.embed_tokens.weight"
    for d in range(cfg.mtp_num_layers or 0):
        h = f"model.layers.{cfg.num_layers + d}."
        for name, same in ((h + "embed_tokens.weight", "model.embed_tokens.weight"),
                           (h + "shared_head.head.weight", head)):
            if name in hf and not torch.equal(hf.pop(name), hf[same]):
                raise HFConversionError(f"{name} differs from {same}: omnitron's multi-token prediction shares the "
                                        "embedding and the output head with the model, as DeepSeek-V3 trains them")
    return out


def deepseek_extras(cfg, full: dict) -> dict:
    """What :func:`take_deepseek_extras` takes, for the export: ``e_score_correction_bias`` of every MoE layer (the
    checkpoint's expert bias where its state holds one, else zeros), the zero-size shared experts of a model without
    any, and the MTP layers' embedding and head copies."""
    emb = full["embedding.word_embeddings.weight"]
    out = {h: full.get(o, torch.zeros(cfg.num_experts)).float() for h, o in _bias_names(cfg).items()}
    out.update(_empty_shared_experts(cfg, emb.dtype))
    head = full["output_layer.weight"] if cfg.untie_embeddings_and_output_weights else emb
    for d in range(cfg.mtp_num_layers or 0):
        h = f"model.layers.{cfg.num_layers + d}."
        out.update({h + "embed_tokens.weight": emb.clone(), h + "shared_head.head.weight": head.clone()})  # own storage
    return out
