"""Data-parallel settings and micro-batch arithmetic."""
from __future__ import annotations

from dataclasses import dataclass

from omnitron.core.config.parallel import ConfigError


@dataclass(kw_only=True)
class DataParallelConfig:
    """How gradients are bucketed and reduced across data-parallel (x context-parallel) replicas."""

    overlap_grad_reduce: bool = False
    """--overlap-grad-reduce: start each bucket's reduction from backward hooks as soon as the bucket is
    complete on the last micro-batch, overlapping the rest of backward."""
    accumulate_allreduce_grads_in_fp32: bool = False
    """--accumulate-allreduce-grads-in-fp32: keep ``param.main_grad`` and reduce it in float32
    (otherwise in each parameter's own dtype)."""
    grad_reduce_in_bf16: bool = False
    """--grad-reduce-in-bf16: with --bf16, accumulate and reduce gradients in bfloat16 (Megatron's switch: it then
    leaves --accumulate-allreduce-grads-in-fp32 off, halving the gradient buffers and the reduction's bytes)."""
    bucket_size: int | None = None
    """--ddp-bucket-size: elements per bucket with --overlap-grad-reduce (None picks max(40M, 1M x dp)); as in
    Megatron, without --overlap-grad-reduce, and in a chunk after the first or a stage after the first, a buffer is
    one bucket (:func:`bucket_elements`)."""
    reduce_scatter: bool = False
    """Reduce-scatter each bucket instead of all-reducing it (for a distributed optimizer): afterwards
    only this rank's shard of every bucket (``Bucket.shard``) holds the reduced gradient."""
    use_distributed_optimizer: bool = False
    """--use-distributed-optimizer: shard fp32 master weights and optimizer states over data x context
    parallel ranks (ZeRO-1, Megatron's distributed optimizer): gradients are reduce-scattered, each rank
    updates its own contiguous slice of every bucket, and the updated parameters are all-gathered."""
    overlap_param_gather: bool = False
    """--overlap-param-gather (needs --use-distributed-optimizer): start every bucket's parameter all-gather
    asynchronously after the optimizer step and wait for it only in the forward pre-hook of the first module
    that uses one of its parameters, so later buckets' gathers overlap earlier layers' forward."""

    use_torch_fsdp2: bool = False
    """--use-torch-fsdp2: shard parameters, gradients and optimizer states over data x context parallel
    ranks (ZeRO-3) with PyTorch's FSDP2 (``fully_shard``; one unit per transformer layer plus the chunk as
    root), instead of omnitron's bucketed wrapper (:mod:`omnitron.core.parallel.data.fsdp`)."""
    fsdp2_reduce_every_microbatch: bool = False
    """--fsdp2-reduce-every-microbatch (with --use-torch-fsdp2): reduce-scatter the gradients after every
    micro-batch's backward and accumulate them sharded (ZeRO-3's memory through the step, one reduce-scatter
    per micro-batch) instead of accumulating them unsharded (4 bytes per parameter) and reducing once per step."""

    def __post_init__(self) -> None:
        if self.fsdp2_reduce_every_microbatch and not self.use_torch_fsdp2:
            raise ConfigError("--fsdp2-reduce-every-microbatch chooses when FSDP2 reduces; add --use-torch-fsdp2 or "
                              "drop it")
        if self.use_torch_fsdp2:
            for flag, on, fix in (
                    ("--use-distributed-optimizer", self.use_distributed_optimizer,
                     "FSDP2 already shards optimizer state; drop --use-distributed-optimizer"),
                    ("--overlap-grad-reduce", self.overlap_grad_reduce,
                     "FSDP2 reduce-scatters each layer's gradients itself; drop --overlap-grad-reduce"),
                    ("--overlap-param-gather", self.overlap_param_gather,
                     "FSDP2 prefetches the next layer's all-gather itself; drop --overlap-param-gather"),
                    ("--ddp-bucket-size", self.bucket_size is not None,
                     "FSDP2's units are the transformer layers, not buckets; drop --ddp-bucket-size")):
                if on:
                    raise ConfigError(f"--use-torch-fsdp2 with {flag}: {fix}")
        if self.bucket_size is not None and self.bucket_size < 1:
            raise ConfigError(f"--ddp-bucket-size must be a positive element count, got {self.bucket_size}")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ConfigError("--overlap-param-gather overlaps the distributed optimizer's parameter all-gather; "
                              "add --use-distributed-optimizer or drop --overlap-param-gather")


def num_microbatches(global_batch_size: int, micro_batch_size: int, data_parallel_size: int) -> int:
    """global = micro x dp x micro-batches; returns the number of micro-batches per step."""
    for flag, v in (("--global-batch-size", global_batch_size), ("--micro-batch-size", micro_batch_size),
                    ("data-parallel size", data_parallel_size)):
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"{flag} must be a positive integer, got {v!r}")
    per_step = micro_batch_size * data_parallel_size
    if global_batch_size % per_step:
        raise ConfigError(f"--global-batch-size ({global_batch_size}) must be a multiple of --micro-batch-size "
                          f"({micro_batch_size}) x data-parallel size ({data_parallel_size}) = {per_step}; "
                          f"e.g. --global-batch-size {max(per_step, global_batch_size // per_step * per_step)}")
    return global_batch_size // per_step


def check_fsdp2(ddp: DataParallelConfig | None, *, family: str, model, parallel, dp: int, fp8, checkpoint,
                training) -> None:
    """Refuse, before any work, what ``--use-torch-fsdp2`` does not combine with (each with its fix)."""
    if ddp is None or not ddp.use_torch_fsdp2:
        return
    cp = parallel.context_parallel_size
    schedule = training.pipeline_schedule or ""
    fp8_why = None
    if fp8 is not None:
        from omnitron.core.precision.fp8.fsdp import fsdp_refusal

        fp8_why = fsdp_refusal(fp8)
    for what, bad, fix in (
            (f"data x context parallel size {dp} x {cp}", dp * cp == 1,
             "there is nothing to shard over one replica; run more data-parallel ranks or drop the flag"),
            (f"--model-type {family}", family != "gpt", "FSDP2 units are GPT decoder layers; drop the flag"),
            ("MoE (--num-experts)", getattr(model, "num_experts", None) is not None,
             "experts are replicated over expert-data-parallel ranks, not dp x cp; drop one of them"),
            (fp8_why[0] if fp8_why else "--fp8-format", fp8_why is not None, fp8_why[1] if fp8_why else ""),
            ("--ckpt-format torch", checkpoint.ckpt_format != "torch_dist",
             "FSDP2 checkpoints through --ckpt-format torch_dist (each rank its shards); drop --ckpt-format torch"),
            ("--grad-reduce-in-bf16", ddp.grad_reduce_in_bf16, "omnitron's FSDP2 policy reduces in fp32; drop "
                                                                "--grad-reduce-in-bf16 or --use-torch-fsdp2"),
            (f"--pipeline-schedule {schedule}", schedule.startswith("zb") or schedule == "dualpipe-v",
             "its deferred (zero-bubble) weight-gradient passes run after FSDP2 has freed the layer's gathered "
             "parameters; use 1f1b or interleaved"),
):
        if bad:
            raise ConfigError(f"--use-torch-fsdp2 with {what}: {fix}")


def bucket_elements(config: DataParallelConfig | None, group_size: int, *, bucketing: bool = True,
                    overlap: bool | None = None) -> int | None:
    """Elements per gradient bucket for a replica group of ``group_size``, Megatron's rule (training.py's
    ``resolve_ddp_bucket_size`` and ``get_model``; the wrapper's, and the plan's, which mirrors it): None -- one
    bucket per buffer -- without --overlap-grad-reduce (``overlap``, default the config's: nothing to overlap) and
    where ``bucketing`` is off (a model chunk after the first, any chunk of a pipeline stage after the first: their
    reductions are off the critical path); else ``--ddp-bucket-size``, else max(40M, 1M x group)."""
    overlap = bool(config and config.overlap_grad_reduce) if overlap is None else overlap
    if not (overlap and bucketing):
        return None
    return (config.bucket_size if config else None) or max(40_000_000, 1_000_000 * group_size)
