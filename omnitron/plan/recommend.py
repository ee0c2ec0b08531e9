"""``omnitron plan --devices N --device-memory 80GiB --bench REPORT``: every valid layout of a model on N devices,
ranked by predicted tokens/s, the fastest that fit in device memory.

The layouts searched: :mod:`omnitron.plan.layouts`.

First the memory-minimal choice of every (tp, pp, cp) (the smallest micro-batch, no vpp, recomputation and the
distributed optimizer on) is checked, least state first, until one fits (:func:`_some_fits`): when none does, the
error names the smallest need (:func:`_smallest`). Else
the candidates are ranked by predicted tokens/s (:func:`omnitron.plan.speed.predict`, each priced only when its step
lower bound lets it reach the front: :func:`_fastest_first`) and memory is checked fastest first
(:func:`omnitron.plan.memory.estimate`, every stage must fit; the transient probes only where the estimate without
them leaves room) until ``top`` fit. A device-profile
search (``cluster``, :func:`_bounded`) screens a layout that would enter the list with the estimate without
backward's transient probes (less its rematerialised chunk: a lower bound, :func:`_floor`) and prices it with them:
every layout listed fits by the full memory model, as ``--layout`` prices it.
"""
from __future__ import annotations

import contextlib
import gc
import re

from omnitron.core.config.parallel import ConfigError
from omnitron.plan.layouts import Choice, candidates

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(text: str) -> int:
    """``80GiB`` / ``80GB`` / ``8e10`` -> bytes; ConfigError on anything else."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"--device-memory {text!r} is not a size; give e.g. 80GiB, 80GB or 85899345920")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _with_world(given: dict, devices: int) -> dict:
    return given | {"nproc_per_node": devices}


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off for the block (its previous state restored after). A search allocates
    millions of short-lived objects that hold no cycles (timelines' spans, stage costs; freed by reference counting),
    and each of the collector's full passes walks every live object, the search's meta skeletons and schedule tables
    included: Llama 3 405B on 8,192 devices spent about a third of its search in them (2026-12-06)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@collector_paused()
def recommend(given: dict, devices: int, memory: int, rates, overlap: str = "none", top: int = 5,
              cluster: int | None = None) -> list[Choice]:
    """The ``top`` fastest layouts that fit ``memory`` bytes on every stage; ConfigError naming the binding
    constraint when none does; memory by the full model (:func:`omnitron.plan.memory.estimate`, backward's
    transients included). ``cluster``: devices per node of a device-profile search (:func:`candidates`,
    :func:`_bounded`)."""
    from omnitron.plan.memory import check_family, estimate

    if devices < 1:
        raise ConfigError(f"--devices must be >= 1, got {devices}")
    if top < 1:
        raise ConfigError(f"--top must be >= 1 (layouts to list), got {top}")
    from omnitron.plan.settings import settings_of

    check_family(settings_of({**given, "layout": None, "nproc_per_node": 1}))
    given = _with_world(given, devices)
    cands = candidates(given, devices, cluster=cluster)
    full, load = cluster is None, getattr(rates, "expert_load", None)
    if not cands:
        raise ConfigError(f"no layout of {given.get('model') or 'the model'} divides {devices} devices: tp must "
                          "divide the heads and query groups, pp the layers, dp x micro-batch the global batch")
    if full and not _some_fits(given, devices, memory, load):
        smallest = _smallest(given, devices, load=load, enough=memory)
        if smallest.peak > memory:
            raise ConfigError(_no_fit(smallest, memory))
    if not full:
        fit = _bounded(cands, memory, rates, overlap, top)
        if not fit:  # found out late (the smallest is not searched for up front: it is slow at scale)
            raise ConfigError(_no_fit(_smallest(given, devices, full, cluster, load, getattr(rates, "profile", None)),
                                      memory))
        return fit
    fit, device = [], getattr(rates, "profile", None)
    for c in _fastest_first(cands, rates, overlap):
        c.stages = estimate(c.settings, transients=False, load=load, device=device)
        if _floor(c, load) <= memory:  # it may fit: priced with backward's transients (else its floor is over)
            c.stages = estimate(c.settings, load=load, device=device)
        if c.peak <= memory:
            fit.append(c)
            if len(fit) == top:
                break
    return fit


def _some_fits(given: dict, devices: int, memory: int, load) -> bool:
    """Whether a memory-minimal candidate (:func:`_smallest`'s) fits ``memory`` by the full estimate: the up-front
    check of :func:`recommend` without ranking them all. They are tried least parameter and optimizer state first
    (:func:`state_lower_bound`: the most sharded, usually the first to fit), each probed with backward's transients
    only where its estimate without them leaves room (:func:`_floor`); False when none fits (then
    :func:`_smallest` names the least need)."""
    from omnitron.plan.memory import estimate

    cands = candidates(given, devices, minimal=True)
    for c in sorted(cands, key=lambda c: state_lower_bound(c.settings)):  # sorted is stable: ties keep their order
        if state_lower_bound(c.settings) > memory:
            break
        c.stages = estimate(c.settings, transients=False, load=load)
        if _floor(c, load) <= memory:
            c.stages = estimate(c.settings, load=load)
            if c.peak <= memory:
                return True
    return False


def _fastest_first(cands: list[Choice], rates, overlap: str):
    """``cands`` by predicted tokens/s, fastest first (ties: in the given order), each priced
    (:func:`omnitron.plan.speed.predict`, ``c.step``) only when the walk comes near it: a candidate is handed out
    once its tokens/s beats, strictly, what every unpriced one's step lower bound
    (:func:`omnitron.plan.speed.step_lower_bound`) allows, so the order is the full sort's and a search that stops
    after a few fitting layouts prices a few hundred of thousands."""
    import heapq

    from omnitron.plan.speed import predict, step_lower_bound

    order = [(step_lower_bound(c.settings, rates, overlap), i) for i, c in enumerate(cands)]
    heapq.heapify(order)
    priced: list[tuple[float, int]] = []  # (-tokens/s, index)
    while order or priced:
        while order and (not priced or -priced[0][0] <= _speed_limit(cands[order[0][1]], order[0][0])):
            _, i = heapq.heappop(order)
            cands[i].step = predict(cands[i].settings, rates, overlap)
            heapq.heappush(priced, (-cands[i].step.tokens_per_s, i))
        yield cands[heapq.heappop(priced)[1]]


def _speed_limit(c: Choice, bound: float) -> float:
    """The most tokens/s ``c`` can reach with a step no shorter than ``bound`` seconds."""
    tokens = c.settings.training.global_batch_size * c.settings.model.seq_length
    return tokens / bound if bound > 0 else float("inf")


@collector_paused()
def _bounded(cands: list[Choice], memory: int, rates, overlap: str, top: int) -> list[Choice]:
    """The ``top`` fastest that fit, pricing exactly only what a bound cannot rule out: candidates whose
    parameters and optimizer state alone exceed ``memory`` are dropped; the rest are visited by their step's
    lower bound (:func:`omnitron.plan.speed.step_lower_bound`), each priced and, if it would enter the list,
    its memory estimated (skipped when a sibling needing no more memory already failed): first without
    backward's transient probes, then, unless that bounds it over ``memory`` (:func:`_floor`), with them (a new
    probe set takes seconds at 70B; its logs serve every layout of the same tp, recomputation and chunk ends, and
    are kept on disk: :mod:`omnitron.plan.probe_cache`). A layout that fits only without the transients is dropped
    as one that does not fit; the walk stops when the next bound is slower than the ``top``-th fitting layout.
    A layout that does not fit without recomputation enters the walk with its block recomputations (:func:`_blocks`):
    they hold less than it and recompute less than the full recomputation the candidates have."""
    import heapq

    from omnitron.plan.memory import estimate
    from omnitron.plan.speed import predict, step_lower_bound

    priced = {"load": getattr(rates, "expert_load", None), "device": getattr(rates, "profile", None)}
    cands = list(cands)
    order = [(step_lower_bound(c.settings, rates, overlap), i) for i, c in enumerate(cands)
             if state_lower_bound(c.settings) <= memory]
    heapq.heapify(order)
    fit, over = [], set()  # fit: a min-heap of (tokens/s, index) of the fastest that fit
    while order:
        bound, i = heapq.heappop(order)
        c = cands[i]
        tokens = c.settings.training.global_batch_size * c.settings.model.seq_length
        if len(fit) == top and tokens / bound <= fit[0][0]:
            break
        c.step = predict(c.settings, rates, overlap)
        if len(fit) == top and c.step.tokens_per_s <= fit[0][0]:
            continue
        dominated = _dominated(c, over)
        if not dominated:
            c.stages = estimate(c.settings, transients=False, **priced)
            if _floor(c, priced["load"]) <= memory:  # it may fit: priced again with backward's transients
                c.stages = estimate(c.settings, **priced)
        if dominated or c.peak > memory:
            over.add(_shape(c))
            for b in _blocks(c):  # less memory, less recomputed than the full recomputation candidate
                cands.append(b)
                heapq.heappush(order, (step_lower_bound(b.settings, rates, overlap), len(cands) - 1))
            continue
        heapq.heappush(fit, (c.step.tokens_per_s, i))
        if len(fit) > top:
            heapq.heappop(fit)
    return [cands[i] for _, i in sorted(fit, reverse=True)]


def _blocks(c: Choice) -> list[Choice]:
    """``c``'s variants recomputing the first k layers of each chunk, k from 1 to a chunk's layers less one
    (Megatron's ``--recompute-method block``): none where ``c`` recomputes, or its chunks hold one layer."""
    from dataclasses import replace

    from omnitron.core.parallel.pipeline.layout import config_layer_ranges
    from omnitron.core.parallel.pipeline.schedules import schedule_style

    s = c.settings
    if c.flags.get("recompute_granularity"):
        return []
    style = schedule_style(c.flags.get("pipeline_schedule"))
    most = max(n for _, n in config_layer_ranges(s.model.num_layers, s.parallel, style).values())
    out = []
    for k in range(1, most):
        block = {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": k}
        out.append(Choice(c.flags | block, replace(s, model=replace(s.model, **block))))
    return out


def _floor(c: Choice, load) -> float:
    """A lower bound of ``c``'s peak by the full memory model from its estimate without the transient probes
    (``c.stages``): each stage's total less its rematerialised chunk. At balanced routing the two estimates share
    every other term and the full one adds, in the chunk's place, what the probes hold beyond the activations (>= 0;
    it may be less than the chunk: deepseek_v3_tiny's recomputed layouts, 4-10%). Under a routing histogram
    (``load``) they may price different ep ranks: no bound (0)."""
    return 0 if load is not None else max(s.total - s.recompute for s in c.stages)


def _shape(c: Choice) -> tuple:
    """(structure, micro-batch, layers recomputed a chunk: 0 without, a block's k, a large number for all) of a
    candidate: memory grows with the micro-batch and with fewer layers recomputed, all else equal (selective
    recomputation is a structure of its own: not ordered against the others)."""
    pc, f = c.settings.parallel, c.flags
    granularity = f.get("recompute_granularity")
    rec = 0 if granularity != "full" else f["recompute_num_layers"] if f.get("recompute_method") == "block" else 1 << 30
    return ((pc.tensor_model_parallel_size, pc.pipeline_model_parallel_size, pc.context_parallel_size,
             pc.expert_model_parallel_size, pc.virtual_pipeline_model_parallel_size or 1,
             c.flags.get("pipeline_schedule"), bool(c.flags.get("use_distributed_optimizer")),
             granularity == "selective"), c.settings.training.micro_batch_size, rec)


def _dominated(c: Choice, over: set) -> bool:
    """Whether a candidate that needs no more memory than ``c`` (same structure, micro-batch no larger, at least
    as many layers recomputed) already did not fit."""
    shape, mbs, rec = _shape(c)
    return any(s == shape and m <= mbs and r >= rec for s, m, r in over)


def state_lower_bound(settings) -> float:
    """Bytes of parameters, gradients and optimizer state of the largest stage's rank, counted from the
    analytic parameter count (no bucket padding: a lower bound of :func:`omnitron.plan.state.state_bytes`)."""
    from omnitron.plan.memory import model_config
    from omnitron.plan.speed import stage_param_groups
    from omnitron.plan.stage_layers import stage_layers
    from omnitron.plan.state import least_moment_bytes, master_bytes

    cfg, pc = model_config(settings), settings.parallel
    ddp, p = settings.ddp, cfg.params_dtype.itemsize
    g = max(4, p) if ddp and ddp.accumulate_allreduce_grads_in_fp32 else p  # fp32 widens bf16 / fp16 only
    opt = least_moment_bytes(settings.optim, cfg.params_dtype) + master_bytes(settings.optim, cfg.params_dtype)
    share = settings.dp * pc.context_parallel_size if ddp and ddp.use_distributed_optimizer else 1
    layers = stage_layers(settings, cfg)
    pp, vp = pc.pipeline_model_parallel_size, pc.virtual_pipeline_model_parallel_size or 1
    most = max(sum(stage_param_groups(cfg, settings, r, [x for c in range(vp) for x in layers[(r, c)]]))
               for r in range(pp))
    return most * (p + g + opt / share)


def _smallest(given: dict, devices: int, transients: bool = True, cluster: int | None = None, load=None,
              device=None, enough: int | None = None) -> Choice:
    """The candidate of least peak memory among the memory-minimal variant of every (tp, pp, cp); with ``load``
    (``--moe-expert-load``) each priced on its busiest ep rank, as the search prices them. ``transients`` False:
    ranked without backward's transient probes (slow at scale), the one found priced with them. With them, the
    candidates are first estimated without the probes and visited by :func:`_floor` (a lower bound of the full
    estimate): one whose floor exceeds the least full peak found so far cannot be the smallest and is not probed.
    The answer is the one a full estimate of every candidate gives (ties: the first in :func:`candidates`' order).

    ``enough`` (bytes): the first visited whose full peak is at most that is returned instead: the up-front check
    of :func:`recommend` asks only whether the smallest fits, and each further candidate probed costs a transient
    probe set. The check's answer is the same: a candidate returned with a peak over ``enough`` is the smallest
    (none fitted, so none stopped the walk early)."""
    from omnitron.plan.memory import estimate

    cands = candidates(given, devices, minimal=True, cluster=cluster)
    for c in cands:
        c.stages = estimate(c.settings, transients=False, load=load, device=device)
    if not transients:
        best = min(cands, key=lambda c: c.peak)
        best.stages = estimate(best.settings, load=load, device=device)
        return best
    best, first = None, 0
    for i, c in sorted(enumerate(cands), key=lambda ic: _floor(ic[1], load)):
        if best is not None and _floor(c, load) > best.peak:
            break
        c.stages = estimate(c.settings, load=load, device=device)
        if enough is not None and c.peak <= enough:
            return c
        if best is None or (c.peak, i) < (best.peak, first):
            best, first = c, i
    return best


def _no_fit(best: Choice, memory: int) -> str:
    top = max(best.stages, key=lambda s: s.total)
    routed = top.ep_rank is not None and best.settings.parallel.expert_model_parallel_size > 1
    where = f" on its busiest ep rank ({top.ep_rank}, --moe-expert-load)" if routed else ""
    half = best.settings.model.params_dtype.itemsize < 4
    return (f"no layout fits {memory / 2**30:.4g} GiB: the smallest needs {top.total / 2**30:.4g} GiB on stage "
            f"{top.stage}{where} ({best.name()}); add devices or lower --seq-length or --global-batch-size"
            + ("" if half else ", or use --bf16"))


def launch_flags(c: Choice) -> str:
    """The command-line flags (Megatron's spelling) that launch the layout ``c``."""
    out = []
    for key, v in c.flags.items():
        flag = "--" + key.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is not False:
            out += [flag, str(v)]
    return " ".join(out)


def _runs(values: list[str]) -> str:
    """The values in order, each run of equal neighbours once with its length (``58.355 x62``): a deep pipeline's
    middle stages hold the same."""
    out, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[i]:
            j += 1
        out.append(values[i] + (f" x{j - i + 1}" if j > i else ""))
        i = j + 1
    return " ".join(out)


def format_choices(choices: list[Choice], devices: int, memory: int) -> str:
    w = max([44] + [len(c.name()) for c in choices])
    rows = [f"{'#':>2} {'layout':{w}s} {'step ms':>13} {'tokens/s':>12} {'GiB: max [per stage]':>22}"]
    for i, c in enumerate(choices, 1):
        per = _runs([f"{s.total / 2**30:.3f}" for s in c.stages])
        rows.append(f"{i:>2} {c.name():{w}s} {c.step.total * 1e3:13,.1f} {c.step.tokens_per_s:12,.0f} "
                    f"{c.peak / 2**30:8.3f}  [{per}]")
        rows.append(f"   launch: --nproc-per-node {devices} (or torchrun's world) {launch_flags(c)}")
    rows += [f"assumption (#1): {a}" for a in choices[0].step.assumptions]
    rows += [f"fallback: {n}" for n in choices[0].step.notes]
    short = [i for i, c in enumerate(choices, 1) if not all(s.probed for s in c.stages)]
    rows.append(f"fits {memory / 2**30:.4g} GiB per device by omnitron plan's memory model, backward's transients "
                + ("included (every stage)" if not short else
                   f"left out on #{', #'.join(map(str, short))} (their transient probes did not align, warned above): "
                   "those totals are short of the step's peak"))
    return "\n".join(rows)
