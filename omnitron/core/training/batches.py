"""The global batch size of each step: constant, or ramped up over samples (``--rampup-batch-size``).

Megatron's ``--rampup-batch-size START INCREMENT SAMPLES`` starts at START sequences per step and adds
INCREMENT each time another ``SAMPLES / ((GBS - START) / INCREMENT)`` samples have been consumed,
until ``--global-batch-size`` is reached (after SAMPLES samples at the latest). The step that starts
with ``consumed`` samples behind it uses :meth:`BatchRamp.global_batch` of ``consumed``, so the size
is a pure function of the data position a checkpoint already records. The samples themselves are
read in the same order with or without a ramp (the sampler walks the dataset from ``consumed`` on);
only how many go into each step changes.

``--train-samples N`` turns into iterations as Megatron counts them (:meth:`BatchRamp.iterations`):
the ramp's steps, then whole global batches of what is left (a partial last batch is dropped).
"""
from __future__ import annotations

from dataclasses import dataclass

from omnitron.core.config.parallel import ConfigError


@dataclass(frozen=True)
class BatchRamp:
    """Batch size per step for one run (``rampup`` None: always ``global_batch_size``)."""

    global_batch_size: int
    micro_times_dp: int
    """--micro-batch-size x data-parallel size: every step's batch is a multiple of it."""
    rampup: tuple[int, int, int] | None = None
    """(start, increment, samples) of --rampup-batch-size."""

    def __post_init__(self) -> None:
        if self.rampup is None:
            return
        start, inc, samples = self.rampup
        flag = f"--rampup-batch-size {start} {inc} {samples}"
        if start < 1 or inc < 1 or samples < 0:
            raise ConfigError(f"{flag}: start and increment must be >= 1 and samples >= 0")
        if start > self.global_batch_size or (self.global_batch_size - start) % inc:
            raise ConfigError(f"{flag}: --global-batch-size {self.global_batch_size} must be start plus a whole "
                              f"number of increments")
        if start % self.micro_times_dp or inc % self.micro_times_dp:
            raise ConfigError(f"{flag}: start and increment must be multiples of --micro-batch-size x data-parallel "
                              f"size = {self.micro_times_dp}; change them or the layout")

    def global_batch(self, consumed: int) -> int:
        """Sequences in the step that starts after ``consumed`` samples."""
        if self.rampup is None:
            return self.global_batch_size
        start, inc, samples = self.rampup
        increments = (self.global_batch_size - start) // inc
        if increments == 0 or consumed > samples:
            return self.global_batch_size
        per_increment = samples / increments  # NOTE: a float, as Megatron's; int() of the ratio below
        return min(start + int(consumed / per_increment) * inc, self.global_batch_size)

    def num_microbatches(self, consumed: int) -> int:
        """Micro-batches per data-parallel rank in the step that starts after ``consumed`` samples."""
        return self.global_batch(consumed) // self.micro_times_dp

    def sizes(self) -> list[int]:
        """Every distinct micro-batch count a run can take (each needs a valid pipeline schedule)."""
        if self.rampup is None:
            return [self.global_batch_size // self.micro_times_dp]
        start, inc, _ = self.rampup
        return [b // self.micro_times_dp for b in range(start, self.global_batch_size + 1, inc)]

    def iterations(self, train_samples: int) -> int:
        """Steps of a ``--train-samples`` run: the ramp's (its last step may cross SAMPLES), then whole
        global batches of the rest."""
        steps = consumed = 0
        if self.rampup is not None:
            while consumed <= self.rampup[2] and consumed <= train_samples:
                consumed += self.global_batch(consumed)
                steps += 1
        return steps + max(train_samples - consumed, 0) // self.global_batch_size
