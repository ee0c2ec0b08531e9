"""Stop a run that has gone numerically wrong before it does harm (``--check-for-nan-in-loss-and-grad``,
``--max-consecutive-skipped-iterations``).

Every decision here is taken on values that are already equal on every rank, so all ranks raise at the same
point and no rank is left issuing a collective the others skipped: the step's loss is all-reduced over the
pipeline and data-parallel groups (and is the same on every tensor-parallel rank), the gradient norm is
all-reduced over the model-parallel ranks of a replica (and data-parallel replicas hold the same averaged
gradients), the fp16 overflow flag is MAX-reduced over the replica, and the weight check before a save does
its own all-reduce on every rank.
"""
from __future__ import annotations

import math

import torch

from omnitron.backends.collectives import ReduceOp


class TrainingStopped(RuntimeError):
    """The run stopped on purpose for a reason one line states (the launcher prints it, no traceback)."""


class NonFiniteError(TrainingStopped):
    """A non-finite loss, gradient norm or weight; :meth:`at` adds the iteration and rank."""

    BEFORE_STEP = "stopped before the optimizer step (no checkpoint of these weights is written)"

    def __init__(self, what: str, value, outcome: str = BEFORE_STEP, hint: str = "") -> None:
        self.what, self.value, self.outcome, self.hint = what, value, outcome, hint
        super().__init__(f"{what} is {value}")

    def at(self, iteration: int, rank: int) -> NonFiniteError:
        err = NonFiniteError(self.what, self.value, self.outcome, self.hint)
        err.args = (f"iteration {iteration}, rank {rank}: {self.what} is {self.value}, {self.outcome}; {self.hint}"
                    f"lower --lr, check the data, or resume from the last checkpoint "
                    f"(--no-check-for-nan-in-loss-and-grad turns this check off)",)
        return err


def check_loss(loss: float, enabled: bool) -> None:
    """Raise :class:`NonFiniteError` for a non-finite step loss (the loss every rank received)."""
    if enabled and not math.isfinite(loss):
        raise NonFiniteError("the loss", loss)


def check_grad_norm(norm: float, enabled: bool = True, loss_scale: float | None = None) -> None:
    """Raise :class:`NonFiniteError` for a non-finite global gradient norm (before clipping and the update). Under a
    loss scale the message names it first: a scale too large for the gradients overflows them. (The scale is then
    a constant --loss-scale: under fp16 dynamic scaling the check is off, as Megatron sets it.)"""
    if enabled and not math.isfinite(norm):
        hint = "" if loss_scale is None else (f"the gradients were scaled by {loss_scale:g} (a smaller --loss-scale, "
                                              f"or under --fp16 none: dynamic scaling skips overflowing steps "
                                              f"instead); ")
        raise NonFiniteError("the gradient norm", norm, hint=hint)


@torch.no_grad()
def weights_finite(flags, collectives, device=None) -> bool:
    """True when every rank's ``flags`` (0-dim bool tensors, its optimizer's ``masters_finite()``: the fp32 masters
    a step updates, and, sliced under the distributed optimizer, no pending gather to race) are all true. One MAX
    all-reduce over the world: call on every rank."""
    bad = torch.stack(flags).logical_not().any().float().reshape(1) if flags else torch.zeros(1, device=device)
    if collectives.is_initialized():
        collectives.all_reduce(bad, op=ReduceOp.MAX)
    return bool(bad.item() == 0)


class SkipCounter:
    """Counts loss-scaled steps skipped in a row on overflow; raises once ``limit`` is reached (0: never)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.run = limit, 0

    def update(self, skipped: bool, iteration: int, rank: int, loss_scale: float | None) -> None:
        self.run = self.run + 1 if skipped else 0
        if self.limit and self.run >= self.limit:
            raise TrainingStopped(
                f"iteration {iteration}, rank {rank}: {self.run} consecutive steps skipped on gradient overflow "
                f"(loss scale {loss_scale:g}): the scale cannot recover; lower --loss-scale or use dynamic scaling "
                f"(drop --loss-scale), or --bf16 (--max-consecutive-skipped-iterations sets the limit)")
