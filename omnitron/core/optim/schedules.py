"""Learning-rate schedules: linear warmup, then constant / linear / cosine / WSD decay to --min-lr.

``lr(progress)`` is a pure function of the 1-based iteration whose optimizer step uses it, or, in a
``--train-samples`` run, of the samples consumed by the successful steps up to and including it
(Megatron's sample-counted schedule, which follows a ``--rampup-batch-size`` ramp). A resumed run
continues the exact schedule from the optimizer's step count or the state dict's sample count.
With ``--decoupled-lr`` the input embedding and output layer follow the same shape between
``--decoupled-lr`` and ``--decoupled-min-lr`` (Megatron's per-group max_lr / min_lr).
"""
from __future__ import annotations

import math

from omnitron.core.config.training import OptimizerConfig


class LRScheduler:
    """Megatron's schedule shapes, counted in iterations or (``train_samples`` given: a ``--train-samples``
    run) in samples. NOTE: step ``i`` (1-based) of warmup uses ``lr * i / warmup`` (in samples: the samples
    consumed with that step), so the first step already moves (Megatron's first warmup step uses lr 0)."""

    _KEYS = ("max_lr", "min_lr", "style", "warmup", "decay_iters", "wsd_decay", "wsd_style", "unit", "warmup_init",
             "samples", "decoupled_max_lr", "decoupled_min_lr")

    def __init__(self, config: OptimizerConfig, train_iters: int, train_samples: int | None = None) -> None:
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
        span = max(self.decay_iters - self.warmup, 0)
        self.wsd_decay = wsd if wsd is not None else max(span // 10, 1)
        self.wsd_style = config.lr_wsd_decay_style
        self.samples = 0
        """Samples of the successful steps so far (the progress of a sample-counted schedule)."""

    def lr_for_step(self, successful_steps: int, batch: int) -> float:
        """The rate of the next step, after ``successful_steps`` successful ones; ``batch``: its sequences."""
        return self.lr(self._progress(successful_steps, batch))

    def decoupled_lr_for_step(self, successful_steps: int, batch: int) -> float | None:
        """The next step's rate of the embedding and output layer (None without --decoupled-lr)."""
        if self.decoupled_max_lr is None:
            return None
        return self.lr(self._progress(successful_steps, batch), self.decoupled_max_lr, self.decoupled_min_lr)

    def _progress(self, successful_steps: int, batch: int) -> int:
        return self.samples + batch if self.unit == "samples" else successful_steps + 1

    def advance(self, batch: int) -> None:
        """Count a successful step of ``batch`` sequences (a skipped fp16 step keeps its rate, as Megatron)."""
        self.samples += batch

    def lr(self, progress: int, max_lr: float | None = None, min_lr: float | None = None) -> float:
        """Learning rate at ``progress``: the 1-based iteration, or the samples consumed with the step;
        ``max_lr``/``min_lr``: another group's end points (default: --lr and --min-lr)."""
        max_lr = self.max_lr if max_lr is None else max_lr
        min_lr = self.min_lr if min_lr is None else min_lr
        if self.warmup > 0 and progress <= self.warmup:
            return self.warmup_init + (max_lr - self.warmup_init) * progress / self.warmup
        if self.style == "constant":
            return max_lr
        if progress >= self.decay_iters:
            return min_lr
        delta = max_lr - min_lr
        if self.style == "WSD":
            start = self.decay_iters - self.wsd_decay
            if progress <= start:
                return max_lr
            ratio = (progress - start) / self.wsd_decay
            coeff = _shape(self.wsd_style, ratio)
        else:
            ratio = (progress - self.warmup) / max(self.decay_iters - self.warmup, 1)
            coeff = _shape(self.style, ratio)
        return min_lr + coeff * delta

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in self._KEYS}

    def load_state_dict(self, state: dict) -> None:
        """Adopt a checkpoint's schedule (the command line's schedule is overridden, as in Megatron); a
        checkpoint written before sample-counted schedules counts iterations from a warmup that starts at 0."""
        old = {"unit": "iterations", "warmup_init": 0.0, "samples": 0, "decoupled_max_lr": self.decoupled_max_lr,
               "decoupled_min_lr": self.decoupled_min_lr}
        for key in self._KEYS:
            setattr(self, key, state[key] if key in state else old[key])


def _shape(style: str, ratio: float) -> float:
    """Decay coefficient in [0, 1] for progress ``ratio`` in [0, 1]."""
    ratio = min(max(ratio, 0.0), 1.0)
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return 0.5 ** (10.0 * ratio) if ratio < 1.0 else 0.0
    raise ValueError(f"unknown decay shape {style!r}")
