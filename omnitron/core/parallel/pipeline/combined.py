"""Megatron's combined 1F1B as schedule data (``--overlap-moe-expert-parallel-comm``).

In the steady state of a one-forward-one-backward table each forward is paired with the backward after it
(``Schedule.pairs``) and the pair runs as one action (``Schedule.combined``): the runtime hands both to the
model's combined runner, which interleaves them so each one's expert-parallel all-to-alls are in flight while
the other computes (``omnitron/core/transformer/moe/overlap.py``). A pair's two passes must be independent, so
every rank runs more forwards before its first backward: one more without pipelining and interleaved
(Megatron's extra warm-up forward), ``pp - r`` more on rank ``r`` of 1F1B:

    none, m = 4:          F0 F1 B0 F2 B1 F3 B2 B3        pairs (F1 & B0) (F2 & B1) (F3 & B2)
    1f1b, pp = 2, rank 0: F0 F1 F2 F3 B0 B1 B2 B3        pair  (F3 & B0)
                  rank 1: F0 F1 B0 F2 B1 F3 B2 B3        pairs (F1 & B0) (F2 & B1) (F3 & B2)

A pair starts once both its inputs have arrived and its outputs (the forward's activation, the backward's
input gradient) leave when it ends (``simulate.py``, ``p2p.py``). In 1F1B with one more forward, rank r's
pair t would wait for rank r + 1's pair t (the gradient) which waits for rank r's pair t - 1 (the activation):
the ranks' pairs run one after another, 27 -> 45 units at pp 2, m 8 on the ideal clock; with ``pp - r`` more
the gradient comes from a pair two rounds back and the step keeps 1F1B's 27 units (33 at pp 4, m 8), for up
to twice 1F1B's activations on rank 0 (interleaved already warms up twice as deep: one more suffices there).
Backwards keep their order, so gradients accumulate in the same order as without the pairs.

``dualpipe-v`` has such pairs by design (``Schedule.pairs``, forward of one chunk with the other chunk's
backward): they are combined as they are. Its forward's activation then leaves at the pair's end instead of
before the backward computes, 1-3 units longer on the ideal clock (pp 2, m 8: 49 -> 50; pp 4, m 16: 99 -> 102),
which the hidden all-to-alls are to pay for. ZB-H1 and ZB-V have no forward/backward pairs: refused.
"""
from __future__ import annotations

import dataclasses

from omnitron.core.config.parallel import ConfigError
from omnitron.core.parallel.pipeline.actions import Action, Schedule

SUPPORTED = ("none", "1f1b", "interleaved", "dualpipe-v")
"""The schedules whose pairs are built (the one-forward-one-backward tables) or given (DualPipeV)."""


def check_schedule(name: str | None) -> None:
    """Refuse ``--pipeline-schedule name`` (None: picked from pp and vp, always one of :data:`SUPPORTED`)."""
    if name is not None and name not in SUPPORTED:
        raise ConfigError(f"--overlap-moe-expert-parallel-comm pairs the forwards and backwards of "
                          f"--pipeline-schedule {', '.join(SUPPORTED)}, not {name}; use one of those or drop the flag")


def _deeper_warmup(table: tuple[Action, ...], extra: int) -> tuple[list[Action], list[int]]:
    """``table`` (warm-up forwards, forward/backward alternating, cool-down backwards) with ``extra`` more warm-up
    forwards, the rest alternating as pairs; the new table and the indices of its paired forwards."""
    forwards = [a for a in table if a.kind == "F"]
    backwards = [a for a in table if a.kind == "B"]
    leading = next((i for i, a in enumerate(table) if a.kind != "F"), len(table))  # warm-up + the first F of F/B
    warmup = min(leading - 1 + extra, len(forwards)) if leading < len(table) else len(forwards)
    out, pairs = forwards[:warmup], []
    for f, b in zip(forwards[warmup:], backwards):
        pairs.append(len(out))
        out += [f, b]
    return out + backwards[len(forwards) - warmup:], pairs


def combine_1f1b(schedule: Schedule) -> Schedule:
    """``schedule`` (``none``, ``1f1b``, ``interleaved`` or ``dualpipe-v``) with its steady-state forward/backward
    pairs combined."""
    check_schedule(schedule.name)
    if schedule.name == "dualpipe-v":  # its own pairs (W passes and all: never rebuilt)
        return dataclasses.replace(schedule, name=f"{schedule.name}+combined", combined=True)
    tables, pairs = {}, {}
    for r, table in schedule.tables.items():
        new, firsts = _deeper_warmup(table, schedule.pp - r if schedule.name == "1f1b" else 1)
        tables[r], pairs[r] = tuple(new), frozenset(firsts)
    return dataclasses.replace(schedule, name=f"{schedule.name}+combined", tables=tables, pairs=pairs,
                               combined=True)
