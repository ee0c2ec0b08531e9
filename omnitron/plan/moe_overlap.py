"""The memory of a combined forward/backward pair (``--overlap-moe-expert-parallel-comm``).

In the steady state of the combined schedule (:mod:`omnitron.core.parallel.pipeline.combined`) one micro-batch's
forward and another's backward run in turns, handing over at each expert-parallel all-to-all
(:mod:`omnitron.core.transformer.moe.overlap`): the backward first, from its loss (or received gradient) to the top
MoE layer's combine backward; then the forward from its input to the bottom layer's dispatch; then the backward
through the top layer's experts to their dispatch backward; then the forward through the bottom layer's experts to
their combine; and so on, each side one segment at a time, whichever ends first leaving the other to run to its end.
So while the backward frees its micro-batch's saved tensors top layer first, the forward saves its own bottom layer
first, and the pair's peak is neither one micro-batch's (the plain schedule's) nor two (each held whole).

Derivation. Cut a chunk's transient probe log (:mod:`.transients`: one micro-batch's forward and backward, its
storages scaled to the real layout) at the marks the all-to-alls stand at: the forward at its MoE layers' experts'
start and end (the dispatch and the combine), the backward at their backward's start and end (the combine's and the
dispatch's backward all-to-alls). Replay the backward micro-batch's forward whole, then its backward's segments in
turn with a fresh copy of the forward micro-batch's segments, in the order above: every storage either pass
creates or frees at its own moment, the backward's transients (activation and weight gradients) beside what the
forward has saved so far. Its peak less the plain replay's (the forward then the backward of one micro-batch) is
what a pair adds over the plain schedule's peak (:func:`pair_excess`, never below 0: the pair's backward runs every
event of the plain backward, beside its forward's storages).

Per segment, with ``A`` what a layer saves before its dispatch (attention, router), ``E`` its experts, ``U`` after
its combine, the forward has saved ``A`` while the backward has freed its head and top ``U``, then ``A + E`` against
the top ``E`` too, and so on: the pair holds about one micro-batch and ``A - U - head`` more (plus the backward's
transients where they stand), independent of the depth; at h128, s128, 4 MoE layers of 8 experts at ep2 about
half a layer (``tests/plan/test_moe_overlap_memory.py``).

Not modelled: the all-to-alls' own buffers in flight at a hand-over (a communication buffer, as elsewhere in the
plan); the probe runs every layer MoE at balanced routing (a model with dense layers between, ``--moe-layer-freq``,
hands over at its MoE layers only: its segments are longer; priced as if every layer were MoE).

Under FP8 each chunk's log is the one the plain transient term replays (:func:`omnitron.plan.fp8_memory.fp8_log`):
the FP8 linears' saved inputs and scales per recipe (per-tensor: the 1-byte copy beside the wide input until the
module lets that go; block-wise: the wide input), their passes' own tensors at their moments. Measured 2026-12-07 on
cpu at ep2 (h128, s128, 4 layers, padded to capacity, tests/plan/test_moe_overlap_memory.py): what the overlap adds
is priced 1.42 MB against 1.20 MB held (tensorwise, delayed), 1.33 MB against 0.83 MB (block-wise); the wide log
priced 1.38 MB for each.
"""
from __future__ import annotations

import logging
from itertools import zip_longest

from omnitron.plan.transients import EXPERTS, EXPERTS_END, EXPERTS_FORWARD, EXPERTS_FORWARD_END, FORWARD_END

log = logging.getLogger(__name__)

_FORWARD_CUTS = (EXPERTS_FORWARD, EXPERTS_FORWARD_END)
_BACKWARD_CUTS = (EXPERTS, EXPERTS_END)


def _segments(events: list, lo: int, hi: int, cuts: tuple[str, ...]) -> list[list[int]]:
    """The indices ``lo .. hi - 1`` of ``events`` in runs, a new run starting at each marker named in ``cuts``."""
    runs: list[list[int]] = [[]]
    for i in range(lo, hi):
        if events[i][0] in cuts:
            runs.append([])
        runs[-1].append(i)
    return runs


def _forward_end(events: list) -> int:
    ends = [i for i, (op, _) in enumerate(events) if op == FORWARD_END]
    if not ends:
        raise RuntimeError("plan: the transient probe's log has no forward-end mark; the combined pair's memory "
                           "cannot be replayed")
    return ends[0]


def pair_peak(backward: tuple[list, list[float]], forward: tuple[list, list[float]]) -> float:
    """Peak live bytes of a combined pair: the micro-batch of ``backward`` (a probe's (events, sizes)) forward
    whole, then its backward's segments in turn with those of a fresh micro-batch's forward through ``forward``'s
    chunk (its log), the backward first (module docstring)."""
    b_events, b_sizes = backward
    f_events, f_sizes = forward
    b_end, f_end = _forward_end(b_events), _forward_end(f_events)
    live = top = 0.0

    def replay(events: list, sizes: list[float], indices: list[int]) -> None:
        nonlocal live, top
        for i in indices:
            op, n = events[i]
            if op is None:
                live -= sizes[n]
            else:
                live += sizes[i]
                top = max(top, live)

    replay(b_events, b_sizes, list(range(b_end)))
    b_runs = _segments(b_events, b_end, len(b_events), _BACKWARD_CUTS)
    f_runs = _segments(f_events, 0, f_end, _FORWARD_CUTS)
    for b_run, f_run in zip_longest(b_runs, f_runs, fillvalue=[]):
        replay(b_events, b_sizes, b_run)
        replay(f_events, f_sizes, f_run)
    return top


def pair_excess(backward: tuple[list, list[float]], forward: tuple[list, list[float]]) -> float:
    """What a combined pair's peak (:func:`pair_peak`) holds beyond the plain replay of ``backward``'s chunk (its
    forward, then its backward): 0 or more."""
    from omnitron.kernels.alloc_log import peak

    return max(0.0, pair_peak(backward, forward) - peak(*backward))


def planned_schedule(settings):
    """The schedule the run of ``settings`` executes: its ``--pipeline-schedule`` table, with its forward/backward
    pairs combined under ``--overlap-moe-expert-parallel-comm`` (one more warm-up forward, ``pp - r`` more on rank
    ``r`` of 1F1B: those are held whole)."""
    from omnitron.core.parallel.pipeline.combined import combine_1f1b
    from omnitron.core.parallel.pipeline.schedules import cached_schedule

    pc = settings.parallel
    schedule = cached_schedule(settings.training.pipeline_schedule, pc.pipeline_model_parallel_size,
                               pc.virtual_pipeline_model_parallel_size, settings.num_microbatches,
                               getattr(pc, "microbatch_group_size_per_vp_stage", None))
    return combine_1f1b(schedule) if getattr(pc, "overlap_moe_expert_parallel_comm", False) else schedule


def pair_extras(schedule, r: int, probe_log) -> dict[tuple[int, int], float]:
    """``{(forward's chunk, backward's chunk): what such a combined pair holds beyond the micro-batches held before
    it}`` over pipeline rank ``r``'s pairs (:func:`pair_excess` of the two chunks' transient probes, unsplit, at
    ``min(layers, 2 u)`` layers as :func:`omnitron.plan.memory.transient_bytes`: the excess does not grow with the
    depth, see the module docstring); ``{}`` when ``schedule`` combines none, or when the probes' logs do not align
    (warned, as the transients). ``probe_log(c)``: chunk ``c``'s probe log on rank ``r`` (the memory estimate
    passes its own probe, so this module does not import it back)."""
    if not schedule.combined:
        return {}
    table = schedule.tables[r]
    kinds = {(table[i].chunk, table[i + 1].chunk) for i in schedule.pairs.get(r, ())}
    logs: dict[int, tuple] = {}

    def probe(c: int) -> tuple:
        if c not in logs:
            logs[c] = probe_log(c)
        return logs[c]

    try:
        return {(f, b): pair_excess(probe(b), probe(f)) for f, b in kinds}
    except RuntimeError as e:
        log.warning("%s; the memory estimate prices the combined pairs as one micro-batch", e)
        return {}
