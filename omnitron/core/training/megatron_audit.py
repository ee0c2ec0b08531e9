"""The audit of Megatron's flags that omnitron accepts, implements or refuses (docs/megatron-flags.md).

No flag may be accepted while computing something other than Megatron's run with it: a flag is either
implemented (a setting of its own whose test compares the maths with an independent reference), a selector
(accepted: what runs instead and why the trained model is the same, :data:`megatron_flags.SELECTORS`), an
alias, or refused with the reason. :func:`audit_markdown` renders that table from the data, and a test keeps
the docs equal to it.
"""
from __future__ import annotations

from omnitron.core.training import megatron_flags as MF

IMPLEMENTED: dict[str, tuple[str, str, str]] = {
    # flag: (Megatron's behaviour, omnitron's, the test that pins it). Flags that were once accepted while
    # computing something else (issue 36) or refused, now doing what Megatron does.
    "--no-bias-gelu-fusion": (
        "the GeLU MLP runs exact (erf) GeLU; the tanh approximation only runs inside the fused bias-GeLU, "
        "which --disable-bias-linear also turns off (megatron/core/transformer/mlp.py, training/arguments.py)",
        "the same rule (GPTConfig.bias_gelu_fusion, transformer/mlp.py exact_gelu); HF and Megatron "
        "conversion carry it",
        "tests/models/test_gpt_reference.py::test_engine_matches_plain_float64"),
    "--grad-reduce-in-bf16": (
        "with --bf16, gradients are accumulated and reduced in bf16 (accumulate_allreduce_grads_in_fp32 off)",
        "the same: bf16 main_grad buffers and bf16 reduction (DataParallelConfig.grad_reduce_in_bf16); refused "
        "with --use-torch-fsdp2 (its policy reduces in fp32)",
        "tests/parallel/test_data_parallel.py::test_ddp_buckets_overlap_and_reduction_match_reference"),
    "--exp-avg-dtype": (
        "with --use-precision-aware-optimizer, Transformer Engine's FusedAdam stores Adam's first moment in this "
        "dtype, reads it as fp32, steps in fp32 and rounds it back (fp16 / fp8 scaled per tensor)",
        "fp32, bf16 and fp16 the same way (OptimizerConfig.exp_avg_dtype; checkpoints keep bf16 as bf16, fp16 "
        "unscaled in fp32 as TE's state_dict); fp8 refused in one line",
        "tests/optim/test_precision_aware.py::test_steps_match_float64_fused_adam"),
    "--exp-avg-sq-dtype": (
        "the same for Adam's second moment",
        "the same (OptimizerConfig.exp_avg_sq_dtype)",
        "tests/optim/test_precision_aware.py::test_steps_match_float64_fused_adam"),
    "--moe-grouped-gemm": (
        "the local experts' GEMMs run as grouped GEMMs (TEGroupedMLP / GroupedMLP): the function SequentialMLP "
        "computes one expert at a time",
        "torch._grouped_mm for fp32/bf16/fp16 with 16-byte aligned widths (CPU and GPU in torch 2.13); otherwise "
        "(FP8 experts, float64) the per-expert GEMMs, said once in the log",
        "tests/models/test_moe.py::test_grouped_gemm_computes_the_per_expert_gemms"),
    "--tensorboard-dir": (
        "TensorBoard events in DIR itself, tags `lm loss`, `learning-rate`, `grad-norm`, `lm loss validation`, ... "
        "and their `vs samples` twins (training_log, evaluate_and_print_results)",
        "the same directory and tag names (metrics.jsonl goes there too unless --log-dir)",
        "tests/training/test_wandb_tensorboard.py::test_tensorboard_dir_holds_megatrons_tags"),
    "--log-world-size-to-tensorboard": (
        "TensorBoard scalars `world-size` and `world-size vs samples` (training_log)",
        "the same tags (at --log-interval, as omnitron's other tags), and `world_size` in metrics.jsonl",
        "tests/training/test_wandb_tensorboard.py::test_world_size_reaches_tensorboard_when_asked"),
    "--log-validation-ppl-to-tensorboard": (
        "TensorBoard scalars `lm loss validation ppl` and `lm loss validation ppl vs samples`, written only with the "
        "flag (evaluate_and_print_results; training_config.py log_validation_ppl_to_tensorboard, default off)",
        "the same gate (LoggingConfig.log_validation_ppl_to_tensorboard; the test split's `lm loss test ppl` too); "
        "was accepted while the tags were written always; metrics.jsonl keeps val_ppl / test_ppl",
        "tests/training/test_wandb_tensorboard.py::test_validation_ppl_reaches_tensorboard_only_when_asked"),
    "--no-log-loss-scale-to-tensorboard": (
        "no `loss-scale` and `loss-scale vs samples` in TensorBoard (nor `loss-scale` in W&B); written by default "
        "(training_log; training_config.py log_loss_scale_to_tensorboard); also "
        "--disable-log-loss-scale-to-tensorboard",
        "TensorBoard leaves the same two tags out, W&B its `loss-scale` (LoggingConfig.log_loss_scale_to_tensorboard;"
        " both spellings were refused as not implemented); metrics.jsonl keeps the loss scale",
        "tests/training/test_wandb_tensorboard.py::test_tensorboard_and_wandb_gates_are_megatrons"),
    "--account-for-embedding-in-pipeline-split": (
        "the embedding counts as one layer of the pipeline split: num-layers + 1 (+ 1 with the loss flag) split "
        "evenly over every virtual stage, the first virtual stage builds one layer fewer (transformer_block.py "
        "get_num_layers_to_build)",
        "the same split (ParallelConfig.account_for_embedding_in_pipeline_split, pipeline/layout.py); a chunk of one "
        "slot holds the embedding alone; checkpoints record it and `omnitron plan` prices it",
        "tests/parallel/test_parity_account.py::test_parity_account_pp2"),
    "--account-for-loss-in-pipeline-split": (
        "the output layer and loss count as one layer of the pipeline split: the last virtual stage builds one "
        "layer fewer (transformer_block.py get_num_layers_to_build)",
        "the same split (ParallelConfig.account_for_loss_in_pipeline_split, pipeline/layout.py); a chunk of one "
        "slot holds the output layer alone",
        "tests/parallel/test_parity_account.py::test_parity_account_pp2"),
    "--squared-relu": (
        "the MLP's activation is squared_relu, pow(relu(x), 2) (argument_utils.py; asserts not --swiglu, and its "
        "fused bias-GeLU refuses it: biases need --no-bias-gelu-fusion or --disable-bias-linear)",
        "the same activation (GPTConfig.squared_relu, transformer/mlp.py), dense and MoE MLPs; refused with --swiglu "
        "/ --quick-geglu; on the command line with biases it needs --no-bias-gelu-fusion, as Megatron (accepted "
        "without it until 2026-12-07; a config file's model runs it unfused either way); Megatron conversion "
        "carries it (the fusion written off), a Hugging Face export refuses it (was refused as not implemented)",
        "tests/models/test_gpt_flags_megatron.py::test_gpt_flag_equals_megatron_core"),
    "--moe-router-dtype": (
        "the router's logits in fp32 / fp64, unset in the tokens' dtype (bf16 logits in a bf16 run); the top-k on "
        "the logits, the scores in float32, the probabilities cast to the logits' dtype (router.py Router.gating, "
        "moe_utils.py topk_routing_with_score_function)",
        "the same for unset and fp32 (GPTConfig.moe_router_dtype, router.py router_dtype; a float64 model's scores "
        "stay float64); fp64 refused in one line; was accepted as fp32 only while the default routed in float32",
        "tests/models/test_moe_router_dtype.py::test_bf16_router_routes_as_megatron_bit_for_bit"),
    "--cpu-offloading-retain-pinned-cpu-buffers": (
        "--cpu-offloading's pinned host buffers are kept after their tensors come back and reused for the next "
        "iteration (model_parallel_config.py; Transformer Engine's offload context, TE 2.10+): the same numbers",
        "the same: a host buffer returns to a pool when its tensor is unpacked and the next offload of its dtype and "
        "size copies into it, so steps after the first allocate none (ActivationOffloader's pool); without "
        "--cpu-offloading-num-layers refused in one line (was refused as not implemented)",
        "tests/training/test_cpu_offloading.py::test_retained_host_buffers_are_reused_and_change_nothing"),
}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def audit_rows() -> list[tuple[str, str, str, str]]:
    """(flag, status, what omnitron does, why / the test) for every flag of the audit, in table order."""
    rows = [(flag, "implemented", does, f"Megatron: {megatron}; test: `{test}`")
            for flag, (megatron, does, test) in IMPLEMENTED.items()]
    rows += [(_flag(d), "accepted", instead, why) for d, (_, instead, why) in MF.SELECTORS.items()]
    rows += [(_flag(d), "alias", text, "the setting it names is Megatron's") for d, (text, _) in MF.ALIASES.items()]
    rows += [(_flag(d), "refused", "stops before any work, in one line", why) for d, (_, why) in MF.REFUSED.items()]
    return rows


def audit_markdown() -> str:
    """The audit as a markdown table (docs/megatron-flags.md holds exactly this between its markers)."""
    esc = lambda t: t.replace("|", "\\|")  # noqa: E731
    lines = ["| flag | status | omnitron | reason |", "|---|---|---|---|"]
    lines += [f"| `{f}` | {st} | {esc(does)} | {esc(why)} |" for f, st, does, why in audit_rows()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m omnitron.core.training.megatron_audit > table.md
    print(audit_markdown(), end="")
