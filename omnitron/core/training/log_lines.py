"""The console lines of a training run, in Megatron-LM's format (megatron/training/training.py at d98e8a6), so that a
log parser written for Megatron's lines reads omnitron's:

* :func:`training_line`: training_log's ``[time] iteration N/ M | consumed samples: ... | ... | number of nan
  iterations: ... |``, Megatron's fields with Megatron's labels, order, number formats and presence rules, then
  omnitron's own (ETA, tokens/s, MFU, peak memory, ...) as further `` name: value |`` fields, none of which reuses a
  label of Megatron's;
* :func:`validation_lines`: evaluate_and_print_results' framed `` validation loss at iteration N | lm loss value:
  ... | lm loss PPL: ... |`` (the test split's too, which Megatron also calls ``validation loss``);
* :func:`memory_line`: report_memory's ``[Rank N] (after K iterations) memory (MB) | ...``.
"""
from __future__ import annotations

import datetime
import math


def _clock(seconds: float) -> str:
    """``H:MM:SS`` of a duration (the ETA of the rest of the run at the current step time)."""
    s = max(int(round(seconds)), 0)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _megatron_fields(rec: dict, train_iters: int, losses: dict, throughput: bool) -> str:
    """training_log's fields, transcribed (lines 3568-3641): ``losses`` the interval's losses as printed, by
    Megatron's key (``lm loss``, BERT's ``sop loss``; None: no field); the loss scale 1.0 where there is no scaler, as
    Megatron's bf16 and fp32 optimizers report; the throughput with --log-throughput only; the grad norm, zeros and
    parameter norm where the record has them."""
    s = f" iteration {rec['iteration']:8d}/{train_iters:8d} |"
    if "consumed_samples" in rec:
        s += f" consumed samples: {rec['consumed_samples']:12d} |"
    s += f" elapsed time per iteration (ms): {rec['step_time_s'] * 1000.0:.1f} |"
    if throughput and rec.get("tflops_per_device") is not None:
        s += f" throughput per GPU (TFLOP/s/GPU): {rec['tflops_per_device']:.1f} |"
    s += f" learning rate: {rec['lr']:.6E} |"
    if "global_batch_size" in rec:
        s += f" global batch size: {rec['global_batch_size']:5d} |"
    for name, value in losses.items():
        if value is not None:
            s += f" {name}: {value:.6E} |"
    s += f" loss scale: {1.0 if rec['loss_scale'] is None else rec['loss_scale']:.1f} |"
    if rec["grad_norm"] is not None:
        s += f" grad norm: {rec['grad_norm']:.3f} |"
    if rec.get("num_zeros_in_grad") is not None:
        s += f" num zeros: {rec['num_zeros_in_grad']} |"
    if rec.get("params_norm") is not None:
        s += f" params norm: {rec['params_norm']:.3f} |"
    s += f" number of skipped iterations: {rec['skipped_iters']:3d} |"
    return s + f" number of nan iterations: {rec['nan_iters']:3d} |"


def _omnitron_fields(rec: dict, train_iters: int, throughput: bool) -> str:
    """omnitron's fields after Megatron's, each `` name: value |`` with a name Megatron's line does not use."""
    fields = []
    for key, label in (("decoupled_lr", "decoupled lr"), ("weight_decay", "weight decay"),
                       ("moe_aux_loss", "moe aux loss"), ("mtp_loss", "mtp loss")):
        if rec.get(key) is not None:
            fields.append((label, f"{rec[key]:.6E}"))
    if rec.get("tokens_per_sec") is not None:
        fields.append(("tokens per second", f"{rec['tokens_per_sec']:.0f}"))
    if throughput and rec.get("tokens_per_sec_per_device") is not None:
        fields.append(("tokens per second per GPU", f"{rec['tokens_per_sec_per_device']:.0f}"))
    if rec.get("mfu") is not None:
        fields.append(("MFU (%)", f"{rec['mfu'] * 100:.1f}"))
    if rec.get("peak_memory_bytes"):
        fields.append(("peak memory (MiB)", f"{rec['peak_memory_bytes'] / 2**20:.0f}"))
    fields.append(("ETA", _clock(rec["step_time_s"] * (train_iters - rec["iteration"]))))
    return "".join(f" {label}: {value} |" for label, value in fields)


def training_line(rec: dict, train_iters: int, now: datetime.datetime, losses: dict,
                  throughput: bool = False) -> str:
    """The console line of the training record ``rec`` at wall-clock ``now``: Megatron's (its leading space and
    ``[%Y-%m-%d %H:%M:%S.%f]`` included), then omnitron's fields. ``losses``: ``{"lm loss": x}`` (BERT: and ``"sop
    loss"``), the values to print (None: none, as Megatron's line before any step advanced or for an average that
    is not ``>= 0``); ``throughput``: --log-throughput."""
    return (f" [{now.strftime('%Y-%m-%d %H:%M:%S.%f')}]" + _megatron_fields(rec, train_iters, losses, throughput)
            + _omnitron_fields(rec, train_iters, throughput))


PPL_LOSS_CAP = 20.0
"""Megatron's evaluate_and_print_results prints ``exp(min(20, loss))`` as a loss's PPL."""


def perplexity(loss: float) -> float:
    """A loss's PPL as Megatron prints it: ``exp(min(20, loss))`` (:data:`PPL_LOSS_CAP`)."""
    return math.exp(min(PPL_LOSS_CAP, loss))


def validation_lines(iteration: int, values: dict, after_training: bool = False) -> list[str]:
    """evaluate_and_print_results' three lines (lines 5372-5400) for a validation (``val_*`` keys) or test
    (``test_*``) evaluation: `` validation loss at <prefix> | lm loss value: V | lm loss PPL: P | `` (and ``sop
    loss`` for BERT) between two rules of ``-``, one longer than it. The prefix is the training loop's: ``iteration
    N`` during training, ``iteration N on validation set`` / ``on test set`` for the evaluations after it. The lm
    loss's PPL is the record's own (``val_ppl`` / ``test_ppl``, computed with the loss); BERT's sop loss has none
    there and gets :func:`perplexity` here."""
    test = "test_loss" in values
    key = "test" if test else "val"
    prefix = f"iteration {iteration}" + ((" on test set" if test else " on validation set") if after_training else "")
    string = f" validation loss at {prefix} | "
    sop = values.get(key + "_sop_loss")
    for name, value, ppl in (("lm loss", values[key + "_loss"], values[key + "_ppl"]),
                             ("sop loss", sop, None if sop is None else perplexity(sop))):
        if value is not None:
            string += f"{name} value: {value:.6E} | {name} PPL: {ppl:.6E} | "
    rule = "-" * (len(string) + 1)
    return [rule, string, rule]


def memory_line(rank: int, iteration: int, stats: dict) -> str:
    """Megatron's report_memory line (training/utils/common_utils.py), which each rank of data-parallel rank 0 prints
    at its first iteration and the next logged one: ``[Rank N] (after K iterations) memory (MB) | allocated: ...
    | max allocated: ... | reserved: ... | max reserved: ...`` from the backend's ``memory_stats`` (the host
    process's resident set on cpu); a statistic the backend cannot say is left out."""
    fields = [f" | {label}: {stats[key] / 2**20:.2f}" for key, label in (
        ("allocated", "allocated"), ("peak_allocated", "max allocated"), ("reserved", "reserved"),
        ("peak_reserved", "max reserved")) if stats.get(key) is not None]
    return f"[Rank {rank}] (after {iteration} iterations) memory (MB)" + "".join(fields)
