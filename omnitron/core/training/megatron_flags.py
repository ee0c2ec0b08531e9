"""Megatron-LM flags with no field of their own, so that a Megatron launch script runs unchanged.

Three kinds:

* **aliases** onto omnitron's settings (``--use-rotary-position-embeddings`` is
  ``--position-embedding-type rope``; ``--recompute-activations`` is ``--recompute-granularity selective``;
  ``--lr-warmup-fraction F`` sets the warm-up to ``F`` of the
  decay iterations, as Megatron does; ``--group-query-attention`` asks for ``--num-query-groups``);
* **implementation selectors** (``--use-flash-attn``, ``--transformer-impl``, ``--no-masked-softmax-fusion``,
  ...): omnitron picks the fused kernel per backend itself (``omnitron info`` lists them), so these are
  accepted and each says in one line what runs instead, and gives the reason the trained model is the one
  Megatron's run with the flag trains (a flag that would change the maths is not a selector);
* **refused** flags: Megatron computes something omnitron does not; each stops before any work with the reason.

docs/megatron-flags.md is the audit of every such flag (:mod:`omnitron.core.training.megatron_audit` writes it).

:func:`add_megatron_flags` puts them in their own help group; :func:`translate` turns the given values
into omnitron's (called on command-line and config-file settings alike) and returns the lines to log.
A contradiction (an alias against the setting it stands for) is a :class:`ConfigError` naming both.
"""
from __future__ import annotations

import argparse
from typing import Any

from omnitron.core.config.parallel import ConfigError

_KERNELS = "the backend's kernel table picks the fused kernels (see `omnitron info`)"
_FUSED = ("a fused kernel computes the function its unfused form does (each kernel is tested against its "
          "plain-torch reference, tests/kernels)")
_PERF = "it chooses how the work is scheduled or communicated, not what is computed"
_LOG = "it changes what is logged, not what is trained"
SELECTORS: dict[str, tuple[str | None, str, str]] = {
    # dest: (metavar for a flag with a value, or None for a switch; what runs instead; why the trained model is
    # the one Megatron's run with the flag trains). A flag that changes the maths has a field of its own
    # (--no-bias-gelu-fusion, --grad-reduce-in-bf16) or is in REFUSED: docs/megatron-flags.md is this table.
    "use_flash_attn": (None, "attention runs the backend's fused attention where it has one", _FUSED),
    "attention_backend": ("NAME", "attention runs the backend's fused attention where it has one", _FUSED),
    "transformer_impl": ("NAME", "omnitron's own transformer layers run (no Transformer Engine binding)",
                         "Transformer Engine's and Megatron's local layers compute the same layer"),
    "use_mcore_models": (None, "omnitron's models are Megatron-Core's layout already", "it is the only layout"),
    "no_masked_softmax_fusion": (None, _KERNELS, _FUSED),
    "no_bias_swiglu_fusion": (None, _KERNELS, _FUSED + "; SwiGLU has no approximation, fused or not"),
    "no_bias_dropout_fusion": (None, _KERNELS, _FUSED),
    "no_rope_fusion": (None, _KERNELS, _FUSED),
    "no_persist_layer_norm": (None, _KERNELS, _FUSED),
    "no_gradient_accumulation_fusion": (None, "gradients accumulate into the main_grad buffers as always",
                                        "Megatron accumulates into the same buffers either way"),
    "attention_softmax_in_fp32": (None, "the softmax is computed in fp32 always", "the flag asks for exactly that"),
    "apply_query_key_layer_scaling": (None, "the softmax is computed in fp32 always (what this scaling protects "
                                            "fp16 from)", "Megatron divides the scores by the layer number and "
                                      "multiplies them back inside the fp32 softmax: the same function"),
    "apply_residual_connection_post_layernorm": (None, "nothing: each layer adds its residual before the norm, as "
                                                       "megatron-core's layers do",
                                                 "megatron-core's TransformerLayer never reads it (d98e8a6: only "
                                                 "TransformerConfig holds the field; legacy models used it), so "
                                                 "Megatron's run with it trains the pre-norm model "
                                                 "(tests/models/test_gpt_flags_megatron.py)"),
    "cross_entropy_loss_fusion": (None, _KERNELS, _FUSED),
    "moe_token_dispatcher_type": ("TYPE", "tokens go to their experts by all-to-all over the expert-parallel group",
                                  "Megatron's allgather, alltoall and flex dispatchers move the same routed tokens "
                                  "to the same experts and combine them with the same weights; " + _PERF),
    "no_create_attention_mask_in_dataloader": (None, "the data loader never builds attention masks (causal "
                                                     "attention needs none)", _PERF),
    "no_mmap_bin_files": (None, "the .bin files are read through a read-only memory map",
                          "the same bytes are read either way"),
    "num_dataset_builder_threads": ("N", "the builder rank builds the datasets' index caches one after another",
                                    "each dataset's indices depend on its own files, split and sample count, not on "
                                    "the order they are built in: " + _PERF),
    "no_async_tensor_model_parallel_allreduce": (None, "tensor-parallel all-reduces run in issue order", _PERF),
    "tp_comm_overlap": (None, "tensor-parallel communication is not overlapped with the GEMMs (no userbuffers)",
                        _PERF + "; only the speed differs"),
    "distributed_backend": ("NAME", "the backend's own collectives library is used (OMNITRON_BACKEND / --backend "
                                    "picks the backend)", _PERF),
    "ckpt_fully_parallel_save": (None, "every rank writes its own share of a torch_dist checkpoint (replicated "
                                       "tensors spread over the data-parallel ranks)",
                                 "Megatron deprecated the flag: it has no effect there (parallel save is its default)"),
    "ckpt_fully_parallel_load": (None, "every rank reads only the pieces of the checkpoint it holds",
                                 "the same tensors are loaded; Megatron reads each once per data-parallel group "
                                 "and exchanges them: " + _PERF),
    "log_batch_size_to_tensorboard": (None, "TensorBoard and W&B get batch-size always (every record carries "
                                            "global_batch_size)", "Megatron writes batch-size always since it dropped "
                                            "the flag (07659f9, 2024-07; the snapshot d98e8a6 has no such flag): "
                                            + _LOG),
    "moe_per_layer_logging": (None, "every record carries moe_aux_loss: the router losses added to the LM loss "
                                    "(each load-balancing loss times its coefficient, plus the z-loss), summed over "
                                    "the MoE layers, not one value per layer", _LOG),
    "tensorboard_log_interval": ("N", "TensorBoard gets every record, at --log-interval", _LOG),
    "tensorboard_queue_size": ("N", "the TensorBoard writer's own queue size is used", _LOG),
    "use_pytorch_profiler": (None, "--profile always traces with torch.profiler", _LOG),
    "fp8_interval": ("N", "FP8 scaling factors are updated every step (Megatron deprecated the interval)",
                     "Megatron ignores the interval too (deprecated, scaling factors update every step)"),
    "rerun_mode": ("MODE", "no iteration is ever re-run (Megatron's 'disabled')",
                   "only 'disabled' is accepted, which re-runs nothing in Megatron either"),
    "recompute_modules": ("MODULE", "selective recomputation (--recompute-granularity selective) recomputes core "
                                    "attention; the modules named keep their activations",
                          "recomputing a module computes again the values its forward computed (dropout masks "
                          "kept), so the gradients are the same; only the memory differs. What Megatron refuses "
                          "under selective recomputation is refused: an unknown module, moe_act without "
                          "--moe-grouped-gemm, mla_up_proj without --multi-latent-attention, ..."),
    "moe_flex_dispatcher_backend": ("NAME", "tokens go to their experts by all-to-all over the expert-parallel "
                                            "group", "DeepEP and HybridEP move the same routed tokens as the "
                                    "all-to-all dispatcher; " + _PERF),
    "moe_permute_fusion": (None, "tokens are permuted to their experts by index gathers",
                           "a fused permutation moves the same rows to the same places"),
    "muon_scalar_optimizer": ("adam", "the parameters Muon does not take (embeddings, output layer, norms, biases) "
                                      "step with AdamW", "Megatron's adam there is the same AdamW (its default); "
                                      "lion is refused in one line"),
    "muon_use_syrk": (None, "Muon's Newton-Schulz Gram matrices X X^T and A A are ordinary matmuls",
                      "Megatron's Triton SYRK kernel computes the same symmetric products (one triangle, mirrored)"),
    "auto_detect_ckpt_format": (None, "--load reads the format a checkpoint records in its own metadata",
                                "the same tensors are read from a checkpoint of either format"),
    "dist_ckpt_strictness": ("MODE", "a key the model needs and the checkpoint lacks stops the load; keys the "
                                     "model lacks are not read", "a checkpoint holding the model's keys loads the "
                             "same tensors under every mode; a mismatch stops here instead of loading part"),
    "logging_level": ("LEVEL", "omnitron's log lines keep their own levels", _LOG),
    "enable_experimental": (None, "nothing in omnitron is gated by it",
                            "in Megatron it unlocks experimental code paths (fused permutation, ...) that compute "
                            "what the default paths compute"),
    "export_force_local_attention": (None, "attention runs the backend's fused attention where it has one",
                                     "a ModelOpt switch between Megatron's local and Transformer Engine's core "
                                     "attention, which compute the same attention; " + _FUSED),
    "cross_entropy_fusion_impl": ("NAME", _KERNELS, _FUSED + "; Megatron's native and TE implementations compute "
                                              "the same vocab-parallel cross-entropy"),
    "use_nccl_ub": (None, "collectives run on the backend's library with its own buffers (no NCCL user buffers)",
                    _PERF),
    "use_cpu_initialization": (None, "every weight is initialised whole, from a layout-independent full tensor, "
                                     "and each rank keeps its slice (as always)",
                               "it chooses where the initial weights are computed; whole on the CPU is how "
                               "Megatron gets a start that does not depend on the tensor-parallel size (each "
                               "pipeline stage still draws from its own seed + 100 x pp rank, so Megatron's start "
                               "changes with the pipeline size); omnitron's is the same at every layout"),
    "use_precision_aware_optimizer": (None, "Adam's moments are stored in --exp-avg-dtype / --exp-avg-sq-dtype "
                                            "(fp32, bf16 or fp16), the main parameters in fp32 (under --bf16 as "
                                            "int16 remainders beside the bf16 parameters, as Megatron's default "
                                            "store_param_remainders), the main gradients in --main-grads-dtype",
                                      "Megatron's precision-aware optimizer (Transformer Engine's FusedAdam) reads "
                                      "each moment as fp32, steps in fp32 and writes it back in its dtype (fp16 "
                                      "scaled per tensor), as omnitron does; fp8 moments and --main-params-dtype "
                                      "fp16 are refused in one line, and so is the flag without "
                                      "--use-distributed-optimizer or with another --optimizer than adam, as "
                                      "Megatron refuses it"),
    "num_distributed_optimizer_instances": ("N", "the distributed optimizer shards its state over the whole "
                                                 "data-parallel group (one instance)",
                                            "Megatron's N instances each shard over dp / N ranks and all-reduce "
                                            "gradients between them: the same Adam step on the same gradients; "
                                            "only memory and communication differ"),
    "enable_gpt_oss": (None, "nothing: a ModelOpt flag, which pretrain_gpt.py applies (YaRN factor 32 over 131072 "
                             "positions) only while building from a ModelOpt checkpoint; omnitron reads none, so give "
                             "YaRN as --position-embedding-type yarn --rotary-scaling-factor F "
                             "--yarn-original-max-position-embeddings N",
                       "Megatron's run that loads no ModelOpt checkpoint builds the same model with or without it"),
}
NARGS = {"recompute_modules": "+"}
"""Selectors that take several values (Megatron's nargs)."""
ALIASES: dict[str, tuple[str, dict]] = {
    # dest: (help, argparse keywords)
    "group_query_attention": ("with --num-query-groups N: grouped-query attention (omnitron reads "
                              "--num-query-groups alone too)", {"action": "store_true"}),
    "use_rotary_position_embeddings": ("same as --position-embedding-type rope", {"action": "store_true"}),
    "recompute_activations": ("same as --recompute-granularity selective", {"action": "store_true"}),
    "lr_warmup_fraction": ("warm up over this fraction of --lr-decay-iters (else --train-iters; with --train-samples: "
                           "of --lr-decay-samples, else --train-samples), as Megatron",
                           {"type": float, "metavar": "F"}),
    "norm_epsilon": ("same as --layernorm-epsilon (Megatron's newer spelling)", {"type": float, "metavar": "EPS"}),
    "use_rope_scaling": ("Llama 3.1 RoPE scaling: --rope-scaling-factor (8 unless given; the factor without this "
                         "switch is refused, as Megatron then does not scale)", {"action": "store_true"}),
    "no_position_embedding": ("no learned absolute position embedding: needs --position-embedding-type rope or "
                              "yarn",
                              {"action": "store_true"}),
    "dataloader_type": ("single (the only order omnitron reads in: each sample once per pass, from the checkpoint's "
                        "data position on)", {"metavar": "TYPE"}),
    "freeze_LM": ("same as --freeze-language-model (LLaVA)", {"action": "store_true"}),
    "freeze_ViT": ("same as --freeze-vision-model (LLaVA)", {"action": "store_true"}),
    "disable_vision_class_token": ("LLaVA's: the ViT keeps its class token and drops its output before the "
                                   "projector, which omnitron always does (--no-vision-class-token removes the "
                                   "token)", {"action": "store_true"}),
    "tiktoken_special_tokens": ("same as --tokenizer-special-tokens (Megatron's older spelling)",
                                {"nargs": "+", "metavar": "TOKEN"}),
    "special_tokens": ("same as --tokenizer-special-tokens (Megatron's multimodal spelling)",
                       {"nargs": "+", "metavar": "TOKEN"}),
    "exit_signal_handler": ("SIGTERM / SIGINT finish the step, save and exit (on by default: --no-save-on-signal "
                            "turns it off); an evaluation under way ends between its batches, unlogged (Megatron's "
                            "evaluate does so for --exit-duration-in-mins alone)", {"action": "store_true"}),
    "main_grads_dtype": ("bf16: gradients accumulate and reduce in the bf16 main_grad buffers (with --bf16, as "
                         "--grad-reduce-in-bf16; Megatron's only use of it); fp32: the default; needs "
                         "--use-precision-aware-optimizer", {"choices": ["fp32", "bf16"], "metavar": "DTYPE"}),
    "main_params_dtype": ("fp32 only: the main parameters are fp32 (fp16, Transformer Engine's scaled fp16 master "
                          "weights, is refused in one line)", {"choices": ["fp32", "fp16"], "metavar": "DTYPE"}),
    "rope_type": ("yarn: multi-latent attention's YaRN of --rotary-scaling-factor (its default); rope: MLA's plain "
                  "RoPE, the factor unused (refused where Megatron would still scale the softmax by "
                  "m(--rotary-scaling-factor, --mscale-all-dim)^2); without MLA rope only",
                  {"choices": ["rope", "yarn"], "metavar": "KIND"}),
}
REFUSED: dict[str, tuple[str | None, str]] = {
    # dest: (metavar, or None for a switch; why it stops here and the fix). Megatron flags that change the
    # maths in a way omnitron does not implement yet: refused before any work, never silently ignored.
    "use_legacy_models": (None, "omnitron's models have Megatron-Core's layout only; drop the flag"),
    "rotary_seq_len_interpolation_factor": ("F", "linear position interpolation is not implemented (--rope-scaling-"
                                                 "factor is Llama 3.1's scaling); drop the flag"),
    "no_save_optim": (None, "checkpoints always hold the optimizer state (resume needs it; --finetune loads "
                            "weights only); drop the flag"),
    "no_save_rng": (None, "checkpoints always hold the RNG states (--no-load-rng ignores them); drop the flag"),
    "moe_router_force_load_balancing": (None, "Megatron routes on random logits (a benchmark of balanced "
                                              "experts), not the router's; omnitron trains the router; drop the "
                                              "flag"),
    "fp8_param_gather": (None, "omnitron keeps the parameters in the training dtype and casts them to FP8 in each "
                               "linear, Megatron keeps them in FP8 (rounded once from the fp32 master, not twice "
                               "through bf16), so the FP8 weights differ; drop the flag (the FP8 recipe still runs)"),
}
KEYS = frozenset(SELECTORS) | frozenset(ALIASES) | frozenset(REFUSED)
"""Setting names these flags add (also accepted as config-file keys)."""


def add_megatron_flags(parser: argparse.ArgumentParser) -> None:
    """Add every flag of this module to ``parser`` (defaults suppressed, as for the other flags)."""
    group = parser.add_argument_group("Megatron compatibility (accepted so that Megatron scripts run)")
    for dest, (metavar, instead, _) in SELECTORS.items():
        flag = "--" + dest.replace("_", "-")
        if metavar is None:
            group.add_argument(flag, dest=dest, action="store_true", help=f"accepted: {instead}")
        else:
            group.add_argument(flag, dest=dest, metavar=metavar, nargs=NARGS.get(dest), help=f"accepted: {instead}")
    for dest, (text, kwargs) in ALIASES.items():
        group.add_argument("--" + dest.replace("_", "-"), dest=dest, help=text, **kwargs)
    for dest, (metavar, why) in REFUSED.items():
        kwargs = {"action": "store_true"} if metavar is None else {"metavar": metavar}
        group.add_argument("--" + dest.replace("_", "-"), dest=dest, help=f"refused: {why}", **kwargs)


def check_command_line(given: dict[str, Any], file_values: dict[str, Any]) -> None:
    """Flag combinations of a command line that Megatron refuses or reads otherwise than omnitron's fields do
    (a config file keeps omnitron's spelling, where a validated model holds both): :func:`_check_rope_scaling`,
    ``--quick-geglu`` beside ``--swiglu``, which Megatron asserts against (argument_utils.py), and
    :func:`_check_activation_fusion`."""
    _check_rope_scaling(given, file_values)
    if given.get("quick_geglu") and given.get("swiglu"):
        raise ConfigError("--quick-geglu with --swiglu: Megatron refuses the two together (--quick-geglu is a gated "
                          "MLP of its own, quick GeLU in place of SiLU); drop --swiglu")
    _check_activation_fusion(given, file_values)


def _check_activation_fusion(given: dict[str, Any], file_values: dict[str, Any]) -> None:
    """Megatron's fused bias-activation (``bias_activation_fusion``: --bias-swiglu-fusion under --swiglu, else
    --bias-gelu-fusion, which --disable-bias-linear turns off) takes GeLU, SiLU or quick GeLU and no
    ``--glu-linear-offset`` but quick GeGLU's (transformer_config.py): its run stops on --squared-relu and on a
    --swiglu offset while the fusion is on. omnitron computes both unfused, but a command line Megatron refuses
    is refused here too, naming the flag that makes it Megatron's."""
    def setting(key: str, default: Any) -> Any:
        return given.get(key, file_values.get(key, default))

    if given.get("squared_relu") and setting("add_bias_linear", True) and setting("bias_gelu_fusion", True):
        raise ConfigError("--squared-relu with biases: Megatron's fused bias-GeLU (on by default) refuses a squared "
                          "ReLU; add --no-bias-gelu-fusion (or --disable-bias-linear)")
    offset = given.get("glu_linear_offset")
    if given.get("swiglu") and offset and not setting("no_bias_swiglu_fusion", False):
        raise ConfigError(f"--glu-linear-offset {offset:g} with --swiglu: Megatron's fused bias-SwiGLU (on by default) "
                          "refuses an offset; add --no-bias-swiglu-fusion")


def _check_rope_scaling(given: dict[str, Any], file_values: dict[str, Any]) -> None:
    """Megatron's ``--rope-scaling-factor`` acts only with ``--use-rope-scaling`` (its default 8 stands unused
    otherwise), while omnitron's field scales by any factor but 1: a command line giving the factor alone
    (a Megatron script's, or omnitron's own former spelling) would train another model than Megatron's, so it
    stops here. Config files keep omnitron's spelling (``rope_scaling_factor: 8`` scales)."""
    factor = given.get("rope_scaling_factor")
    if factor in (None, 1.0) or given.get("use_rope_scaling") or file_values.get("use_rope_scaling"):
        return
    raise ConfigError(f"--rope-scaling-factor {factor:g} without --use-rope-scaling: Megatron applies no RoPE scaling "
                      f"then (the factor acts only with the switch); add --use-rope-scaling to scale by {factor:g}, "
                      "or drop the factor")


def translate(given: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``given`` with this module's settings replaced by omnitron's; and one line per selector to log."""
    for key, (_, why) in REFUSED.items():
        if given.get(key):
            raise ConfigError(f"--{key.replace('_', '-')}: {why}")
    out = {k: v for k, v in given.items() if k not in KEYS}
    notes = [f"--{k.replace('_', '-')}: accepted; {SELECTORS[k][1]}" for k in SELECTORS if given.get(k)]
    if given.get("group_query_attention") and not given.get("num_query_groups"):
        raise ConfigError("--group-query-attention needs --num-query-groups N (the key/value heads)")
    _alias(out, given, "use_rotary_position_embeddings", "position_embedding_type", "rope")
    _alias(out, given, "recompute_activations", "recompute_granularity", "selective")
    _alias(out, given, "exit_signal_handler", "save_on_signal", True)
    for key in ("tiktoken_special_tokens", "special_tokens"):
        if given.get(key):
            _alias(out, given, key, "tokenizer_special_tokens", list(given[key]))
    _alias(out, given, "freeze_LM", "freeze_language_model", True)
    _alias(out, given, "freeze_ViT", "freeze_vision_model", True)
    _alias(out, given, "disable_vision_class_token", "vision_class_token", True)  # Megatron: token kept, output dropped
    if given.get("norm_epsilon") is not None:
        _alias(out, given, "norm_epsilon", "layernorm_epsilon", given["norm_epsilon"])
    if given.get("use_rope_scaling") and given.get("rope_scaling_factor") is None:
        out["rope_scaling_factor"] = 8.0  # Megatron's default factor
    if given.get("rerun_mode") not in (None, "disabled"):
        raise ConfigError(f"--rerun-mode {given['rerun_mode']}: omnitron re-runs no iteration (only 'disabled'); "
                          "--check-for-nan-in-loss-and-grad stops on a non-finite loss instead")
    if given.get("muon_scalar_optimizer") not in (None, "adam"):
        raise ConfigError(f"--muon-scalar-optimizer {given['muon_scalar_optimizer']}: omnitron steps the parameters "
                          "Muon does not take with AdamW only; drop the flag or give adam")
    if given.get("dataloader_type") not in (None, "single"):
        raise ConfigError(f"--dataloader-type {given['dataloader_type']}: omnitron reads in Megatron's 'single' order "
                          "only (each sample once per pass); drop the flag or use --dataloader-type single")
    if given.get("tensorboard_dir"):  # Megatron's events directory; metrics.jsonl goes there too unless --log-dir
        out.setdefault("log_dir", given["tensorboard_dir"])
        out.setdefault("tensorboard", True)
    for key in ("lr_warmup_fraction", "no_position_embedding", "rope_type", "recompute_modules",  # resolved later
                "moe_token_dispatcher_type", "use_precision_aware_optimizer", "main_grads_dtype", "main_params_dtype"):
        if key in given:
            out[key] = given[key]
    return out, notes


RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts",
                     "gdn_norm_out", "gdp_in_proj", "gdp_qkv", "mhc")
"""Megatron's names for --recompute-modules (TransformerConfig at d98e8a6)."""


def _recompute_module_conflict(name: str, merged: dict[str, Any]) -> str | None:
    """Why Megatron's TransformerConfig refuses module ``name`` with these settings (None: it accepts it)."""
    if name == "moe_act" and not merged.get("moe_grouped_gemm"):
        return "Megatron recomputes the MoE activation only with --moe-grouped-gemm; add it or drop moe_act"
    if name == "mla_up_proj" and not merged.get("multi_latent_attention"):
        return "Megatron recomputes the MLA up-projection only with --multi-latent-attention; drop mla_up_proj"
    if name == "gdn_norm_out":
        return "Megatron recomputes it only with a gated delta net attention variant, which omnitron has not"
    if name == "mhc":
        return "Megatron recomputes it only with --enable-mhc-connections, which omnitron has not"
    if name == "shared_experts" and merged.get("moe_shared_expert_intermediate_size") and \
            merged.get("moe_shared_expert_overlap"):
        return "Megatron cannot recompute shared experts under --moe-shared-expert-overlap; drop one of them"
    if name in ("moe_act", "layernorm") and merged.get("fp8_format") and \
            merged.get("fp8_recipe", "delayed") == "delayed":
        return "Megatron refuses it with the delayed FP8 recipe; drop it or use another --fp8-recipe"
    return None


def _check_recompute_modules(names: list[str] | None, merged: dict[str, Any]) -> None:
    """--recompute-modules under --recompute-granularity selective: the names and combinations Megatron refuses
    are refused here too (what omnitron recomputes is the SELECTORS entry's; only the memory differs)."""
    if not names or merged.get("recompute_granularity") != "selective":
        return  # Megatron reads the list with selective recomputation only
    for name in names:
        if name not in RECOMPUTE_MODULES:
            raise ConfigError(f"--recompute-modules {name!r} is not one of Megatron's modules: "
                              f"{', '.join(RECOMPUTE_MODULES)}")
        why = _recompute_module_conflict(name, merged)
        if why:
            raise ConfigError(f"--recompute-modules {name}: {why}")


def _check_moe_overlap(merged: dict[str, Any], dispatcher: str | None, modules: list[str] | None) -> None:
    """What Megatron's TransformerConfig refuses beside --overlap-moe-expert-parallel-comm among this module's
    selectors (the model's own limits: gpt/validate.py): --moe-token-dispatcher-type allgather, and moe in
    --recompute-modules. (Megatron's default dispatcher is allgather; omnitron's is all-to-all whatever the flag
    says, so only an allgather given is refused.)"""
    if not merged.get("overlap_moe_expert_parallel_comm"):
        return
    if dispatcher not in (None, "alltoall", "flex"):
        raise ConfigError(f"--overlap-moe-expert-parallel-comm overlaps the all-to-all dispatcher's communication: "
                          f"Megatron refuses it with --moe-token-dispatcher-type {dispatcher}; use "
                          f"--moe-token-dispatcher-type alltoall")
    if "moe" in (modules or []):
        raise ConfigError("--overlap-moe-expert-parallel-comm with --recompute-modules moe: Megatron refuses "
                          "recomputing the MoE layer under the overlap; drop moe from --recompute-modules")


def resolve(merged: dict[str, Any]) -> dict[str, Any]:
    """What needs the merged settings (preset, file and flags): ``--lr-warmup-fraction F`` as warm-up iterations
    or samples; ``--no-position-embedding`` only with RoPE; ``--rope-type`` (:func:`_rope_type`);
    ``--recompute-modules`` checked as Megatron does."""
    modules = merged.pop("recompute_modules", None)
    _check_recompute_modules(modules, merged)
    _check_moe_overlap(merged, merged.pop("moe_token_dispatcher_type", None), modules)
    _check_precision_aware(merged, merged.pop("use_precision_aware_optimizer", False))
    rotary = merged.get("position_embedding_type") in ("rope", "yarn")
    if merged.pop("no_position_embedding", False) and not rotary:
        raise ConfigError("--no-position-embedding needs --position-embedding-type rope or yarn (omnitron's GPT has "
                          "no position-free variant)")
    _rope_type(merged, merged.pop("rope_type", None))
    fraction = merged.pop("lr_warmup_fraction", None)
    if fraction is None:
        return merged
    if not 0.0 <= fraction < 1.0:  # Megatron's scheduler asserts warm-up < decay: a fraction of 1 is refused
        raise ConfigError(f"--lr-warmup-fraction must lie in [0, 1) (a fraction of the decay; the warm-up must end "
                          f"before it), got {fraction}")
    unit = "samples" if merged.get("train_samples") else "iters"
    if merged.get(f"lr_warmup_{unit}"):
        raise ConfigError(f"give --lr-warmup-fraction or --lr-warmup-{unit}, not both")
    from omnitron.core.config.training import TrainingConfig

    total = merged.get("train_samples") or merged.get("train_iters") or TrainingConfig.train_iters
    decay = merged.get(f"lr_decay_{unit}") or total
    warmup = fraction * decay  # Megatron: lr_warmup_steps = fraction * lr_decay_steps, not rounded
    merged[f"lr_warmup_{unit}"] = int(warmup) if warmup == int(warmup) else warmup
    return merged


def _check_precision_aware(merged: dict[str, Any], given: bool) -> None:
    """Megatron's --use-precision-aware-optimizer runs with --optimizer adam and the distributed optimizer only
    (OptimizerConfig asserts the first, get_megatron_optimizer raises on the second), and its dtype flags need it
    (OptimizerConfig asserts fp32 without it): refused elsewhere as there. ``--main-grads-dtype bf16`` keeps
    validate_args from switching on fp32 accumulation under --bf16: omnitron's --grad-reduce-in-bf16."""
    grads, params = merged.pop("main_grads_dtype", "fp32"), merged.pop("main_params_dtype", "fp32")
    lowered = [f"--{k.replace('_', '-')} {v}" for k, v in (("main_grads_dtype", grads), ("main_params_dtype", params),
               ("exp_avg_dtype", merged.get("exp_avg_dtype", "fp32")),
               ("exp_avg_sq_dtype", merged.get("exp_avg_sq_dtype", "fp32"))) if v != "fp32"]
    if lowered and not given:
        raise ConfigError(f"{lowered[0]} needs --use-precision-aware-optimizer (Megatron keeps the optimizer in fp32 "
                          "without it); add the flag or drop the dtype")
    if not given:
        return
    if merged.get("optimizer", "adam") != "adam":
        raise ConfigError(f"--use-precision-aware-optimizer: Megatron runs it with --optimizer adam only, not "
                          f"{merged['optimizer']}; drop the flag or use --optimizer adam")
    if merged.get("use_torch_fsdp2"):
        raise ConfigError("--use-precision-aware-optimizer with --use-torch-fsdp2: Megatron runs the former with its "
                          "distributed optimizer only, which the latter excludes; drop one of them")
    if not merged.get("use_distributed_optimizer"):
        raise ConfigError("--use-precision-aware-optimizer: Megatron runs it with the distributed optimizer only; add "
                          "--use-distributed-optimizer or drop the flag")
    if params != "fp32":
        raise ConfigError(f"--main-params-dtype {params}: Transformer Engine's scaled fp16 master weights are not "
                          "implemented; drop the flag (fp32 main parameters)")
    # Megatron (TE >= 2.1): bf16 parameters keep fp32 masters as remainders unless it manages the masters itself
    # (FP8 recipes other than delayed)
    fp8_own = merged.get("fp8_format") is not None and merged.get("fp8_recipe", "delayed") != "delayed"
    merged["store_param_remainders"] = bool(merged.get("bf16")) and not fp8_own
    if grads == "bf16":
        if merged.get("bf16") and merged.get("accumulate_allreduce_grads_in_fp32"):
            raise ConfigError("--main-grads-dtype bf16 contradicts --accumulate-allreduce-grads-in-fp32 (Megatron "
                              "asserts the same); drop one of them")
        merged["grad_reduce_in_bf16"] = True


def _rope_type(merged: dict[str, Any], kind: str | None) -> None:
    """Megatron's ``--rope-type``: its MLA runs YaRN (``yarn``, the default) or plain RoPE (``rope``) while its softmax
    scale stays ``m(--rotary-scaling-factor, --mscale-all-dim)^2 / sqrt(d)``; plain RoPE is omnitron's factor 1
    where that ``m`` is 1. Megatron's other attention takes ``rope`` only."""
    from omnitron.core.transformer.yarn import yarn_get_mscale

    if kind is None or (kind == "yarn" and merged.get("multi_latent_attention")):
        return
    if kind == "yarn":
        raise ConfigError("--rope-type yarn applies to --multi-latent-attention only (Megatron's other attention "
                          "takes rope); drop it (YaRN on grouped-query attention is --rotary-scaling-factor)")
    factor, all_dim = merged.get("rotary_scaling_factor") or 1.0, merged.get("mscale_all_dim") or 0.0
    if merged.get("multi_latent_attention") and yarn_get_mscale(factor, all_dim) != 1.0:
        raise ConfigError(f"--rope-type rope with --rotary-scaling-factor {factor} and --mscale-all-dim {all_dim}: "
                          f"Megatron's MLA then rotates by plain RoPE yet scales its softmax by "
                          f"{yarn_get_mscale(factor, all_dim) ** 2:.6g}, which omnitron does not compute; drop "
                          f"--rope-type (YaRN) or give --mscale-all-dim 0")
    if merged.get("multi_latent_attention"):
        merged["rotary_scaling_factor"] = 1.0


def _alias(out: dict, given: dict, key: str, target: str, value: Any) -> None:
    if not given.get(key):
        return
    if given.get(target) not in (None, value):
        raise ConfigError(f"--{key.replace('_', '-')} means --{target.replace('_', '-')} {value}, but "
                          f"--{target.replace('_', '-')} {given[target]} was given: drop one of them")
    out[target] = value
