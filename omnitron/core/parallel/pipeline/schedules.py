"""Pipeline schedules as data: pure functions returning one list of actions per pipeline rank.

An :class:`Action` is ``(chunk, kind, microbatch)`` printed as ``"1F3"`` (chunk 1, forward of
micro-batch 3). Kinds: ``F`` forward; ``B`` backward (full, or input-gradient only when the same
table also holds a ``W`` for that chunk and micro-batch); ``W`` weight-gradient.

Stage numbering follows Megatron's interleaving (style ``loop``): model chunk ``c`` on pipeline rank
``r`` is virtual stage ``c * pp + r``. The V-shaped schedules (``zb-v``, ``dualpipe-v``; style ``v``)
hold two chunks per rank: chunk 0 is stage ``r`` and chunk 1 stage ``2 pp - 1 - r``, so rank 0 holds
the first and the last stage and rank ``pp - 1`` passes its own activation from stage ``pp - 1`` to
``pp`` without communication. Activations flow from stage ``k`` to ``k + 1``, gradients back.
Every builder here is checked without processes by :func:`simulate` (dependencies, no deadlock,
timeline and peak in-flight activations) and executed by the one runtime in ``runtime.py``.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable

from omnitron.core.config.parallel import ConfigError
from omnitron.core.parallel.pipeline.actions import (  # noqa: F401 - re-exported: callers import them from here
    Action, Schedule, _check, place_stage, virtual_stage, zb_stage_cost)
from omnitron.core.parallel.pipeline.vshape import schedule_dualpipe_v, schedule_zb_v

SCHEDULES = ("none", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v")
"""Values of ``--pipeline-schedule`` (``none`` = gradient accumulation without a pipeline)."""
V_SCHEDULES = ("zb-v", "dualpipe-v")
"""The schedules whose two chunks per rank sit in a V (style ``v``)."""


def schedule_style(name: str | None) -> str:
    """``v`` for the V-shaped schedules (chunk 1 of rank r is stage 2p-1-r), else ``loop``."""
    return "v" if name in V_SCHEDULES else "loop"


def schedule_no_pipelining(num_microbatches: int) -> Schedule:
    """Gradient accumulation on one stage: F0 B0 F1 B1 ..."""
    _check(1, num_microbatches)
    table = []
    for i in range(num_microbatches):
        table += [Action(0, "F", i), Action(0, "B", i)]
    return Schedule("none", 1, 1, num_microbatches, {0: tuple(table)})


def schedule_1f1b(pp: int, num_microbatches: int) -> Schedule:
    """One-forward-one-backward: rank r runs pp-r-1 warm-up forwards, then alternates F and B."""
    _check(pp, num_microbatches)
    m = num_microbatches
    tables = {}
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        table = [Action(0, "F", i) for i in range(warmup)]
        for j in range(m - warmup):
            table += [Action(0, "F", warmup + j), Action(0, "B", j)]
        table += [Action(0, "B", j) for j in range(m - warmup, m)]
        tables[r] = tuple(table)
    return Schedule("1f1b", pp, 1, m, tables)


def schedule_interleaved(pp: int, vp: int, num_microbatches: int, group: int | None = None) -> Schedule:
    """Interleaved 1F1B over ``vp`` model chunks per rank (Megatron's ordering).

    Micro-batches go through the chunks in groups of ``group`` (``--microbatch-group-size-per-virtual-pipeline-
    stage``, default pp): all chunks run on one group before the next group starts; a last group of fewer
    micro-batches (at least pp) closes the table. Backwards run the same order with the chunks reversed. Rank r
    warms up with ``2 (pp - r - 1) + (vp - 1) group`` forwards. Needs pp <= group <= micro-batches and the
    remainder of micro-batches / group 0 or >= pp (Megatron's rules: a smaller last group stalls the pipeline).
    """
    _check(pp, num_microbatches)
    m = num_microbatches
    if vp < 2:
        raise ConfigError(f"interleaved schedule needs >= 2 virtual stages per rank, got {vp}; "
                          f"set --num-layers-per-virtual-pipeline-stage or use --pipeline-schedule 1f1b")
    if pp < 2:
        raise ConfigError("interleaved schedule needs --pipeline-model-parallel-size >= 2")
    n = _group_size(pp, m, group)
    order = _group_order(m, vp, n)
    total = m * vp

    def fwd(k: int) -> Action:
        return Action(order[k][0], "F", order[k][1])

    def bwd(k: int) -> Action:
        return Action(vp - 1 - order[k][0], "B", order[k][1])

    tables = {}
    for r in range(pp):
        # NOTE: m == pp is no special case: Megatron's older releases ran every forward as warm-up then, its
        # schedules.py at d98e8a6 (get_pp_rank_microbatches) does not, and later ranks hold fewer activations
        warmup = min((pp - r - 1) * 2 + (vp - 1) * n, total)
        table = [fwd(k) for k in range(warmup)]
        for j in range(total - warmup):
            table += [fwd(warmup + j), bwd(j)]
        table += [bwd(j) for j in range(total - warmup, total)]
        tables[r] = tuple(table)
    return Schedule("interleaved", pp, vp, m, tables)


GROUP_FLAG = "--microbatch-group-size-per-virtual-pipeline-stage"


def _group_size(pp: int, m: int, group: int | None) -> int:
    """The interleaved schedule's micro-batch group size, checked by Megatron's rules (default: pp)."""
    if group is None:
        if m % pp:
            raise ConfigError(f"interleaved schedule needs the number of micro-batches ({m}) to be a multiple of "
                              f"--pipeline-model-parallel-size ({pp}); change --global-batch-size or "
                              f"--micro-batch-size")
        return pp
    if not pp <= group <= m:
        raise ConfigError(f"{GROUP_FLAG} {group} must lie between --pipeline-model-parallel-size ({pp}) and the "
                          f"number of micro-batches ({m}); change it or --global-batch-size")
    if 0 < m % group < pp:
        raise ConfigError(f"{GROUP_FLAG} {group}: the last group holds {m % group} of the {m} micro-batches, fewer "
                          f"than --pipeline-model-parallel-size ({pp}), which stalls the pipeline; pick a group "
                          f"size whose remainder is 0 or >= {pp}, or change --global-batch-size")
    return group


def _group_order(m: int, vp: int, n: int) -> list[tuple[int, int]]:
    """(chunk, micro-batch) of each forward in turn: every chunk over one group of n micro-batches, then the
    next group; the last group takes what remains."""
    order = []
    for start in range(0, m, n):
        stop = m if start + n >= m else start + n
        order += [(c, i) for c in range(vp) for i in range(start, stop)]
    return order


def schedule_zb_h1(pp: int, num_microbatches: int,
                   stage_cost: Callable[[int, str], float] = zb_stage_cost) -> Schedule:
    """Zero-bubble H1: backward split into B (input grad) and W (weight grad); W fills bubbles.

    Built by list-scheduling F, B, W (durations from ``stage_cost``, integers) on an ideal clock
    with the priority B > F > W. Rank r keeps at most ``pp - r`` micro-batches between F and B
    (1F1B's limit) and defers at most ``pp - 1`` W passes, which brings the bubble to
    (p-1)/(3m+p-1) for m >= p: a third of 1F1B's idle time. NOTE: the runtime keeps a
    micro-batch's graph (and the gradients W needs) until its W, so a rank holds up to
    ``2p - 1 - r`` micro-batches of activations (1F1B: ``p - r``); the paper's ZB-H1 stays at
    1F1B's peak because its B frees what W does not need. Capping the held ones at ``p - r``
    here would leave two thirds of 1F1B's idle time (BENCHMARKS.md); the planner prices the
    held ones (omnitron/plan/memory.py).
    """
    _check(pp, num_microbatches)
    m, never = num_microbatches, float("inf")
    done: dict[tuple[str, int, int], float] = {}  # (kind, rank, mb) -> finish time
    tables: dict[int, list[Action]] = {r: [] for r in range(pp)}
    next_f, next_b, before_b = [0] * pp, [0] * pp, [0] * pp
    pending_w: list[list[int]] = [[] for _ in range(pp)]
    busy_until = [0.0] * pp
    t = 0
    while any(len(tables[r]) < 3 * m for r in range(pp)):
        started = []
        for r in range(pp):
            while busy_until[r] <= t:  # zero-cost actions let a rank start another in the same tick
                f, b = next_f[r], next_b[r]
                grad_from = ("F", r, b) if r == pp - 1 else ("B", r + 1, b)
                b_ready = b < f and done.get(grad_from, never) <= t
                f_ready = (f < m and before_b[r] < pp - r and before_b[r] + len(pending_w[r]) < 2 * pp - 1 - r
                           and (r == 0 or done.get(("F", r - 1, f), never) <= t))
                if b_ready:
                    act = Action(0, "B", b)
                    next_b[r], before_b[r] = b + 1, before_b[r] - 1
                    pending_w[r].append(b)
                elif f_ready:
                    act = Action(0, "F", f)
                    next_f[r], before_b[r] = f + 1, before_b[r] + 1
                elif pending_w[r]:
                    act = Action(0, "W", pending_w[r].pop(0))
                else:
                    break
                tables[r].append(act)
                busy_until[r] = t + stage_cost(r, act.kind)
                started.append(((act.kind, r, act.microbatch), busy_until[r]))
        for key, end in started:
            done[key] = end
        t += 1
    return Schedule("zb-h1", pp, 1, m, {r: tuple(v) for r, v in tables.items()})


def build_schedule(name: str | None, pp: int, vp: int | None, num_microbatches: int,
                   group: int | None = None) -> Schedule:
    """The schedule for ``--pipeline-schedule name`` (None picks: none / 1f1b / interleaved). ``group``:
    the interleaved schedule's micro-batch group size (other schedules ignore it, as Megatron does)."""
    vp = vp or 1
    if name is None:
        name = "none" if pp == 1 else ("interleaved" if vp > 1 else "1f1b")
    if name not in SCHEDULES:
        raise ConfigError(f"--pipeline-schedule {name!r} unknown; choose one of {', '.join(SCHEDULES)}")
    if name in V_SCHEDULES:
        if vp != 2 or pp < 2:
            raise ConfigError(f"--pipeline-schedule {name} runs two model chunks per rank in a V over "
                              f"--pipeline-model-parallel-size >= 2, got pp={pp} and {vp} chunk(s) per rank; set "
                              f"--num-layers-per-virtual-pipeline-stage to num-layers / (2 x pp)")
        return (schedule_zb_v if name == "zb-v" else schedule_dualpipe_v)(pp, num_microbatches)
    if name != "interleaved" and vp > 1:
        raise ConfigError(f"--pipeline-schedule {name} runs one model chunk per rank, but virtual pipeline size is "
                          f"{vp}; use --pipeline-schedule interleaved or drop --num-layers-per-virtual-pipeline-stage")
    if name == "none":
        if pp != 1:
            raise ConfigError(f"--pipeline-schedule none needs --pipeline-model-parallel-size 1, got {pp}")
        return schedule_no_pipelining(num_microbatches)
    if name == "1f1b":
        return schedule_1f1b(pp, num_microbatches)
    if name == "zb-h1":
        return schedule_zb_h1(pp, num_microbatches)
    return schedule_interleaved(pp, vp, num_microbatches, group)


@lru_cache(maxsize=256)
def cached_schedule(name: str | None, pp: int, vp: int | None, num_microbatches: int,
                    group: int | None = None) -> Schedule:
    """:func:`build_schedule`, kept for the planner's search: its candidates share a few tables, and ZB-V's
    builder simulates several of them (callers must not change the returned schedule)."""
    return build_schedule(name, pp, vp, num_microbatches, group)
