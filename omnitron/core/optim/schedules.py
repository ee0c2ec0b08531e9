"""Learning-rate schedules: linear warmup, then constant / linear / cosine / WSD decay to --min-lr.

``lr(iteration)`` is a pure function of the 1-based iteration whose optimizer step uses it, so
a resumed run needs only the iteration to continue the exact schedule (the state dict carries
the settings to detect a changed schedule).
"""
from __future__ import annotations

import math

from omnitron.core.config.training import OptimizerConfig


class LRScheduler:
    """Megatron's schedule shapes. NOTE: iteration ``i`` (1-based) of warmup uses ``lr * i / warmup``,
    so the first step already moves (Megatron's first warmup step uses lr 0)."""

    def __init__(self, config: OptimizerConfig, train_iters: int) -> None:
        self.max_lr, self.min_lr = config.lr, config.min_lr
        self.style = config.lr_decay_style
        self.warmup = config.lr_warmup_iters
        self.decay_iters = config.lr_decay_iters or train_iters
        span = max(self.decay_iters - self.warmup, 0)
        self.wsd_decay = config.lr_wsd_decay_iters if config.lr_wsd_decay_iters is not None else max(span // 10, 1)
        self.wsd_style = config.lr_wsd_decay_style

    def lr(self, iteration: int) -> float:
        """Learning rate for the optimizer step of ``iteration`` (1-based)."""
        if self.warmup > 0 and iteration <= self.warmup:
            return self.max_lr * iteration / self.warmup
        if self.style == "constant":
            return self.max_lr
        if iteration >= self.decay_iters:
            return self.min_lr
        delta = self.max_lr - self.min_lr
        if self.style == "WSD":
            start = self.decay_iters - self.wsd_decay
            if iteration <= start:
                return self.max_lr
            ratio = (iteration - start) / self.wsd_decay
            coeff = _shape(self.wsd_style, ratio)
        else:
            ratio = (iteration - self.warmup) / max(self.decay_iters - self.warmup, 1)
            coeff = _shape(self.style, ratio)
        return self.min_lr + coeff * delta

    def state_dict(self) -> dict:
        return {"max_lr": self.max_lr, "min_lr": self.min_lr, "style": self.style, "warmup": self.warmup,
                "decay_iters": self.decay_iters, "wsd_decay": self.wsd_decay, "wsd_style": self.wsd_style}

    def load_state_dict(self, state: dict) -> None:
        """Adopt a checkpoint's schedule (the command line's schedule is overridden, as in Megatron)."""
        for key in ("max_lr", "min_lr", "style", "warmup", "decay_iters", "wsd_decay", "wsd_style"):
            setattr(self, key, state[key])


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
