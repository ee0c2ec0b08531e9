"""Pipeline parallelism: layer placement, schedules as data, and the one runtime.

Entry point the training loop calls once per step::

    out = forward_backward("1f1b", chunks, data_iterator, groups, num_microbatches=m,
                           seq_length=s, micro_batch_size=b, hidden_size=h,
                           forward_step_fn=step, dtype=torch.float32)
    out["loss"]    # mean of the micro-batch mean losses over micro-batches and dp x cp, on every rank
    out["tokens"]  # tokens the loss was taken over, summed over micro-batches and dp x cp

- ``chunks``: this rank's model chunks (``vp`` of them for the interleaved schedule), possibly
  wrapped in :class:`~omnitron.core.parallel.data.DistributedDataParallel`.
- ``forward_step_fn(chunk, batch, hidden) -> Tensor``: ``hidden`` is None on virtual stage 0
  (the chunk reads ``batch``) and the received activation ``[s, b, h]`` elsewhere; returns the
  activation for the next stage, or on the last stage the per-token loss (e.g. ``[b, s]``).
- ``batch`` is the micro-batch drawn from ``data_iterator`` (``num_microbatches`` draws per call
  on every rank whose iterator is not None; ranks without one get ``None``).
- ``loss_fn(output, batch) -> (loss_sum, num_tokens)`` (default: sum and count, honouring
  ``batch["loss_mask"]``); each micro-batch contributes ``loss_sum / num_tokens / m`` to backward.
- Gradients are NOT reduced here: call ``finalize_model_grads(chunks, groups)`` afterwards.
- ``schedule_name``: ``none`` | ``1f1b`` | ``interleaved`` | ``zb-h1`` | ``zb-v`` | ``dualpipe-v``
  (``--pipeline-schedule``), or None to pick from pp and vp. ``zb-v`` and ``dualpipe-v`` take two chunks
  per rank placed in a V (chunk 1 of rank r is stage 2p-1-r: build them with
  ``pipeline_layer_ranges(..., style="v")``).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from omnitron.core.parallel.pipeline.layout import pipeline_layer_ranges
from omnitron.core.parallel.pipeline.runtime import PipelineError, default_loss_fn, run_schedule
from omnitron.core.parallel.pipeline.schedules import SCHEDULES, Action, Schedule, build_schedule
from omnitron.core.parallel.pipeline.simulate import ScheduleError, simulate, theory_bubble

__all__ = ["forward_backward", "pipeline_layer_ranges", "build_schedule", "Schedule", "Action", "SCHEDULES",
           "simulate", "theory_bubble", "PipelineError", "ScheduleError", "pipeline_tensor_shape"]


def pipeline_tensor_shape(groups, *, seq_length: int, micro_batch_size: int, hidden_size: int) -> tuple[int, int, int]:
    """Shape of the activation passed between stages: ``[s / cp / (tp if sequence parallel), b, h]``."""
    cfg = groups.config
    div = cfg.context_parallel_size * (cfg.tensor_model_parallel_size if cfg.sequence_parallel else 1)
    if seq_length % div:
        raise ValueError(f"--seq-length {seq_length} must be divisible by context-parallel x "
                         f"(tensor-parallel when --sequence-parallel) = {div}")
    return (seq_length // div, micro_batch_size, hidden_size)


def forward_backward(schedule_name: str | Schedule | None, model_chunks: list, data_iterator: Iterator | None,
                     groups, *,
                     num_microbatches: int, seq_length: int, micro_batch_size: int, hidden_size: int,
                     forward_step_fn: Callable, dtype: torch.dtype = torch.float32, loss_fn: Callable | None = None,
                     forward_only: bool = False, collectives=None, device: torch.device | None = None,
                     timeline: list | None = None, per_token_loss: bool = False,
                     combined_fn: Callable | None = None, trace: list | None = None) -> dict:
    """Run one step's forward and backward passes over ``num_microbatches`` micro-batches.

    Returns ``{"loss": float, "tokens": float, "schedule": Schedule}``, identical on every rank.
    ``per_token_loss`` (``--calculate-per-token-loss``): every micro-batch back-propagates its loss sum and
    ``loss`` is the sum over the step's tokens divided by their count (``tokens``: summed over data x context
    parallel ranks); the caller divides the gradients by the count (see ``training/step.py``).
    ``schedule_name`` may be a built :class:`Schedule` (the training step's, or its forwards alone).
    The loss and token sums are reduced in float64 (the logged loss does not depend on the rank count's
    rounding). ``combined_fn(forward, backward)``: runs the two passes of a combined pair in turns
    (``--overlap-moe-expert-parallel-comm``; see ``pipeline/combined.py``). ``trace``: the order of this rank's
    posts, waits and computes (``run_schedule``).
    """
    from omnitron.core.parallel.groups import resolve_backend

    be = resolve_backend(None, groups)
    coll = collectives or groups.collectives or be.collectives
    device = device or be.current_device()
    pp, vp = groups.pp.size, len(model_chunks)
    cfg_vp = groups.config.virtual_pipeline_model_parallel_size or 1
    if vp != cfg_vp:
        raise ValueError(f"got {vp} model chunks but the virtual pipeline size is {cfg_vp}; build one chunk per "
                         f"virtual stage (--num-layers-per-virtual-pipeline-stage)")
    schedule = schedule_name if isinstance(schedule_name, Schedule) else build_schedule(
        schedule_name, pp, vp, num_microbatches, groups.config.microbatch_group_size_per_vp_stage)
    shape = pipeline_tensor_shape(groups, seq_length=seq_length, micro_batch_size=micro_batch_size,
                                  hidden_size=hidden_size)
    ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
    with ctx:
        loss_sum, tokens = run_schedule(schedule, groups.pp.rank, model_chunks, data_iterator,
                                        forward_step_fn=forward_step_fn, loss_fn=loss_fn or default_loss_fn,
                                        pp_group=groups.pp, collectives=coll, tensor_shape=shape, dtype=dtype,
                                        device=device, forward_only=forward_only, timeline=timeline,
                                        per_token_loss=per_token_loss, combined_fn=combined_fn,
                                        trace=trace)
    stats = torch.stack([loss_sum.reshape(()), tokens.reshape(())]).to(torch.float64)
    if groups.pp.size > 1:  # only the last stage holds non-zeros: the sum is a broadcast
        coll.all_reduce(stats, group=groups.pp.handle)
    if groups.dp_cp.size > 1:
        coll.all_reduce(stats, group=groups.dp_cp.handle)
    loss, tokens = stats.tolist()  # one host sync for both (each .item() is one)
    # NOTE: a step without loss tokens (every mask 0) has loss sum 0: per token it logs 0, as the default mean does
    mean = (loss / tokens if tokens > 0 else 0.0) if per_token_loss else loss / (num_microbatches * groups.dp_cp.size)
    return {"loss": mean, "tokens": tokens, "schedule": schedule}

