"""Hugging Face GPT-2 / Llama (and DeepSeek-V3 / gpt-oss, :mod:`.hf_moe`) checkpoints to and from omnitron's
full (layout-independent) state.

omnitron's full state names every weight globally at its full, unpadded shape
(``decoder.layers.7.self_attention.linear_qkv.weight``; see :mod:`omnitron.core.checkpoint.reshard`).
This module maps it, tensor by tensor, to the state dicts of ``GPT2LMHeadModel``, ``LlamaForCausalLM`` and
``Qwen2ForCausalLM`` (Llama's tensors plus q/k/v biases: ``--disable-bias-linear --add-qkv-bias``) and their
``config.json``, so that

- ``import_hf`` writes an omnitron checkpoint (weights only, any tensor/pipeline layout) from a
  ``save_pretrained`` directory, and
- ``export_hf`` writes ``config.json`` + ``model.safetensors`` that ``from_pretrained`` loads.

The differences the mapping absorbs:

- GPT-2's ``Conv1D`` stores weights ``[in, out]`` (transposed against ``nn.Linear``).
- HF keeps q, k and v apart (GPT-2: one ``c_attn`` with all q, then all k, then all v columns);
  omnitron's fused QKV rows are grouped per key/value head: ``[q heads of group 0, k0, v0 | ...]``.
- Llama's ``gate_proj`` / ``up_proj`` are omnitron's ``linear_fc1`` (all gate rows, then all up rows).
- RoPE: HF Llama rotates halves (channel ``i`` with ``i + d/2``), which is omnitron's default
  (``rotary_interleaved=False``), so q/k rows map unchanged. A model trained with
  ``--rotary-interleaved`` (pairs ``2i, 2i+1``) is exported with each head's q/k rows permuted to
  the half layout, which computes the same attention scores.
- The vocabulary: the full state holds exactly ``vocab_size`` rows (padding to
  ``make_vocab_size_divisible_by x tp`` exists only inside a rank's shard), as HF does.

Unsupported HF features (other model types, rope scaling other than Llama-3.1's, biases on the
attention but not the MLP, exact-erf GeLU, ...) raise :class:`HFConversionError` naming the field.
"""
from __future__ import annotations

import json
import os

import torch

from omnitron.core.checkpoint import hf_moe
from omnitron.core.checkpoint.hf_llama import (  # noqa: F401 - re-exported: callers import them from here
    _LLAMA3_ROPE, HFConversionError, Rule, _check, _half_rope_rows, _llama_config, _llama_fields, _llama_rules,
    _need, _qwen2_config, _qwen2_fields, _rope)
from omnitron.core.checkpoint.hf_files import IGNORED, read_hf_dir  # noqa: F401 - read_hf_dir re-exported
from omnitron.core.transformer.mlp import exact_gelu
from omnitron.core.transformer.qkv import fuse_qkv, split_qkv


# ---- config ----------------------------------------------------------------------------------
def _dtype(hf: dict) -> torch.dtype:
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    dt = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise HFConversionError(f"config.json: torch_dtype {name!r} is not a floating-point torch dtype")
    return dt


def config_from_hf(hf: dict):
    """A :class:`GPTConfig` from a ``GPT2LMHeadModel``, ``LlamaForCausalLM`` or ``Qwen2ForCausalLM`` (or MoE)
    ``config.json`` dict."""
    from omnitron.core.models.gpt.config import GPTConfig

    kind = hf.get("model_type")
    if kind == "gpt2":
        return GPTConfig(**_gpt2_fields(hf), params_dtype=_dtype(hf))
    if kind in ("llama", "qwen2"):
        return GPTConfig(**(_llama_fields if kind == "llama" else _qwen2_fields)(hf), params_dtype=_dtype(hf))
    if kind in ("deepseek_v3", "gpt_oss", "qwen3_moe"):
        fields = {"deepseek_v3": hf_moe.deepseek_fields, "gpt_oss": hf_moe.gpt_oss_fields,
                  "qwen3_moe": hf_moe.qwen3_moe_fields}[kind](hf)
        return GPTConfig(**fields, params_dtype=_dtype(hf))
    raise HFConversionError(f"config.json: model_type {kind!r} is not supported; omnitron imports 'gpt2' "
                            f"(GPT2LMHeadModel), 'llama' (LlamaForCausalLM), 'qwen2' (Qwen2ForCausalLM), "
                            f"'deepseek_v3', 'gpt_oss' and 'qwen3_moe'")


def _gpt2_fields(hf: dict) -> dict:
    _check(hf, "activation_function", lambda v: v in ("gelu_new", "gelu_pytorch_tanh", "gelu"),
           "omnitron's GPT-2 MLP runs the tanh GeLU (gelu_new) or, with --no-bias-gelu-fusion, the exact one (gelu)")
    _check(hf, "scale_attn_weights", bool, "omnitron always scales attention scores by 1/sqrt(head_dim)")
    _check(hf, "scale_attn_by_inverse_layer_idx", lambda v: not v, "no per-layer attention scaling in omnitron")
    _check(hf, "add_cross_attention", lambda v: not v, "omnitron models are decoder-only")
    n = _need(hf, "n_positions")
    h = _need(hf, "n_embd")
    return dict(num_layers=_need(hf, "n_layer"), hidden_size=h, num_attention_heads=_need(hf, "n_head"),
                ffn_hidden_size=hf.get("n_inner"), vocab_size=_need(hf, "vocab_size"),
                max_position_embeddings=n, seq_length=n, layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
                untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True),
                hidden_dropout=hf.get("resid_pdrop", 0.1), attention_dropout=hf.get("attn_pdrop", 0.1),
                init_method_std=hf.get("initializer_range", 0.02),
                bias_gelu_fusion=hf.get("activation_function", "gelu_new") != "gelu")


def hf_model_type(cfg) -> str:
    """``gpt2``, ``llama``, ``qwen2`` (Llama with --add-qkv-bias and no --add-bias-linear), ``deepseek_v3``
    (multi-latent attention), ``gpt_oss`` (attention sinks, quick GeGLU, MoE) or ``qwen3_moe``: the HF
    architecture ``cfg`` is (error naming the first field that fits none)."""
    from omnitron.core.models.gpt.config import head_dim, query_groups

    qkv_bias_only = getattr(cfg, "add_qkv_bias", False) and not cfg.add_bias_linear
    if qkv_bias_only and (cfg.num_experts or getattr(cfg, "multi_latent_attention", False)):
        raise HFConversionError("the model has --add-qkv-bias without --add-bias-linear; of the Hugging Face models "
                                "omnitron writes only dense Qwen2 (RoPE, no --num-experts) has that: drop one")
    if getattr(cfg, "squared_relu", False):
        raise HFConversionError("the model has --squared-relu; none of the Hugging Face models omnitron writes has "
                                "a squared-ReLU MLP (GPT-2: GeLU, the others: gated SiLU / GeLU): keep it in "
                                "omnitron's or Megatron's format (`omnitron checkpoint export-megatron`)")
    if getattr(cfg, "multi_latent_attention", False):
        return "deepseek_v3"
    if (getattr(cfg, "softmax_type", "vanilla") == "learnable" and getattr(cfg, "quick_geglu", False)
            and cfg.num_experts):
        return "gpt_oss"
    plain = getattr(cfg, "softmax_type", "vanilla") == "vanilla"  # Qwen3-MoE may window (every layer)
    rotary = cfg.position_embedding_type in ("rope", "yarn")
    if cfg.num_experts and cfg.qk_layernorm and cfg.swiglu and rotary and plain:
        return "qwen3_moe"
    common = [("--num-experts", cfg.num_experts, None), ("--qk-layernorm", cfg.qk_layernorm, False),
              ("--mtp-num-layers", getattr(cfg, "mtp_num_layers", None), None),
              ("--window-size", None if qkv_bias_only else getattr(cfg, "window_size", None), None),  # Qwen2's own
              ("--softmax-type", getattr(cfg, "softmax_type", "vanilla"), "vanilla"),
              ("--quick-geglu", getattr(cfg, "quick_geglu", False), False),
              ("--glu-linear-offset", getattr(cfg, "glu_linear_offset", 0.0), 0.0),
              ("--activation-func-clamp-value", getattr(cfg, "activation_func_clamp_value", None), None),
              ("--rotary-scaling-factor", getattr(cfg, "rotary_scaling_factor", 1.0), 1.0)]  # YaRN: MoE / MLA kinds
    if cfg.position_embedding_type == "learned_absolute":
        kind, want = "gpt2", [("--normalization", cfg.normalization, "LayerNorm"), ("--swiglu", cfg.swiglu, False),
                              ("--add-bias-linear", cfg.add_bias_linear, True),
                              ("--num-query-groups", query_groups(cfg), cfg.num_attention_heads),
                              ("--kv-channels", head_dim(cfg), cfg.hidden_size // cfg.num_attention_heads)]
    else:
        kind, want = "llama", [("--position-embedding-type", cfg.position_embedding_type, "rope"),
                               ("--normalization", cfg.normalization, "RMSNorm"), ("--swiglu", cfg.swiglu, True),
                               ("--rotary-percent", cfg.rotary_percent, 1.0)]
    for flag, have, need in common + want:
        if have != need:
            raise HFConversionError(f"the model has {flag} {have}; a Hugging Face {kind} model "
                                    f"({'learned positions' if kind == 'gpt2' else 'RoPE'}) needs {need}")
    return "qwen2" if kind == "llama" and qkv_bias_only else kind


def config_to_hf(cfg) -> dict:
    """The ``config.json`` dict of the Hugging Face model equal to ``cfg`` (written in the
    transformers-4 spelling, which transformers 5 reads too)."""
    kind, dtype = hf_model_type(cfg), str(cfg.params_dtype).replace("torch.", "")
    if kind in ("deepseek_v3", "gpt_oss", "qwen3_moe"):
        return {"deepseek_v3": hf_moe.deepseek_to_hf, "gpt_oss": hf_moe.gpt_oss_to_hf,
                "qwen3_moe": hf_moe.qwen3_moe_to_hf}[kind](cfg, dtype)
    return {"llama": _llama_config, "qwen2": _qwen2_config, "gpt2": _gpt2_config}[kind](cfg, dtype)


def _gpt2_config(cfg, dtype: str) -> dict:
    """The ``GPT2LMHeadModel`` config.json of ``cfg``."""
    from omnitron.core.models.gpt.config import max_positions

    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": cfg.num_layers,
            "n_embd": cfg.hidden_size, "n_head": cfg.num_attention_heads, "n_inner": cfg.ffn_hidden_size,
            "n_positions": max_positions(cfg), "n_ctx": max_positions(cfg), "vocab_size": cfg.vocab_size,
            "layer_norm_epsilon": cfg.layernorm_epsilon,
            "activation_function": "gelu" if exact_gelu(cfg) else "gelu_new",
            "resid_pdrop": cfg.hidden_dropout, "embd_pdrop": cfg.hidden_dropout,
            "attn_pdrop": cfg.attention_dropout, "initializer_range": cfg.init_method_std,
            "scale_attn_weights": True, "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
            "torch_dtype": dtype}


# ---- weights ---------------------------------------------------------------------------------
def _gpt2_rules(cfg) -> list[Rule]:
    heads, T = cfg.num_attention_heads, (lambda t: t.t())  # Conv1D [in, out] <-> Linear [out, in]
    rules = [Rule("embedding.word_embeddings.weight", ("transformer.wte.weight",)),
             Rule("embedding.position_embeddings.weight", ("transformer.wpe.weight",)),
             Rule("decoder.final_layernorm.weight", ("transformer.ln_f.weight",)),
             Rule("decoder.final_layernorm.bias", ("transformer.ln_f.bias",))]
    if cfg.untie_embeddings_and_output_weights:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",)))
    for i in range(cfg.num_layers):
        o, h = f"decoder.layers.{i}.", f"transformer.h.{i}."
        rules += [Rule(o + "input_layernorm." + k, (h + "ln_1." + k,)) for k in ("weight", "bias")]
        rules += [Rule(o + "pre_mlp_layernorm." + k, (h + "ln_2." + k,)) for k in ("weight", "bias")]
        rules += [Rule(o + "self_attention.linear_qkv.weight", (h + "attn.c_attn.weight",),
                       lambda w: fuse_qkv(*w.t().chunk(3, 0), heads),
                       lambda t: (torch.cat(split_qkv(t, heads, heads), 0).t(),)),
                  Rule(o + "self_attention.linear_qkv.bias", (h + "attn.c_attn.bias",),
                       lambda b: fuse_qkv(*b.chunk(3, 0), heads), lambda t: (torch.cat(split_qkv(t, heads, heads)),)),
                  Rule(o + "self_attention.linear_proj.weight", (h + "attn.c_proj.weight",), T, lambda t: (t.t(),)),
                  Rule(o + "self_attention.linear_proj.bias", (h + "attn.c_proj.bias",)),
                  Rule(o + "mlp.linear_fc1.weight", (h + "mlp.c_fc.weight",), T, lambda t: (t.t(),)),
                  Rule(o + "mlp.linear_fc1.bias", (h + "mlp.c_fc.bias",)),
                  Rule(o + "mlp.linear_fc2.weight", (h + "mlp.c_proj.weight",), T, lambda t: (t.t(),)),
                  Rule(o + "mlp.linear_fc2.bias", (h + "mlp.c_proj.bias",))]
    return rules


def _rules(cfg) -> list[Rule]:
    build = {"gpt2": _gpt2_rules, "llama": _llama_rules, "qwen2": _llama_rules, "deepseek_v3": hf_moe.deepseek_rules,
             "gpt_oss": hf_moe.gpt_oss_rules, "qwen3_moe": hf_moe.qwen3_moe_rules}[hf_model_type(cfg)]
    rules = build(cfg)
    if not cfg.apply_layernorm_1p:
        return rules
    # --apply-layernorm-1p: omnitron holds w - 1 for a Hugging Face norm weight w
    return [Rule(r.omni, r.hf, lambda t: t - 1, lambda t: (t + 1,)) if r.omni.endswith("layernorm.weight") else r
            for r in rules]


def _canonical_names(state: dict, kind: str) -> dict:
    """HF names with the base-model prefix (``transformer.`` / ``model.``), which a checkpoint of the
    bare base model (``GPT2Model``, ``LlamaModel``) lacks; ignorable buffers dropped."""
    prefix = "transformer." if kind == "gpt2" else "model."
    out = {}
    for name, t in state.items():
        if name.endswith(IGNORED):
            continue
        out[name if name.startswith(prefix) or name.startswith("lm_head.") else prefix + name] = t
    return out


def state_from_hf(hf_state: dict, cfg) -> dict[str, torch.Tensor]:
    """omnitron's full state (global names) from an HF state dict of the model ``cfg`` describes."""
    kind = hf_model_type(cfg)
    hf = _canonical_names(hf_state, kind)
    if kind == "gpt_oss":
        hf = hf_moe.unstack_gpt_oss_experts(hf)
    extra = hf_moe.take_deepseek_extras(hf, cfg) if kind == "deepseek_v3" else {}
    emb = "transformer.wte.weight" if kind == "gpt2" else "model.embed_tokens.weight"
    if not cfg.untie_embeddings_and_output_weights and "lm_head.weight" in hf:
        if emb in hf and not torch.equal(hf["lm_head.weight"], hf[emb]):
            raise HFConversionError("tie_word_embeddings is true but lm_head.weight differs from the word "
                                    "embedding; set tie_word_embeddings=false in config.json")
        hf.pop("lm_head.weight")
    out = {}
    for r in _rules(cfg):
        missing = [n for n in r.hf if n not in hf]
        if missing:
            raise HFConversionError(f"the Hugging Face weights have no {missing[0]!r}, which config.json implies; "
                                    f"the checkpoint and its config.json do not match")
        out[r.omni] = r.to_omni(*(hf.pop(n) for n in r.hf)).contiguous()
    if hf:
        names = sorted(hf)
        raise HFConversionError(f"{len(names)} Hugging Face weights have no place in the omnitron model "
                                f"(first: {names[0]!r}); config.json does not describe these weights")
    return {**out, **extra}


def state_to_hf(full: dict, cfg) -> dict[str, torch.Tensor]:
    """The HF state dict (``save_pretrained`` names; tied ``lm_head`` omitted) of omnitron full state ``full``."""
    out = {}
    for r in _rules(cfg):
        if r.omni not in full:
            raise HFConversionError(f"the checkpoint holds no {r.omni!r}; it does not match its own model config")
        out.update({n: t.contiguous() for n, t in zip(r.hf, r.to_hf(full[r.omni]))})
    kind = hf_model_type(cfg)
    if kind == "gpt_oss":
        out = hf_moe.stack_gpt_oss_experts(out)
    if kind == "deepseek_v3":
        out.update(hf_moe.deepseek_extras(cfg, full))
    return out


# ---- directories -----------------------------------------------------------------------------
def _tokenizer_settings(hf_dir: str, cfg) -> dict:
    """Tokenizer flags for the imported checkpoint's config (what ``omnitron generate`` reads)."""
    tok = os.path.join(hf_dir, "tokenizer.json")
    if os.path.isfile(tok):
        return {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": os.path.abspath(tok)}
    if cfg.vocab_size == 50257 and not cfg.swiglu:
        return {"tokenizer_type": "GPT2BPETokenizer"}  # the bundled GPT-2 vocabulary
    return {"tokenizer_type": "NullTokenizer", "vocab_size": cfg.vocab_size - 1}  # NullTokenizer adds its eod


def import_hf(hf_dir: str, save_dir: str, layout, *, say=None) -> str:
    """Write the HF checkpoint in ``hf_dir`` as an omnitron checkpoint (iteration 0, weights only) under
    ``save_dir`` in ``layout`` (a :class:`~omnitron.core.checkpoint.reshard.Layout`); returns its directory.
    ``say(text)``: a line for each thing imported otherwise than config.json says (MTP layers without weights)."""
    hf_config, hf_state = read_hf_dir(hf_dir)
    cfg = hf_moe.drop_absent_mtp(config_from_hf(hf_config), hf_state, say)
    full = state_from_hf(hf_state, cfg)
    del hf_state
    check_shapes(full, cfg, os.path.join(hf_dir, "config.json"))
    return write_weights_checkpoint(full, cfg, save_dir, layout, config=_tokenizer_settings(hf_dir, cfg),
                                    imported_from={"hf_dir": os.path.abspath(hf_dir),
                                                   "model_type": hf_config["model_type"]})


def check_shapes(full: dict, cfg, config: str) -> None:
    """Every tensor of ``full`` that ``cfg``'s model has, at the shape the model gives it (compared on the meta
    device: a ``config`` file declaring a model too large to allocate is refused, not attempted)."""
    from omnitron.core.checkpoint.reshard import full_shapes

    for name, shape in full_shapes(cfg).items():
        if name in full and tuple(full[name].shape) != shape:
            raise HFConversionError(f"{config}: its model's {name} is {shape}, the weights' {tuple(full[name].shape)};"
                                    f" the weights and their config.json do not match")


def write_weights_checkpoint(full: dict, cfg, save_dir: str, layout, *, config: dict | None = None,
                             optimizer: tuple[dict, dict] | None = None, **meta) -> str:
    """An omnitron checkpoint (iteration 0) of the full model state ``full`` of ``cfg`` in ``layout``.

    The shards' optimizer state is ``{"weights_only": True}`` (no moments, no step): training from
    it starts at iteration 0 with a fresh optimizer, as ``--finetune`` does. ``config`` adds run
    settings (the tokenizer) to the metadata's flat config; ``meta`` adds metadata keys. ``optimizer``: the
    imported optimizer's ``(state, meta)`` instead (full-state moments by name, e.g. ``{"exp_avg": {...},
    "exp_avg_sq": {...}, "master": {...}}``, and ``{"step": n, "optimizer": "adam"}``): training then resumes
    those moments (the learning-rate schedule, holding none, is the command line's from its start)."""
    from omnitron.core.checkpoint.io import write_checkpoint
    from omnitron.core.checkpoint.reshard import FullState, rank_shard, skeleton_chunks
    from omnitron.core.parallel.grid import coord_of
    from omnitron.core.training.checkpointing import model_dict

    opt, opt_meta = optimizer or ({}, {"weights_only": True})
    state = FullState(model=full, optimizer=opt, optimizer_meta=opt_meta, scheduler={}, meta={})
    skeletons = skeleton_chunks(cfg, layout)  # ConfigError naming the flag when the model does not split
    pc = layout.parallel_config()

    def shards():
        for w in range(layout.world_size):
            co = coord_of(pc, layout.world_size, w)
            yield w, rank_shard(state, [skeletons[(co.pp, c)] for c in range(layout.chunks)], layout.tp, co.tp)

    flat = {k: v for k, v in model_dict(cfg).items() if k not in ("vocab_size", "params_dtype")}
    flat.update(config or {}, tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp)
    meta.update(consumed_samples=0, model=model_dict(cfg), layout=layout.to_dict(), config=flat)
    if optimizer:  # as a training checkpoint's metadata records its optimizer
        meta.update(optimizer=opt_meta)
    return write_checkpoint(save_dir, 0, shards(), meta, world_size=layout.world_size)


def _check_export_tokenizer(run: dict, cfg, path: str) -> None:
    """The export's tokenizer exists and has the model's vocabulary (else the repository would load wrongly)."""
    from omnitron.core.checkpoint.hf_tokenizer import ExportTokenizerError
    from omnitron.core.data.tokenizers import TokenizerError, build_tokenizer, tokenizer_kwargs

    fix = "give export-hf --tokenizer-type (and --tokenizer-model, --vocab-file/--merge-file or --vocab-size)"
    if not run.get("tokenizer_type"):
        raise ExportTokenizerError(f"{path} records no tokenizer, so the export's AutoTokenizer would encode "
                                   f"nothing; {fix}")
    try:
        tok = build_tokenizer(**tokenizer_kwargs(run), vocab_extra_ids=int(run.get("vocab_extra_ids") or 0))
    except TokenizerError as err:
        raise ExportTokenizerError(f"the export's tokenizer: {err}; {fix}") from None
    if tok.vocab_size != cfg.vocab_size:
        raise ExportTokenizerError(f"the tokenizer {run['tokenizer_type']} has {tok.vocab_size} tokens, the model "
                                   f"{cfg.vocab_size}; {fix} naming the run's own tokenizer")


def export_hf(path: str, out_dir: str, tokenizer: dict | None = None, *, warn=None) -> int:
    """Write checkpoint directory ``path`` (any layout) as ``config.json`` + ``model.safetensors`` in
    ``out_dir``, with the run's tokenizer files, its eos id and ``generation_config.json``
    (:mod:`omnitron.core.checkpoint.hf_tokenizer`); returns the parameter count. ``tokenizer``: tokenizer
    settings (``tokenizer_type``, ``tokenizer_model``, ...) over the checkpoint's, for one that records none.
    Refused, before anything is written, when there is no tokenizer or its vocabulary is not the model's.
    ``warn(text)``: a line for each way transformers' model will differ from the checkpoint's (MLA's latent norms'
    epsilon)."""
    from safetensors.torch import save_file

    from omnitron.core.checkpoint.hf_tokenizer import (ExportTokenizerError, make_readable, write_generation_config,
                                                       write_tokenizer)
    from omnitron.core.checkpoint.reshard import model_config, read_full_state

    full = read_full_state(path, with_optimizer=False)
    cfg = model_config(full.meta["model"])
    hf_config = config_to_hf(cfg)
    run = {**full.meta.get("config", {}), **{k: v for k, v in (tokenizer or {}).items() if v is not None}}
    _check_export_tokenizer(run, cfg, path)
    differs = hf_moe.latent_norm_warning(cfg)
    if warn and differs:
        warn(differs)
    state = state_to_hf(full.model, cfg)
    os.makedirs(out_dir, exist_ok=True)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    eod = write_tokenizer(run, out_dir)
    if eod is None:  # _check_export_tokenizer built it, so its files exist: a type without an HF form
        raise ExportTokenizerError(f"--tokenizer-type {run['tokenizer_type']} has no Hugging Face form to export")
    hf_config.update(bos_token_id=eod, eos_token_id=eod)
    write_generation_config(out_dir, eod)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    make_readable(out_dir)
    return sum(t.numel() for t in state.values())
