"""One training step and one evaluation, over the pipeline runtime.

A step: zero gradients; run the schedule's forwards and backwards over this step's
micro-batches; reduce gradients; clip and update (the optimizer skips on fp16 overflow); then
share the loss (held by the last stage) with every rank for logging.

Context parallelism: each cp rank reads the whole micro-batch and keeps its load-balanced slice
(:func:`omnitron.core.parallel.context.context_parallel_batch`); its loss share is its local loss
sum over the whole micro-batch's token count, times cp, so the average over ``dp x cp`` is the
one-process mean (same loss, same gradients).
"""
from __future__ import annotations

import functools
from typing import Iterator

import torch

from omnitron.core.models.family import family_of
from omnitron.core.parallel.context import context_parallel_batch, context_parallel_loss
from omnitron.core.parallel.data import FullyShardedDataParallel, finalize_model_grads, scale_gradients
from omnitron.core.parallel.pipeline import forward_backward
from omnitron.core.training.log_lines import perplexity
from omnitron.core.training.nonfinite import check_grad_norm, check_loss
from omnitron.core.training.timers import Timers, compute_sections, record_compute_split
from omnitron.core.transformer.moe.metrics import moe_aux_loss, set_aux_loss_scale
from omnitron.core.transformer.moe.router import update_expert_bias
from omnitron.core.transformer.mtp import mtp_loss, set_mtp_loss_scale


def _unwrap(chunk):
    return getattr(chunk, "module", chunk)


def forward_step(chunk, batch: dict | None, hidden: torch.Tensor | None) -> torch.Tensor:
    """Run one chunk on one micro-batch, as its model family does it (``ModelFamily.forward_step``): tokens in
    on the first stage, the family's loss input out on the last."""
    m = _unwrap(chunk)
    return family_of(m.config).forward_step(chunk, m, batch, hidden)


def _zero_grads(c) -> None:
    """Zero the gradients; tell the data-parallel wrapper whether this step averages them over dp (not in
    1-bit Adam's compressed stage: every rank of a dp group gets the same answer, so all skip together)."""
    c.optimizer.zero_grad()
    over_dp = c.optimizer.grad_reduction_over_dp()
    for chunk in c.chunks:
        if hasattr(chunk, "zero_grad_buffer"):
            chunk.zero_grad_buffer()
            chunk.reduce_over_dp = over_dp


def forward_only_schedule(schedule):
    """The schedule's forwards alone (validation): no gradient messages are planned or awaited."""
    return schedule.forwards_only()


def _run(c, data_iterator: Iterator | None, *, forward_only: bool, loss_scale: float | None,
         timeline: list | None = None) -> tuple[float, float]:
    """Run the schedule; returns (the mean loss over micro-batches and data-parallel ranks, or with
    ``--calculate-per-token-loss`` over the step's tokens; the tokens summed over data x context parallel
    ranks), the same on every rank. ``timeline``: receives the runtime's compute spans (level-2 timers)."""
    schedule = forward_only_schedule(c.schedule) if forward_only else c.schedule

    model_loss = family_of(c.model).loss_fn

    def loss_fn(output, batch):
        total, count = context_parallel_loss(*model_loss(output, batch), batch)
        return (_ScaleGrad.apply(total, loss_scale) if loss_scale else total), count

    t = c.settings.training
    combined = None
    if c.groups.config.overlap_moe_expert_parallel_comm:  # combined 1F1B pairs (pipeline/combined.py)
        from omnitron.core.transformer.moe.overlap import run_combined as combined
    out = forward_backward(schedule, c.chunks, data_iterator, c.groups, num_microbatches=schedule.num_microbatches,
                           seq_length=c.model.seq_length, micro_batch_size=t.micro_batch_size,
                           hidden_size=c.model.hidden_size, forward_step_fn=forward_step, dtype=c.model.params_dtype,
                           loss_fn=loss_fn, forward_only=forward_only, collectives=c.backend.collectives,
                           device=c.backend.current_device(), timeline=timeline,
                           per_token_loss=t.calculate_per_token_loss, combined_fn=combined)
    return out["loss"], out["tokens"]


class _ScaleGrad(torch.autograd.Function):
    """The identity forward, the gradient times ``scale`` backward: the loss scaling acts on the backward alone, so the
    loss the step reports is the unscaled one, as Megatron's (it multiplies the loss it differentiates by the scale
    but reports the loss function's value): a scale that overflows the scaled loss (it is fp32, the gradients need
    not overflow) leaves the reported loss finite."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _stage_iterator(c, data_iterator):
    """Only the first and last stage read batches (middle stages get None, unless attention needs the
    batches' document ids, ``--reset-attention-mask``, or the family reads them on every stage, as BERT's
    padding mask); each keeps its cp slice."""
    needs = any(_unwrap(ch).pre_process or _unwrap(ch).post_process for ch in c.chunks)
    needs = needs or getattr(c.settings.data, "reset_attention_mask", False) or family_of(c.model).stages_read_batch
    if not needs or data_iterator is None:
        return None
    cp = c.groups.cp
    return data_iterator if cp.size == 1 else (context_parallel_batch(b, cp) for b in data_iterator)


def train_step(c, data_iterator: Iterator, timers: Timers | None = None, *, count_zeros: bool = False) -> dict:
    """One optimizer step; returns loss, lr, grad norm, loss scale, skipped (and ``num_zeros_in_grad`` with
    ``count_zeros``). ``timers``: the run's phase timers (see :mod:`omnitron.core.training.timers`)."""
    timers = timers if timers is not None else Timers.disabled()
    for m in c.modules:
        m.train()
    _zero_grads(c)
    scaler = c.optimizer.loss_scaler
    scale = scaler.scale if scaler is not None else None
    moe = c.model.num_experts is not None
    mtp = bool(getattr(c.model, "mtp_num_layers", None))
    if moe:  # each micro-batch's load-balancing loss gets the weight of its LM loss
        set_aux_loss_scale(c.modules, (scale or 1.0) / c.schedule.num_microbatches)
    if mtp:  # so does its multi-token-prediction loss
        set_mtp_loss_scale(c.modules, (scale or 1.0) / c.schedule.num_microbatches)
    # NOTE: host-clock compute spans measure device work only where the device is synchronous
    split = timers.enabled("forward-compute") and not c.backend.capabilities().streams
    spans = c.settings.logging.log_straggler  # the straggler detector's compute time (straggler.py)
    timeline = [] if split or spans else None
    fb = timers("forward-backward")
    fb.start()
    loss, tokens = _run(c, _stage_iterator(c, data_iterator), forward_only=False, loss_scale=scale,
                        timeline=timeline)
    fb_seconds = fb.stop()
    check = c.settings.training.check_for_nan_in_loss_and_grad
    check_loss(loss, check)  # the same loss on every rank: all stop here together, nothing updated
    if split:
        record_compute_split(timers, timeline, fb_seconds, pipelined=c.groups.pp.size > 1)
    fp8_step = c.extra.get("fp8_step")
    if fp8_step is not None:  # delayed scaling: the step's one amax reduction and scale update
        fp8_step()
    with timers.phase("all-grads-sync"):
        finalize_model_grads(c.chunks, c.groups, collectives=c.backend.collectives)
        if moe and getattr(c.model, "moe_router_enable_expert_bias",
                           False):  # where Megatron updates it: in finalize_model_grads
            update_expert_bias(c.modules, c.groups, sequence_parallel=c.groups.config.sequence_parallel)
        if c.settings.training.calculate_per_token_loss:
            # the data-parallel mean took 1 / (dp x cp) of the summed loss sums, and ``tokens`` is the step's global
            # count (each cp rank counts its micro-batch's tokens / cp): dp x cp / tokens leaves d(sum) / tokens
            scale_gradients(c.chunks, c.groups.dp_cp.size / max(tokens, 1.0))
    # NOTE: the schedule advances with successful steps only (a skipped fp16 step keeps its lr), as Megatron
    batch = c.batches.global_batch(c.consumed_samples)
    lr = c.scheduler.lr_for_step(c.optimizer.step_count, batch)
    decoupled_lr = c.scheduler.decoupled_lr_for_step(c.optimizer.step_count, batch)
    wd = c.scheduler.wd_for_step(c.optimizer.step_count, batch)
    with timers.phase("optimizer"):
        check_norm = functools.partial(check_grad_norm, loss_scale=scale) if check else None
        res = c.optimizer.step(lr, count_zeros=count_zeros, timers=timers, check_norm=check_norm,
                               decoupled_lr=decoupled_lr, weight_decay=wd)
    if not res.skipped:
        c.scheduler.advance(batch)
    refresh = c.extra.get("fp8_refresh")
    if refresh is not None:  # FSDP2's FP8 weight gathers: every weight's scale in one amax all-reduce (fp8/fsdp.py)
        refresh()
    out = {"lm_loss": loss, "lr": lr, "grad_norm": res.grad_norm, "loss_scale": res.loss_scale,
           "skipped": res.skipped, "decoupled_lr": decoupled_lr}
    if c.scheduler.wd_incr is not None:  # --weight-decay-incr-style linear|cosine: the decay this step applied
        out["weight_decay"] = wd
    if count_zeros:
        out["num_zeros_in_grad"] = res.num_zeros_in_grad
    if spans:
        out["compute_sections"] = compute_sections(timeline)
    if moe:
        out["moe_aux_loss"] = moe_aux_loss(c.modules, c.groups, c.backend.collectives, c.schedule.num_microbatches)
    if mtp:
        out["mtp_loss"] = mtp_loss(c.modules, c.groups, c.backend.collectives, c.schedule.num_microbatches)
    if getattr(c.model, "bert_binary_head", False):  # BERT's loss is masked LM + sentence order: log the second
        from omnitron.core.models.bert.model import sop_loss

        out["sop_loss"] = sop_loss(c.modules, c.groups, c.backend.collectives, c.schedule.num_microbatches)
    return out


@torch.no_grad()
def evaluate(c, data_iterator: Iterator, eval_iters: int, stop=None) -> dict | None:
    """Mean loss over ``eval_iters`` global batches of the validation split; dropout off. ``stop()``, asked
    between batches (collective: the same answer on every rank), True ends the evaluation unfinished and it
    returns None: Megatron's --exit-duration-in-mins check inside evaluate, so that a long evaluation does
    not keep the job past its time limit."""
    for m in c.modules:
        m.eval()
    it = _stage_iterator(c, data_iterator)
    runs = []
    while len(runs) < eval_iters and (not runs or stop is None or not stop()):
        runs.append(_run(c, it, forward_only=True, loss_scale=None))
    for chunk in c.chunks:
        if isinstance(chunk, FullyShardedDataParallel):  # FSDP2 keeps the root gathered after a forward
            chunk.reshard()
    for m in c.modules:
        m.train()
    if len(runs) < eval_iters:
        return None
    if c.settings.training.calculate_per_token_loss:  # every token of every evaluated batch weighs the same
        val = sum(loss * n for loss, n in runs) / max(sum(n for _, n in runs), 1.0)
    else:
        val = sum(loss for loss, _ in runs) / max(len(runs), 1)
    out = {"val_loss": val, "val_ppl": perplexity(val)}
    if getattr(c.model, "bert_binary_head", False):  # BERT: the sentence-order part, as Megatron logs it
        from omnitron.core.models.bert.model import sop_loss

        nmb = c.schedule.num_microbatches * max(eval_iters, 1)
        out["val_sop_loss"] = sop_loss(c.modules, c.groups, c.backend.collectives, nmb)
    return out
