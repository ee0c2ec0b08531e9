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
    """A fixed scale (--loss-scale); overflowing steps are still skipped. A checkpoint's scale is not loaded: the
    command line's stays, as Megatron's ConstantGradScaler (a dynamic fp16 scale must not carry into a bf16 run)."""

    def __init__(self, scale: float) -> None:
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        """The scale never changes."""

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        """Nothing: the scale is --loss-scale's, whatever the checkpoint held."""


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
        """A dynamic scaler's state carries over; a constant one's (no trackers: --loss-scale) does not, and the
        scale starts at --initial-loss-scale (as Megatron's for a checkpoint without a scaler)."""
        if "growth_tracker" not in state:
            return
        self.scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])


def loaded_scale_note(scaler, saved: dict | None) -> str | None:
    """One line saying what became of a checkpoint's loss scale ``saved`` under this run's ``scaler`` where it was
    not taken over (None where it was, or where the checkpoint holds none)."""
    if saved is None:
        return None
    was = f"the checkpoint's loss scale {float(saved['scale']):g}"
    if scaler is None:
        return f"{was} is dropped: this run scales no loss"
    if isinstance(scaler, ConstantLossScaler):
        return None if float(saved["scale"]) == scaler.scale else f"{was} is not loaded: --loss-scale {scaler.scale:g}"
    if "growth_tracker" not in saved:
        return f"{was} was constant (--loss-scale): the dynamic scale starts at --initial-loss-scale {scaler.scale:g}"
    return None


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
