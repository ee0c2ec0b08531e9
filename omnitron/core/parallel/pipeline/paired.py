"""The no-pipelining schedule with forwards in pairs (``--overlap-moe-expert-parallel-comm``).

``F0 B0 F1 B1 F2 B2 F3 B3`` becomes ``F0 F1 B0 B1 F2 F3 B2 B3``: the runtime runs two adjacent forwards of
one chunk as one interleaved forward (:meth:`GPTModel.forward_pair`), then the backwards in the original
order, so the gradients accumulate in the same order as without pairing. Two micro-batches' activations are
alive at once (as in Megatron's combined 1F1B). An odd last micro-batch runs alone.
"""
from __future__ import annotations

import dataclasses

from omnitron.core.parallel.pipeline.schedules import Action, Schedule


def pair_forwards(schedule: Schedule) -> Schedule:
    """``schedule`` (one stage, no pipelining) with its forwards moved into adjacent pairs."""
    if schedule.pp != 1 or schedule.vp != 1:
        raise ValueError(f"forwards are paired without pipelining only (got pp={schedule.pp}, vp={schedule.vp})")
    m, table = schedule.num_microbatches, []
    for first in range(0, m, 2):
        pair = range(first, min(first + 2, m))
        table += [Action(0, "F", i) for i in pair] + [Action(0, "B", i) for i in pair]
    return dataclasses.replace(schedule, name=f"{schedule.name}+paired", tables={0: tuple(table)})
