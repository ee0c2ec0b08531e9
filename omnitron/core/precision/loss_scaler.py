"""Loss scaling: a constant scale (--loss-scale; also under --bf16, as Megatron) or fp16's dynamic one.

The training step multiplies the loss's gradient by ``scale`` in backward (the reported loss stays unscaled, as
Megatron's); the optimizer divides the gradients by it, reports whether any was inf/nan, and calls :meth:`update`;
the step is then skipped (or, under --check-for-nan-in-loss-and-grad, the run stops). The dynamic scaler halves after
``hysteresis`` overflowing steps and doubles after ``growth_interval`` clean ones (Megatron's rule).
"""
from __future__ import annotations

import torch

from omnitron.core.config.training import PrecisionConfig


class ConstantLossScaler:
    """A fixed scale; overflowing steps are still skipped."""

    def __init__(self, scale: float) -> None:
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        """The scale never changes."""

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler:
    """Back off by ``backoff_factor`` after ``hysteresis`` overflows (never below ``min_scale``);
    grow by ``growth_factor`` after ``growth_interval`` consecutive clean steps."""

    def __init__(self, initial_scale: float = 2.0 ** 32, min_scale: float = 1.0, growth_interval: int = 1000,
                 hysteresis: int = 2, growth_factor: float = 2.0, backoff_factor: float = 0.5) -> None:
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])


def build_loss_scaler(config: PrecisionConfig, distributed_optimizer: bool = False):
    """The scaler Megatron's get_megatron_optimizer builds: --loss-scale gives a constant one under --fp16, --bf16 or
    the distributed optimizer (fp32 too); --fp16 without it a dynamic one; anything else none."""
    if config.loss_scale is not None and (config.fp16 or config.bf16 or distributed_optimizer):
        return ConstantLossScaler(config.loss_scale)
    if not config.fp16:
        return None
    return DynamicLossScaler(config.initial_loss_scale, config.min_loss_scale, config.loss_scale_window,
                             config.hysteresis)


def params_dtype(config: PrecisionConfig) -> torch.dtype:
    """Parameter dtype for --bf16 / --fp16 / fp32."""
    return torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else torch.float32
