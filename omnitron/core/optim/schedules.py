"""Learning-rate schedules: linear warmup, then constant / linear / cosine / inverse-square-root / WSD decay to
--min-lr: Megatron-Core's ``OptimizerParamScheduler`` (megatron/core/optimizer_param_scheduler.py at d98e8a6).

``lr(progress)`` is a pure function of the progress *before* the step that applies it, as Megatron: the
successful steps so far, or, in a ``--train-samples`` run, the samples they consumed (Megatron's scheduler
starts at ``step(0)`` and advances after each successful optimizer step, so the first step of a warm-up from
0 applies lr 0). A resumed run continues the exact schedule from the optimizer's step count or the state
dict's sample count. Megatron counts an iteration run in samples too (iterations x --global-batch-size): a resume
under another --global-batch-size is a changed schedule (refused unless a flag says whose stands), and then counts
the samples consumed over the batch size that stands.
With ``--decoupled-lr`` the input embedding and output layer follow the same shape between
``--decoupled-lr`` and ``--decoupled-min-lr`` (Megatron's per-group max_lr / min_lr).
The weight decay follows the same progress (Megatron's ``get_wd``): --weight-decay, or with
``--weight-decay-incr-style linear|cosine`` a rise from --start-weight-decay to --end-weight-decay over the run.
"""
from __future__ import annotations

import math

from omnitron.core.config.parallel import ConfigError
from omnitron.core.config.training import OptimizerConfig


class LRScheduler:
    """Megatron's schedule shapes, counted in iterations or (``train_samples`` given: a ``--train-samples``
    run) in samples. NOTE: step ``i`` (1-based) of warmup applies ``lr * (i - 1) / warmup`` (in samples: the
    samples consumed before it), so with --lr-warmup-init 0 the first step applies lr 0, as Megatron's."""

    _KEYS = ("max_lr", "min_lr", "style", "warmup", "decay_iters", "wsd_decay", "wsd_style", "unit", "warmup_init",
             "samples", "decoupled_max_lr", "decoupled_min_lr", "start_wd", "end_wd", "wd_style", "wd_incr",
             "per_step")

    def __init__(self, config: OptimizerConfig, train_iters: int, train_samples: int | None = None,
                 global_batch_size: int = 1, varying_batch: bool = False) -> None:
        check_lengths(config, train_iters, train_samples)
        self.max_lr, self.min_lr, self.warmup_init = config.lr, config.min_lr, config.lr_warmup_init
        self.decoupled_max_lr = config.decoupled_lr
        self.decoupled_min_lr = config.decoupled_min_lr_or_default if config.decoupled_lr is not None else None
        self.style = config.lr_decay_style
        self.unit = "samples" if train_samples else "iterations"
        if train_samples:
            self.warmup, wsd = config.lr_warmup_samples, config.lr_wsd_decay_samples
            self.decay_iters = config.lr_decay_samples or train_samples  # NOTE: in samples; the name is the format's
        else:
            self.warmup, wsd = config.lr_warmup_iters, config.lr_wsd_decay_iters
            self.decay_iters = config.lr_decay_iters or train_iters
        self.wsd_decay = wsd
        """WSD's final decay in the schedule's unit (None for the other styles; the config requires it for WSD)."""
        self.wsd_style = config.lr_wsd_decay_style
        self.per_step = 1 if train_samples else global_batch_size
        """Samples per unit of progress: Megatron counts an iteration run in samples too (iterations x
        --global-batch-size), which only the inverse square root's floor of one sample can tell apart."""
        self.samples = 0
        """Samples of the successful steps so far (the progress of a sample-counted schedule)."""
        self.varying_batch = varying_batch
        """An iteration-counted run whose batch size changes (--step-batch-size-schedule, or a resume under another
        --global-batch-size): Megatron's progress is then the samples consumed over ``per_step``, not the step
        count."""
        self.wd_style = config.weight_decay_incr_style
        constant = self.wd_style == "constant"
        self.start_wd = config.weight_decay if constant else config.start_weight_decay
        self.end_wd = config.weight_decay if constant else config.end_weight_decay
        self.wd_incr = None if constant else (train_samples or train_iters)
        """The run's length in the progress unit (Megatron's ``wd_incr_steps``); None: a constant decay."""

    def lr_for_step(self, successful_steps: int, batch: int) -> float:
        """The rate of the next step, after ``successful_steps`` successful ones; ``batch``: its sequences."""
        return self.lr(self._progress(successful_steps, batch))

    def decoupled_lr_for_step(self, successful_steps: int, batch: int) -> float | None:
        """The next step's rate of the embedding and output layer (None without --decoupled-lr)."""
        if self.decoupled_max_lr is None:
            return None
        return self.lr(self._progress(successful_steps, batch), self.decoupled_max_lr, self.decoupled_min_lr)

    def wd_for_step(self, successful_steps: int, batch: int) -> float:
        """The next step's weight decay, after ``successful_steps`` successful ones; ``batch``: its sequences."""
        return self.wd(self._progress(successful_steps, batch))

    def wd(self, progress: float) -> float:
        """Weight decay at ``progress``: Megatron's ``get_wd`` (the end value past the run's length)."""
        if self.wd_incr is None or progress > self.wd_incr:
            return self.end_wd
        ratio = float(progress) / float(self.wd_incr)
        coeff = ratio if self.wd_style == "linear" else 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def _progress(self, successful_steps: int, batch: int) -> int:
        """Megatron's ``num_steps`` when the step runs: what the successful steps before it consumed."""
        if self.unit == "iterations" and self.varying_batch:
            return self.samples / self.per_step
        return self.samples if self.unit == "samples" else successful_steps

    def advance(self, batch: int) -> None:
        """Count a successful step of ``batch`` sequences (a skipped fp16 step keeps its rate, as Megatron)."""
        self.samples += batch

    def lr(self, progress: float, max_lr: float | None = None, min_lr: float | None = None) -> float:
        """Learning rate at ``progress`` (successful steps, or samples, before the step); ``max_lr``/``min_lr``:
        another group's end points (default: --lr and --min-lr). Megatron's ``get_lr``, branch for branch."""
        max_lr = self.max_lr if max_lr is None else max_lr
        min_lr = self.min_lr if min_lr is None else min_lr
        if self.warmup > 0 and progress <= self.warmup:
            return self.warmup_init + (max_lr - self.warmup_init) * float(progress) / float(self.warmup)
        if self.style == "constant":
            return max_lr
        if progress > self.decay_iters:
            return min_lr
        if self.style == "inverse-square-root":
            g = self.per_step
            return max(min_lr, max_lr * max(self.warmup * g, 1) ** 0.5 / max(progress * g, 1) ** 0.5)
        if self.style == "WSD":
            start = self.decay_iters - self.wsd_decay
            coeff = 1.0 if progress <= start else _shape(self.wsd_style, (progress - start) / self.wsd_decay)
        else:
            coeff = _shape(self.style, (progress - self.warmup) / max(self.decay_iters - self.warmup, 1))
        return min_lr + coeff * (max_lr - min_lr)

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in self._KEYS}

    def load_state_dict(self, state: dict, keep: str | None = None) -> list[str]:
        """Resume a checkpoint's schedule, as Megatron's ``OptimizerParamScheduler.load_state_dict``: the progress
        (samples consumed) is the checkpoint's; where a schedule setting (``_CHECKED``) differs from this command
        line's, ``keep`` decides: ``"command line"`` (``--override-opt_param-scheduler``), ``"checkpoint"``
        (``--use-checkpoint-opt_param-scheduler``), or None: a ``ConfigError`` naming every difference. The WSD
        decay, its shape and the warm-up's start are this command line's (Megatron does not save them). A
        checkpoint written before sample-counted schedules counts iterations. Returns the lines to log."""
        old = {"unit": "iterations", "samples": 0, "decoupled_max_lr": self.decoupled_max_lr,
               "decoupled_min_lr": self.decoupled_min_lr, "start_wd": self.start_wd, "end_wd": self.end_wd,
               "wd_style": self.wd_style, "wd_incr": self.wd_incr, "per_step": self.per_step}
        saved = {key: state[key] if key in state else old[key] for key, _ in _CHECKED}
        diffs = [(flag, saved[key], getattr(self, key)) for key, flag in _CHECKED if saved[key] != getattr(self, key)]
        self.samples = state.get("samples", 0)
        rebatched = saved["per_step"] != self.per_step
        if not diffs:
            return []
        said = "; ".join(f"{flag}: {was!r} in the checkpoint, {now!r} now" for flag, was, now in diffs)
        if keep is None:
            raise ConfigError(f"--load: the checkpoint's learning-rate schedule differs from this command line's "
                              f"({said}): give --override-opt_param-scheduler to use the command line's, or "
                              f"--use-checkpoint-opt_param-scheduler to keep the checkpoint's")
        if keep == "checkpoint":
            for key, _ in _CHECKED:
                setattr(self, key, saved[key])
        self.varying_batch = self.varying_batch or rebatched  # progress: the samples over the batch that stands
        return [f"learning-rate schedule: the {keep}'s values stand ({said})"]


_CHECKED = (("unit", "the schedule's unit (--train-iters or --train-samples)"), ("max_lr", "--lr"),
            ("min_lr", "--min-lr"), ("style", "--lr-decay-style"),
            ("warmup", "the warm-up (--lr-warmup-iters, -samples or -fraction)"),
            ("decay_iters", "the decay length (--lr-decay-iters or -samples, else --train-iters or -samples)"),
            ("decoupled_max_lr", "--decoupled-lr"), ("decoupled_min_lr", "--decoupled-min-lr"),
            ("start_wd", "the first weight decay (--weight-decay, or --start-weight-decay)"),
            ("end_wd", "the last weight decay (--weight-decay, or --end-weight-decay)"),
            ("wd_style", "--weight-decay-incr-style"),
            ("wd_incr", "the weight decay's rise (--train-iters or --train-samples)"),
            ("per_step", "--global-batch-size (the samples of an iteration, in which Megatron counts the schedule)"))
"""(setting, what the command line calls it): what Megatron's scheduler checks against a checkpoint (its
``_check_and_set``: max and min lr, warm-up and decay steps, decay style, the weight decay's ends, style and
length; all in samples, so a changed --global-batch-size too), and the embedding's decoupled rates. A constant
weight decay has no length (None): extending the run does not change it. Checkpoints written before the weight decay
or the batch size was recorded count as the command line's."""


def check_lengths(config: OptimizerConfig, train_iters: int, train_samples: int | None = None) -> None:
    """The schedule's lengths as Megatron's ``OptimizerParamScheduler`` asserts them, in the run's unit: a warm-up
    shorter than the decay (it asserts ``lr_warmup_steps < lr_decay_steps`` for every style; --lr-warmup-fraction
    is checked to lie below 1 where it is read), and WSD's final decay given (it has no default). A ConfigError
    names the flags and the fix, before anything is built."""
    unit, total = ("samples", train_samples) if train_samples else ("iters", train_iters)
    warmup = getattr(config, f"lr_warmup_{unit}")
    decay_flag = f"--lr-decay-{unit}"
    decay = getattr(config, f"lr_decay_{unit}")
    if decay is None:
        decay, decay_flag = total, f"--train-{unit} (no {decay_flag})"
    if warmup >= decay:
        raise ConfigError(f"--lr-warmup-{unit} {warmup} is not shorter than the decay, {decay_flag} {decay}: "
                          f"Megatron's scheduler needs the warm-up to end before the decay does; give a shorter "
                          f"warm-up or a longer decay")
    if config.lr_decay_style == "WSD" and getattr(config, f"lr_wsd_decay_{unit}") is None:
        old = max((decay - warmup) // 10, 1)  # the default before 2026-12-07: a tenth of the span after the warm-up
        raise ConfigError(f"--lr-decay-style WSD needs the length of its final decay: give --lr-wsd-decay-{unit} N "
                          f"(Megatron's scheduler has no default; a run begun before 2026-12-07 without it decayed "
                          f"over {old}: resume it with --lr-wsd-decay-{unit} {old})")


def _shape(style: str, ratio: float) -> float:
    """Decay coefficient in [0, 1] for progress ``ratio`` in [0, 1] (Megatron's formulas; its WSD
    ``exponential`` is ``2 * 0.5**ratio - 1``, which reaches 0 at the end)."""
    ratio = min(max(ratio, 0.0), 1.0)
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return 2.0 * math.pow(0.5, ratio) - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(ratio)
    raise ValueError(f"unknown decay shape {style!r}")
