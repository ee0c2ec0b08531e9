"""Megatron-LM GPT checkpoints (``--ckpt-format torch``; ``torch_dist`` through
:mod:`~omnitron.core.checkpoint.megatron_dist`) to and from omnitron's full state.

Megatron's per-rank ("legacy torch") layout::

    DIR/latest_checkpointed_iteration.txt        "1000" (or "release")
    DIR/iter_0001000/mp_rank_TT[_PPP]/model_optim_rng.pt   (_PPP only when pipeline size > 1)

Each file is a ``torch.save`` dict: ``model`` (``model0``, ``model1``, ... under the interleaved
schedule) holds the Megatron-Core ``GPTModel`` state dict of that tensor rank TT and pipeline
rank PPP, with layers numbered locally per stage chunk; ``args`` the run's argparse Namespace;
``iteration``; ``checkpoint_version`` (3.0); plus optimizer / RNG state. RNG state is not read; the optimizer's
is where a run with ``--use-distributed-optimizer`` saved ``distrib_optim.pt`` beside each rank's file (its Adam
moments and fp32 masters: :mod:`~omnitron.core.checkpoint.megatron_optim`; the step count from the
``optimizer`` entry here); otherwise an import is weights only, like ``import-hf``.

What the mapping absorbs (Megatron-Core's conventions; omnitron names tensors the same way):

- Layers: stage chunks hold consecutive layers, chunk-major (chunk 0 of every stage, then chunk 1,
  ...), so global index = the layers of all earlier chunks + the local index.
- Norms: under the Transformer Engine layer spec (Megatron's default) the pre-attention / pre-MLP
  norms are fused into the next linear (``self_attention.linear_qkv.layer_norm_weight``,
  ``mlp.linear_fc1.layer_norm_weight``) and TE modules add ``*._extra_state`` entries (FP8
  metadata; written as ``None``, ignored when read); the ``local`` spec keeps
  ``input_layernorm`` / ``pre_mlp_layernorm``, as omnitron does.
- Tensor parallelism: ``linear_qkv`` rows are per query group ``[q heads of the group, k, v]`` (as
  omnitron's fused QKV) and split over tp by whole groups; ``linear_fc1`` (and ``word_embeddings``,
  ``output_layer``) split by rows, ``linear_proj`` / ``linear_fc2`` by columns; under SwiGLU each
  rank's ``linear_fc1`` is ``[its gate rows; its up rows]`` (omnitron's full fc1: all gate rows,
  then all up rows). The vocabulary is padded to ``make_vocab_size_divisible_by x tp`` rows
  (``args.padded_vocab_size``); the full state keeps the real rows only.
- Tied embeddings: a last stage that is not also the first holds a copy, ``output_layer.weight``
  (dropped on import, written on export).

``--ckpt-format torch_dist`` (Megatron's default) is :mod:`omnitron.core.checkpoint.megatron_dist`; this
module keeps the model mapping both share. MoE / MLA / MTP names: :mod:`omnitron.core.checkpoint.megatron_names`
(SequentialMLP experts are written, SequentialMLP and TEGroupedMLP read; MLA / MTP at tp 1 only in this format,
whose shards there depend on the layer spec). Unsupported Megatron features (expert-parallel rank directories,
legacy non-Core names, squared ReLU, ...) raise :class:`MegatronConversionError` naming the field.
Files are read by :mod:`omnitron.core.checkpoint.safe_load` (``torch.load(weights_only=True)`` with an
allow-list of exact names): tensors, containers, argparse / numpy values; ``megatron.*`` classes (the
enums in ``args``) become inert placeholders; anything else is refused in one line, so no code runs.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re

import torch

from omnitron.core.checkpoint import megatron_dist
from omnitron.core.checkpoint.io import _write_file
from omnitron.core.checkpoint.megatron_base import (_COLUMNS, _ROWS, _TE_EXTRA, _TE_NORMS, _VOCAB,  # noqa: F401
                                                    CHECKPOINT_VERSION, TRACKER, MegatronConversionError, Opaque,
                                                    _check_state, _tp_dim, check_weights, checkpoint_dict,
                                                    commit_iteration,
                                                    load_file, run_args)
from omnitron.core.checkpoint.megatron_names import extra_state_modules, is_moe, layer_of, omnitron_rest, torch_rest

FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(_\d{3})?$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP_LAYER = re.compile(r"^(mtp\.layers\.\d+\.transformer_layer\.)(.+)$")
_MTP_MODEL_LAYER = re.compile(r"^(mtp\.layers\.\d+\.)mtp_model_layer\.")
"""megatron-core after 0.16 names the MTP depth's layer ``mtp_model_layer`` in its module state dict (its
torch_dist keys keep ``transformer_layer``): read as the older name."""


# ---- reading files (the safe loader itself: megatron_base) -----------------------------------
def resolve_dir(path: str) -> str:
    """The ``iter_N`` (or ``release``) directory of a Megatron ``--save`` directory (its tracker
    file) or of an iteration directory itself."""
    tracker = os.path.join(path, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            it = f.read().strip()
        name = "release" if it == "release" else f"iter_{int(it):07d}" if it.isdigit() else None
        if name is None:
            raise MegatronConversionError(f"{tracker} holds {it!r}, not an iteration number or 'release'")
        path = os.path.join(path, name)
    from omnitron.core.checkpoint.megatron_dist import CONFIG, is_torch_dist

    if os.path.isdir(path) and is_torch_dist(path):
        return path
    if not os.path.isdir(path) or not any(_RANK_DIR.match(n) for n in os.listdir(path)):
        dist = os.path.isdir(path) and any(n.endswith(".distcp") or n == "common.pt" for n in os.listdir(path))
        hint = f" (DCP files without Megatron's {CONFIG}: copy the whole iteration directory)" if dist else ""
        raise MegatronConversionError(f"--load {path}: no {TRACKER}, no mp_rank_* directories and no torch_dist "
                                      f"{CONFIG} there{hint}; pass a Megatron --save directory (--ckpt-format "
                                      f"torch_dist or torch)")
    return path


def read_shards(iter_dir: str) -> tuple[dict, dict[tuple[int, int], list[dict]]]:
    """(args, ``{(tp_rank, pp_rank): [model state dict per chunk]}``) of a Megatron iteration directory;
    every rank file the args' tensor / pipeline sizes imply must exist."""
    names = [n for n in sorted(os.listdir(iter_dir)) if _RANK_DIR.match(n)]
    if any(_RANK_DIR.match(n).group(3) for n in names):
        raise MegatronConversionError(f"{iter_dir}: expert-parallel rank directories ({names[0]}): MoE checkpoints "
                                      f"are not supported by the Megatron importer")
    first = os.path.join(iter_dir, names[0], FILE)
    args = run_args(load_file(first), first)
    tp, pp = int(args.get("tensor_model_parallel_size") or 1), int(args.get("pipeline_model_parallel_size") or 1)
    out = {}
    for p in range(pp):
        for t in range(tp):
            path = os.path.join(iter_dir, rank_dir(t, p, pp), FILE)
            if not os.path.isfile(path):
                raise MegatronConversionError(f"{path} is missing: the checkpoint's args say tensor parallel {tp} x "
                                              f"pipeline parallel {pp}; copy every mp_rank_* directory")
            ckpt = load_file(path)
            out[(t, p)] = _model_state_dicts(ckpt, path)
            for sd in out[(t, p)]:
                check_weights(sd, path)
            if ckpt.get("iteration") is not None:  # the file's own record (args often lack it)
                args = {**args, "iteration": ckpt["iteration"]}
    return args, out


def _model_state_dicts(ckpt, path: str) -> list[dict]:
    """The model state dicts (``model``, or ``model0``, ``model1``, ... of virtual stages) of rank file ``path``'s
    top-level dict ``ckpt``; one line naming the file when it holds something else."""
    keys = sorted((k for k in checkpoint_dict(ckpt, path) if isinstance(k, str) and re.fullmatch(r"model\d*", k)),
                  key=lambda k: int(k[5:] or 0))
    if not keys:
        raise MegatronConversionError(f"{path}: no 'model' state dict in it")
    bad = next((k for k in keys if not isinstance(ckpt[k], dict)
                or not all(isinstance(n, str) and (v is None or torch.is_tensor(v)) for n, v in ckpt[k].items())), None)
    if bad is not None:
        raise MegatronConversionError(f"{path}: {bad!r} is not a state dict of tensor names to tensors; the file is "
                                      f"not a Megatron checkpoint")
    return [ckpt[k] for k in keys]


def rank_dir(tp_rank: int, pp_rank: int, pp: int) -> str:
    """Megatron's rank directory name (the pipeline rank only when there are stages)."""
    return f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")


# ---- config ----------------------------------------------------------------------------------
def _need(args: dict, key: str):
    if args.get(key) is None:
        raise MegatronConversionError(f"the checkpoint's args have no {key}, which the GPT model needs")
    return args[key]


def _reject_unsupported(args: dict) -> None:
    """Raise naming the first Megatron setting omnitron's GPT model does not compute."""
    checks = [("normalization", args.get("normalization", "LayerNorm") in ("LayerNorm", "RMSNorm"),
               "omnitron has LayerNorm and RMSNorm"),
              ("position_embedding_type", args.get("position_embedding_type", "learned_absolute") in
               ("learned_absolute", "rope", "yarn", "none"), "omnitron has learned_absolute, rope, yarn and none"),
              ("fp8_param_gather", not args.get("fp8_param_gather"), "FP8 parameters: save high-precision weights")]
    for key, ok, why in checks:
        if not ok:
            raise MegatronConversionError(f"the checkpoint's args have {key}={args.get(key)!r}: {why}")


def config_from_megatron(args: dict, *, vocab_size: int, dtype: torch.dtype):
    """The :class:`GPTConfig` of a Megatron GPT run's args (``vocab_size``: the real vocabulary)."""
    from omnitron.core.models.gpt.config import GPTConfig

    _reject_unsupported(args)
    h, heads = _need(args, "hidden_size"), _need(args, "num_attention_heads")
    groups = args.get("num_query_groups") if args.get("group_query_attention") else None
    kv = args.get("kv_channels")
    pos = args.get("position_embedding_type") or ("rope" if args.get("use_rotary_position_embeddings")
                                                  else "learned_absolute")
    seq = _need(args, "seq_length")
    max_pos = args.get("max_position_embeddings") or seq
    if pos != "learned_absolute" and max_pos == seq:
        max_pos = None  # no position table: left unset, as a RoPE run's own flags leave it
    return GPTConfig(num_layers=_need(args, "num_layers"), hidden_size=h, num_attention_heads=heads,
                     ffn_hidden_size=args.get("ffn_hidden_size"), num_query_groups=None if groups == heads else groups,
                     kv_channels=None if kv is None or (h % heads == 0 and kv == h // heads) else kv,
                     seq_length=seq, max_position_embeddings=max_pos,
                     vocab_size=vocab_size,
                     make_vocab_size_divisible_by=args.get("make_vocab_size_divisible_by") or 128,
                     normalization=args.get("normalization") or "LayerNorm",
                     layernorm_epsilon=args.get("norm_epsilon", args.get("layernorm_epsilon", 1e-5)),
                     swiglu=bool(args.get("swiglu")), squared_relu=bool(args.get("squared_relu")),
                     position_embedding_type=pos,
                     rotary_base=float(args.get("rotary_base", 10000)),
                     rotary_percent=float(args.get("rotary_percent", 1.0)),
                     rotary_interleaved=bool(args.get("rotary_interleaved")),
                     rope_scaling_factor=float(args.get("rope_scaling_factor", 8.0)) if args.get("use_rope_scaling")
                     else 1.0,
                     untie_embeddings_and_output_weights=bool(args.get("untie_embeddings_and_output_weights")),
                     hidden_dropout=args.get("hidden_dropout", 0.1),
                     attention_dropout=args.get("attention_dropout", 0.1),
                     add_bias_linear=bool(args.get("add_bias_linear", True)),
                     # Megatron's MLA has no qkv bias: the flag changes nothing there, so it is not carried over
                     add_qkv_bias=bool(args.get("add_qkv_bias")) and not args.get("multi_latent_attention"),
                     # only where it decides the GeLU (biases on, no SwiGLU): elsewhere the default, as omnitron's
                     # own runs record it (Megatron turns it off with --disable-bias-linear)
                     bias_gelu_fusion=bool(args.get("swiglu")) or not args.get("add_bias_linear", True)
                     or bool(args.get("bias_gelu_fusion", True)),
                     qk_layernorm=bool(args.get("qk_layernorm")),
                     apply_layernorm_1p=bool(args.get("apply_layernorm_1p")),
                     init_method_std=args.get("init_method_std", 0.02), params_dtype=dtype,
                     **_moe_mla_mtp_fields(args, pos))


_SAME_NAMED = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_router_load_balancing_type",
               "moe_aux_loss_coeff", "moe_router_pre_softmax", "moe_router_score_function", "moe_z_loss_coeff",
               "moe_shared_expert_intermediate_size", "moe_expert_capacity_factor", "moe_token_drop_policy",
               "moe_pad_expert_input_to_capacity", "moe_grouped_gemm", "moe_router_num_groups",
               "moe_router_group_topk", "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias",
               "moe_router_bias_update_rate", "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
               "qk_pos_emb_head_dim", "v_head_dim", "rotary_scaling_factor", "mscale", "mscale_all_dim",
               "beta_fast", "beta_slow", "mtp_num_layers", "mtp_loss_scaling_factor")
"""Megatron args that are GPTConfig fields of the same name (MoE, MLA, MTP); ``beta_*`` are ``yarn_beta_*``."""


_GQA_YARN = ("yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
             "yarn_correction_range_round_to_int")
"""Megatron's --yarn-* args, which its GPTModel reads under position_embedding_type ``yarn`` without MLA."""


def _moe_mla_mtp_fields(args: dict, pos: str) -> dict:
    """GPTConfig fields of a Megatron run's MoE / MLA / MTP / YaRN args (only those recorded and not None). Without
    MLA Megatron reads --rotary-scaling-factor and --yarn-* only under ``yarn`` (argument_utils's
    ``_apply_yarn_config_from_args``): its ``rope`` is plain RoPE whatever the factor says."""
    out = {k: args[k] for k in _SAME_NAMED if args.get(k) is not None}
    if not out.get("multi_latent_attention") and pos != "yarn":
        out.pop("rotary_scaling_factor", None)  # Megatron's rope: plain RoPE whatever the factor
    if not out.get("multi_latent_attention") and pos == "yarn":
        out.update({k: args[k] for k in _GQA_YARN if args.get(k) is not None})
    for beta in ("beta_fast", "beta_slow"):
        if beta in out:
            out["yarn_" + beta] = float(out.pop(beta))
    if args.get("original_max_position_embeddings") and out.get("multi_latent_attention"):
        out["yarn_original_max_position_embeddings"] = int(args["original_max_position_embeddings"])
    if out.get("multi_latent_attention") and args.get("rope_type") == "rope":
        _check_plain_rope_scale(args)
        out["rotary_scaling_factor"] = 1.0  # Megatron's MLA: plain RoPE unless rope_type yarn
    freq = args.get("moe_layer_freq")
    if out.get("num_experts") and freq is not None:
        out["moe_layer_freq"] = freq if isinstance(freq, int) else "[" + ",".join(str(int(x)) for x in freq) + "]"
    if not out.get("num_experts"):
        out = {k: v for k, v in out.items() if not k.startswith("moe_")}
    return out


def _check_plain_rope_scale(args: dict) -> None:
    """Megatron's MLA with rope_type ``rope`` rotates by plain RoPE yet keeps YaRN's softmax scale
    ``m(rotary_scaling_factor, mscale_all_dim)^2 / sqrt(d)``; omnitron's MLA ties that scale to YaRN's rotation, so
    only ``m = 1`` imports."""
    from omnitron.core.transformer.yarn import yarn_get_mscale

    factor, all_dim = float(args.get("rotary_scaling_factor") or 1.0), float(args.get("mscale_all_dim") or 0.0)
    m = yarn_get_mscale(factor, all_dim)
    if m != 1.0:
        raise MegatronConversionError(
            f"the checkpoint's args have rope_type='rope' with rotary_scaling_factor={factor} and mscale_all_dim="
            f"{all_dim}: Megatron's MLA then rotates by plain RoPE yet multiplies its softmax scale by {m * m:.6g}, "
            f"which omnitron's MLA does not compute (a scaling factor above 1 runs YaRN here)")


def real_vocab_size(args: dict) -> int:
    """The tokenizer's vocabulary (rows kept on import): Megatron's NullTokenizer adds an end-of-document
    token to ``--vocab-size``; GPT-2's BPE has 50257; otherwise ``vocab_size`` when recorded, else
    ``padded_vocab_size`` (the padding rows are then kept as ordinary, never-seen tokens)."""
    kind, v = args.get("tokenizer_type"), args.get("vocab_size")
    if kind == "NullTokenizer" and v:
        return int(v) + 1
    if kind == "GPT2BPETokenizer" and not v:
        return 50257
    return int(v or _need(args, "padded_vocab_size"))


def args_for(cfg, tp: int, pp: int, iteration: int, run: dict, transformer_impl: str) -> argparse.Namespace:
    """The argparse Namespace a Megatron run of ``cfg`` at ``tp`` x ``pp`` records (the fields its
    checkpoint checks and ``--use-checkpoint-args`` read)."""
    from omnitron.core.models.gpt.config import ffn_size, head_dim, max_positions, padded_vocab_size, query_groups

    tok = run.get("tokenizer_type") or ("GPT2BPETokenizer" if cfg.vocab_size == 50257 else "NullTokenizer")
    dt, gqa = cfg.params_dtype, query_groups(cfg) != cfg.num_attention_heads
    return argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=ffn_size(cfg),
        num_attention_heads=cfg.num_attention_heads, kv_channels=head_dim(cfg),
        group_query_attention=gqa, num_query_groups=query_groups(cfg) if gqa else 1,  # Megatron's default 1
        seq_length=cfg.seq_length, max_position_embeddings=max_positions(cfg),
        tokenizer_type=tok, tokenizer_model=run.get("tokenizer_model"),
        vocab_size=cfg.vocab_size - 1 if tok == "NullTokenizer" else cfg.vocab_size,
        make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by, padded_vocab_size=padded_vocab_size(cfg, tp),
        normalization=cfg.normalization, norm_epsilon=cfg.layernorm_epsilon, swiglu=cfg.swiglu,
        squared_relu=cfg.squared_relu,
        position_embedding_type=cfg.position_embedding_type,
        # NOTE: True as a Megatron launch line without --no-position-embedding has it (its checkpoint-args check
        # compares this flag); Megatron-Core's GPT reads position_embedding_type, so RoPE models are unaffected
        add_position_embedding=True, rotary_base=cfg.rotary_base,
        rotary_percent=cfg.rotary_percent, rotary_interleaved=cfg.rotary_interleaved,
        use_rope_scaling=cfg.rope_scaling_factor != 1.0, rope_scaling_factor=cfg.rope_scaling_factor,
        untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
        add_bias_linear=cfg.add_bias_linear, add_qkv_bias=cfg.add_qkv_bias, qk_layernorm=cfg.qk_layernorm,
        apply_layernorm_1p=cfg.apply_layernorm_1p,
        # Megatron-Core's MLP runs the tanh GeLU iff bias_gelu_fusion and biases (it ignores openai_gelu); its
        # TransformerConfig refuses the fusion with a squared ReLU, which omnitron computes unfused
        bias_gelu_fusion=cfg.bias_gelu_fusion and cfg.add_bias_linear and not cfg.squared_relu, openai_gelu=False,
        hidden_dropout=cfg.hidden_dropout, attention_dropout=cfg.attention_dropout,
        init_method_std=cfg.init_method_std, params_dtype=dt, bf16=dt == torch.bfloat16, fp16=dt == torch.float16,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=None,
        transformer_impl=transformer_impl, use_mcore_models=True, ckpt_format="torch", iteration=iteration,
        consumed_train_samples=0, **_moe_mla_mtp_args(cfg))


def _moe_mla_mtp_args(cfg) -> dict:
    """The MoE / MLA / MTP args of a Megatron run of ``cfg`` (inverse of :func:`_moe_mla_mtp_fields`);
    ``--moe-layer-freq`` as Megatron's parsed list (an int when it is one)."""
    from omnitron.core.transformer.moe.pattern import moe_layer_pattern

    out = {k: getattr(cfg, k) for k in _SAME_NAMED if k not in ("beta_fast", "beta_slow")}
    if cfg.num_experts:
        freq = cfg.moe_layer_freq
        out["moe_layer_freq"] = int(freq) if str(freq).strip().isdigit() else \
            [int(x) for x in moe_layer_pattern(freq, cfg.num_layers)]
    if cfg.position_embedding_type == "yarn" and not cfg.multi_latent_attention:
        out.update({k: getattr(cfg, k) for k in _GQA_YARN})
    if cfg.multi_latent_attention:
        out.update(rope_type="yarn" if cfg.rotary_scaling_factor != 1.0 else "rope",
                   original_max_position_embeddings=cfg.yarn_original_max_position_embeddings or 4096,
                   beta_fast=cfg.yarn_beta_fast or 32.0, beta_slow=cfg.yarn_beta_slow or 1.0)
    return out


# ---- weights ---------------------------------------------------------------------------------
def _merge(name: str, parts: list[torch.Tensor], cfg) -> torch.Tensor:
    """The full tensor of ``name`` from its tp shards (rank order): vocab padding dropped, SwiGLU's
    per-rank ``[gate; up]`` regrouped as all gate rows, then all up rows."""
    dim = _tp_dim(name)
    if dim is None:
        return parts[0]
    if cfg.swiglu and ".linear_fc1." in name:
        halves = [p.chunk(2, 0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    full = torch.cat(parts, dim)
    return full[:cfg.vocab_size] if name in _VOCAB else full


def _split(name: str, t: torch.Tensor, cfg, tp: int) -> list[torch.Tensor]:
    """Inverse of :func:`_merge`: the ``tp`` shards of full tensor ``t`` (vocab rows zero-padded)."""
    from omnitron.core.models.gpt.config import padded_vocab_size

    dim = _tp_dim(name)
    if dim is None:
        return [t.clone() for _ in range(tp)]
    if name in _VOCAB:
        t = torch.cat([t, t.new_zeros(padded_vocab_size(cfg, tp) - t.shape[0], *t.shape[1:])], 0)
    if cfg.swiglu and ".linear_fc1." in name:
        gate, up = t.chunk(2, 0)
        return [torch.cat([g, u], 0) for g, u in zip(gate.chunk(tp, 0), up.chunk(tp, 0))]
    return [s.clone() for s in t.chunk(tp, dim)]


def _to_omnitron_names(sd: dict, offset: int, path: str) -> tuple[dict, int]:
    """(tensors renamed to omnitron's global names, number of layers) of one stage chunk's state dict."""
    out, layers = {}, set()
    for name, t in sd.items():
        if name.endswith("._extra_state") or name.endswith(".inv_freq"):
            continue  # TE's FP8 metadata; RoPE frequencies are recomputed
        if name.startswith("language_model."):
            raise MegatronConversionError(f"{path}: legacy Megatron model names ({name}); the importer reads "
                                          f"Megatron-Core GPTModel checkpoints (--use-mcore-models)")
        name = _MTP_MODEL_LAYER.sub(r"\1transformer_layer.", name)
        m, mtp = _LAYER.match(name), _MTP_LAYER.match(name)
        if m:
            local = int(m.group(1))
            layers.add(local)
            name = f"decoder.layers.{offset + local}.{omnitron_rest(m.group(2))}"
        elif mtp:
            name = mtp.group(1) + omnitron_rest(mtp.group(2))
        if name in out and not torch.equal(out[name], t):
            raise MegatronConversionError(f"{path}: two names of {name} hold different tensors")
        out[name] = t
    if layers != set(range(len(layers))):
        raise MegatronConversionError(f"{path}: the stage's local layer numbers {sorted(layers)} are not 0..n-1")
    return out, len(layers)


def state_from_megatron(shards: dict[tuple[int, int], list[dict]], cfg, path: str, *,
                        whole_experts: bool = False) -> dict:
    """omnitron's full state from :func:`read_shards`' per-rank model state dicts. ``whole_experts``: the routed
    experts are whole on every tp rank (Megatron's --expert-tensor-parallel-size 1), not split like the MLP."""
    tp = 1 + max(t for t, _ in shards)
    pp = 1 + max(p for _, p in shards)
    chunks = len(shards[(0, 0)])
    full, offset = {}, 0
    for c in range(chunks):
        for p in range(pp):
            renamed = [_to_omnitron_names(shards[(t, p)][c], offset, f"{path} stage {p} chunk {c}") for t in range(tp)]
            if not (p == 0 and c == 0) and not cfg.untie_embeddings_and_output_weights:
                for sd, _ in renamed:  # the last stage's copy of the tied embedding
                    sd.pop("output_layer.weight", None)
            for t, (sd, _) in enumerate(renamed):
                if set(sd) != set(renamed[0][0]):
                    odd = sorted(set(sd) ^ set(renamed[0][0]))[0]
                    raise MegatronConversionError(f"{path}: stage {p} tensor ranks 0 and {t} disagree on {odd}; "
                                                  f"the checkpoint is corrupt")
            for name in renamed[0][0]:
                parts = [sd[name] for sd, _ in renamed]
                if whole_experts and ".mlp.experts." in name:
                    parts = parts[:1]  # the same expert on every tp rank
                full[name] = _merge(name, parts, cfg).contiguous()
            offset += renamed[0][1]
    _check_state(full, cfg, path)
    return full


def stage_state_dicts(full: dict, cfg, tp: int, pp: int, transformer_impl: str) -> dict[tuple[int, int], dict]:
    """``{(tp_rank, pp_rank): Megatron-Core model state dict}`` of omnitron full state ``full``
    (even pipeline split, local layer numbers, TE-fused norm names unless ``local``)."""
    from omnitron.core.checkpoint.megatron_dist import _zero_router_extras

    per, te, mla = cfg.num_layers // pp, transformer_impl == "transformer_engine", bool(cfg.multi_latent_attention)
    out = {(t, p): {} for p in range(pp) for t in range(tp)}
    for name, t in {**_zero_router_extras(cfg), **full}.items():
        layer = layer_of(name)
        stages = [layer[1] // per] if layer and layer[1] is not None else [0] if name.startswith("embedding.") \
            else [pp - 1]
        if name == "embedding.word_embeddings.weight" and pp > 1 and not cfg.untie_embeddings_and_output_weights:
            stages.append(pp - 1)  # the last stage's output_layer copy
        for p in stages:
            local = name
            if layer:
                prefix, i, _, rest = layer
                rest = torch_rest(rest, mla=mla, moe=is_moe(cfg, i), te=te)
                local = (prefix if i is None else f"decoder.layers.{i - p * per}.") + rest
            elif p == pp - 1 and p > 0 and name == "embedding.word_embeddings.weight":
                local = "output_layer.weight"
            for r, shard in enumerate(_split(name, t, cfg, tp)):
                out[(r, p)][local] = shard
    if te:
        for sd in out.values():
            sd.update(_te_extra_states(sd))
    return out


def _te_extra_states(sd: dict) -> dict:
    """``None`` for the ``_extra_state`` of every TE module (linears, core attention) of a stage's state dict."""
    groups: dict[str, set[str]] = {}
    for name in sd:
        m = _LAYER.match(name) or _MTP_LAYER.match(name) or re.match(r"^mtp\.layers\.\d+\.(eh_proj\..+)$", name)
        if m:
            rest = m.group(m.lastindex)
            groups.setdefault(name[:len(name) - len(rest)], set()).add(rest)
    return {f"{prefix}{mod}._extra_state": None for prefix, rests in groups.items()
            for mod in extra_state_modules(rests)}


# ---- directories -----------------------------------------------------------------------------
def _tokenizer_settings(args: dict, cfg) -> dict:
    """The run settings ``omnitron generate`` needs to tokenize for the imported model."""
    kind = args.get("tokenizer_type")
    if kind == "GPT2BPETokenizer" and cfg.vocab_size == 50257:
        return {"tokenizer_type": kind}
    if kind == "HuggingFaceTokenizer" and args.get("tokenizer_model"):
        return {"tokenizer_type": kind, "tokenizer_model": args["tokenizer_model"]}
    return {"tokenizer_type": "NullTokenizer", "vocab_size": cfg.vocab_size - 1}  # NullTokenizer adds its eod


def _with_saved_router_bias(cfg, names):
    """``cfg`` with a router bias iff the checkpoint (tensor ``names``) holds one: Megatron-Core's routers have it
    with --add-bias-linear since 0.15, not before."""
    from omnitron.core.models.gpt.config import router_bias

    saved = any(n.endswith("mlp.router.bias") for n in names)
    return cfg if not cfg.num_experts or saved == router_bias(cfg) else dataclasses.replace(cfg, moe_router_bias=saved)


def import_megatron(load: str, save_dir: str, layout, *, vocab_size: int | None = None) -> str:
    """Write the Megatron checkpoint ``load`` (a ``--save`` directory or an ``iter_N`` one) as an
    omnitron checkpoint (iteration 0; weights only, or with the Adam state of its ``distrib_optim.pt`` files:
    :func:`_optimizer_state`) in ``layout``; returns its directory.
    ``vocab_size`` overrides :func:`real_vocab_size` (the rows of the padded vocabulary to keep)."""
    from omnitron.core.checkpoint.hf import write_weights_checkpoint

    iter_dir = resolve_dir(load)
    optimizer = None  # weights only, unless a --ckpt-format torch run saved its distrib_optim.pt
    if megatron_dist.is_torch_dist(iter_dir):
        fmt, (args, tensors) = "torch_dist", megatron_dist.read(iter_dir)
        dtype = tensors.get("embedding.word_embeddings.weight", next(iter(tensors.values()))).dtype
        cfg = _with_saved_router_bias(config_from_megatron(args, vocab_size=vocab_size or real_vocab_size(args),
                                                           dtype=dtype), tensors)
        full = megatron_dist.state_from_tensors(tensors, cfg, iter_dir)
        del tensors
    else:
        fmt, (args, shards) = "torch", read_shards(iter_dir)
        dtype = next(t.dtype for sd in shards[(0, 0)] for t in sd.values() if isinstance(t, torch.Tensor))
        cfg = _with_saved_router_bias(config_from_megatron(args, vocab_size=vocab_size or real_vocab_size(args),
                                                           dtype=dtype),
                                     [n for chunks in shards.values() for sd in chunks for n in sd])
        tp = int(args.get("tensor_model_parallel_size") or 1)
        if tp > 1 and (cfg.multi_latent_attention or cfg.mtp_num_layers):
            raise MegatronConversionError(f"{iter_dir}: an MLA / MTP checkpoint at tensor parallel {tp} in "
                                          f"--ckpt-format torch (its shards depend on the layer spec); re-save it "
                                          f"with --ckpt-format torch_dist or at tp 1")
        whole = tp > 1 and int(args.get("expert_tensor_parallel_size") or tp) == 1
        full = state_from_megatron(shards, cfg, iter_dir, whole_experts=whole)
        optimizer = _optimizer_state(iter_dir, args, shards, cfg, whole)
        del shards
    source = {"megatron_dir": os.path.abspath(iter_dir), "iteration": args.get("iteration"), "ckpt_format": fmt,
              "tensor_model_parallel_size": args.get("tensor_model_parallel_size", 1),
              "pipeline_model_parallel_size": args.get("pipeline_model_parallel_size", 1)}
    return write_weights_checkpoint(full, cfg, save_dir, layout, config=_tokenizer_settings(args, cfg),
                                    optimizer=optimizer, imported_from=source)


def _optimizer_state(iter_dir: str, args: dict, shards: dict, cfg, whole: bool) -> tuple[dict, dict] | None:
    """The distributed optimizer's Adam state of a ``--ckpt-format torch`` checkpoint (every rank's
    ``distrib_optim.pt``: :mod:`~omnitron.core.checkpoint.megatron_optim`) as full-state moments and fp32 masters by
    omnitron name, with the step count of rank 0's ``model_optim_rng.pt``; None without those files."""
    from omnitron.core.checkpoint.megatron_optim import read_rank_moments

    per_rank = read_rank_moments(iter_dir, args, shards, rank_dir)
    if per_rank is None:
        return None
    path = os.path.join(iter_dir, rank_dir(0, 0, int(args.get("pipeline_model_parallel_size") or 1)), FILE)
    groups = ((checkpoint_dict(load_file(path), path).get("optimizer") or {}).get("optimizer") or {}).get(
        "param_groups") or [{}]
    steps = {g.get("step") for g in groups if isinstance(g, dict)} - {None}
    if len(steps) != 1 or not all(isinstance(s, (int, float)) or torch.is_tensor(s) for s in steps):
        raise MegatronConversionError(f"{path}: its optimizer's param_groups record no single Adam step count "
                                      f"({sorted(map(str, steps))}); import the weights only by removing the "
                                      f"distrib_optim.pt files")
    state = {"master" if key == "param" else key: state_from_megatron(d, cfg, iter_dir, whole_experts=whole)
             for key, d in per_rank.items()}
    return state, {"step": int(next(iter(steps))), "optimizer": "adam"}


def export_megatron(path: str, out_dir: str, tp: int, pp: int, *, transformer_impl: str = "transformer_engine",
                    ckpt_format: str = "torch_dist") -> str:
    """Write omnitron checkpoint directory ``path`` (any layout) as a Megatron checkpoint of a run at
    ``tp`` x ``pp`` under ``out_dir``, in ``ckpt_format`` (``torch_dist``, Megatron's default:
    :mod:`~omnitron.core.checkpoint.megatron_dist`; or ``torch``, one file per rank): model weights,
    args, iteration; no optimizer or RNG state (load it in Megatron with ``--finetune`` or
    ``--no-load-optim --no-load-rng``). Returns the iteration directory. Written to ``iter_N.tmp``
    and renamed, then the tracker file."""
    from omnitron.core.checkpoint.reshard import model_config, read_full_state
    from omnitron.core.models.gpt.config import GPTConfig

    full = read_full_state(path, with_optimizer=False)
    cfg, it = model_config(full.meta["model"]), int(full.meta["iteration"])
    if type(cfg) is not GPTConfig:
        raise MegatronConversionError(f"{path} holds a {type(cfg).__name__} model; only GPT models export to Megatron")
    if ckpt_format not in ("torch", "torch_dist"):
        raise MegatronConversionError(f"--ckpt-format {ckpt_format!r}: use torch_dist or torch")
    _check_exportable(cfg, tp, pp, transformer_impl, ckpt_format)
    args = args_for(cfg, tp, pp, it, full.meta.get("config", {}), transformer_impl)
    args.ckpt_format = ckpt_format
    final = os.path.join(out_dir, f"iter_{it:07d}")
    if os.path.exists(final):
        raise MegatronConversionError(f"{final} exists already; remove it or choose another --out")
    if ckpt_format == "torch_dist":
        return megatron_dist.write(full.model, cfg, args, out_dir, it, tp)
    _write_rank_files(full.model, cfg, args, out_dir, it, tp, pp, transformer_impl)
    return final


def _write_rank_files(full: dict, cfg, args, out_dir: str, it: int, tp: int, pp: int, transformer_impl: str) -> None:
    """``--ckpt-format torch``: one ``model_optim_rng.pt`` per rank into ``iter_N.tmp``, renamed, then the tracker."""
    final = os.path.join(out_dir, f"iter_{it:07d}")
    for (t, p), sd in stage_state_dicts(full, cfg, tp, pp, transformer_impl).items():
        os.makedirs(os.path.join(final + ".tmp", rank_dir(t, p, pp)), exist_ok=True)
        ckpt = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": it, "model": sd}
        _write_file(os.path.join(final + ".tmp", rank_dir(t, p, pp), FILE), lambda f, c=ckpt: torch.save(c, f))
    commit_iteration(out_dir, it)


def _check_exportable(cfg, tp: int, pp: int, transformer_impl: str, ckpt_format: str = "torch") -> None:
    """Raise naming the flag when Megatron's layout cannot hold ``cfg`` at ``tp`` x ``pp``."""
    from omnitron.core.models.gpt.config import ffn_size, query_groups, router_bias

    if tp < 1 or pp < 1:
        raise MegatronConversionError(f"--target-tensor-model-parallel-size {tp} / --target-pipeline-model-parallel-"
                                      f"size {pp}: both must be >= 1")
    groups = query_groups(cfg)
    checks = [(transformer_impl in ("transformer_engine", "local"),
               f"--transformer-impl {transformer_impl!r}: use transformer_engine or local"),
              (tp == 1 or ckpt_format == "torch_dist" or not (cfg.multi_latent_attention or cfg.mtp_num_layers),
               f"--target-tensor-model-parallel-size {tp} with --ckpt-format torch: MLA's down projections and MTP's "
               f"eh_proj split differently under Megatron's TE and local specs; use --ckpt-format torch_dist"),
              (cfg.add_bias_linear or not router_bias(cfg), "a router bias without --add-bias-linear: "
               "Megatron-Core's TopKRouter has one exactly with --add-bias-linear"),
              (not (cfg.window_size or cfg.softmax_type != "vanilla" or cfg.quick_geglu or cfg.glu_linear_offset
                    or cfg.activation_func_clamp_value is not None),
               "sliding windows, attention sinks and gpt-oss's clamped SwiGLU do not export to Megatron yet"),
              (cfg.num_layers % pp == 0 or ckpt_format == "torch_dist",  # torch_dist is whole over pp
               f"--target-pipeline-model-parallel-size {pp}: the model's {cfg.num_layers} "
               f"layers do not split evenly over {pp} stages (Megatron's torch checkpoints); pick a divisor"),
              (groups % tp == 0 and ffn_size(cfg) % tp == 0 and cfg.num_attention_heads % tp == 0,
               f"--target-tensor-model-parallel-size {tp}: Megatron splits whole query groups ({groups}), heads "
               f"({cfg.num_attention_heads}) and --ffn-hidden-size ({ffn_size(cfg)}) over tp; pick a divisor")]
    for ok, why in checks:
        if not ok:
            raise MegatronConversionError(why)
