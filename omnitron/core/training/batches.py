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

Megatron's ``--step-batch-size-schedule "0:16 2.4B:320 ..."`` (megatron/core/num_microbatches_calculator.py at
d98e8a6, ``StepBatchsizeNumMicroBatchesCalculator``): entries ``THRESHOLD:BS`` (separated by spaces or commas;
both numbers take the suffixes K, M, B, T = 1e3 .. 1e12 and are read as ``int(float(x) * suffix)``); Megatron's
training passes ``--seq-length``, so a threshold counts tokens and becomes ``threshold // seq_length`` samples;
entries are sorted, the first threshold must be 0 and thresholds strictly increase. The step that starts after
``consumed`` samples uses the BS of the last entry whose threshold is ``<= consumed``. A ``--train-samples`` run
takes as many steps as it needs to reach the samples (the last may overshoot: Megatron's ``update_train_iters``).
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
    steps: tuple[tuple[int, int], ...] | None = None
    """(threshold in samples, batch size) of --step-batch-size-schedule, thresholds ascending from 0."""

    def __post_init__(self) -> None:
        for _, size in self.steps or ():
            if size % self.micro_times_dp:
                raise ConfigError(f"--step-batch-size-schedule: batch size {size} is not a multiple of "
                                  f"--micro-batch-size x data-parallel size = {self.micro_times_dp}; change it or "
                                  "the layout")
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
        if self.steps is not None:
            return [size for threshold, size in self.steps if consumed >= threshold][-1]
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
        if self.steps is not None:
            return sorted({size // self.micro_times_dp for _, size in self.steps})
        if self.rampup is None:
            return [self.global_batch_size // self.micro_times_dp]
        start, inc, _ = self.rampup
        return [b // self.micro_times_dp for b in range(start, self.global_batch_size + 1, inc)]

    def samples(self, steps: int) -> int:
        """Samples the first ``steps`` steps consume."""
        consumed = 0
        for _ in range(steps):
            consumed += self.global_batch(consumed)
        return consumed

    def iterations(self, train_samples: int) -> int:
        """Steps of a ``--train-samples`` run: the ramp's (its last step may cross SAMPLES), then whole
        global batches of the rest; with a step schedule, steps until the samples are consumed."""
        steps = consumed = 0
        if self.steps is not None:
            while consumed < train_samples:
                consumed, steps = consumed + self.global_batch(consumed), steps + 1
            return steps
        if self.rampup is not None:
            while consumed <= self.rampup[2] and consumed <= train_samples:
                consumed += self.global_batch(consumed)
                steps += 1
        return steps + max(train_samples - consumed, 0) // self.global_batch_size


def _number(text: str) -> int:
    """``"2.4B"`` -> 2400000000: Megatron's ``_parse_numeric_value`` (suffix K M B T, ``int(float(x) * m)``)."""
    text = text.strip().upper()
    scale = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def parse_step_schedule(text: str, seq_length: int) -> tuple[tuple[int, int], ...]:
    """``--step-batch-size-schedule`` as ((threshold in samples, batch size), ...), checked as Megatron checks it."""
    flag = f"--step-batch-size-schedule {text!r}"
    entries = []
    for entry in text.strip().replace(",", " ").replace("'", " ").replace('"', " ").split():
        threshold, sep, size = entry.partition(":")
        try:
            entries.append((_number(threshold) // seq_length, _number(size)))
        except ValueError:
            sep = ""
        if not sep:
            raise ConfigError(f"{flag}: entry {entry!r} is not THRESHOLD:BATCH_SIZE (e.g. 0:16 2.4B:320)")
    entries.sort(key=lambda e: e[0])
    if not entries or entries[0][0] != 0:
        raise ConfigError(f"{flag}: the first threshold must be 0 (the batch size from the first step)")
    if any(b[0] <= a[0] for a, b in zip(entries, entries[1:])) or any(size < 1 for _, size in entries):
        raise ConfigError(f"{flag}: thresholds must strictly increase (in samples of --seq-length {seq_length}) "
                          "and batch sizes be >= 1")
    return tuple(entries)
