"""``omnitron plan --devices N --device-memory 80GiB --bench REPORT``: every valid layout of a model on N devices,
ranked by predicted tokens/s, the fastest that fit in device memory.

The search (:func:`candidates`): tp divides the devices, the attention heads and the query groups; pp divides
the rest and the layers, or the layers with the loss (and the embedding) counted as one (:func:`_split`); cp
(1, 2, 4, 8, and beyond 8 while a rank keeps at least 4,096 tokens: :func:`_cp_sizes`) divides the rest and
splits the sequence into ``2 cp`` chunks; dp is what remains and with the micro-batch size (1, 2, 4, 8) divides
the global batch, which stays as the flags give it; vpp (every divisor of the slots per stage up to 16, so one
layer a virtual stage where a stage has 16 or fewer) where pp > 1; where pp > 1 and the slots per stage are
even, the V-shaped schedules too (``--pipeline-schedule zb-v``, and ``dualpipe-v`` with at least 2 pp
micro-batches: two chunks per rank, their bubble from the schedule's simulation and their memory from walking
its table, as every schedule's); full recomputation (uniform, 1 layer) on / off (a device-profile search adds
block recomputation, the first k layers of each chunk, where a layout does not fit without: :func:`_blocks`);
the distributed optimizer on / off where dp x cp > 1; sequence parallelism always on with tp > 1 (it only saves
memory); for MoE models, ep dividing the experts with etp (= tp) x ep dividing tp x cp x dp. Each candidate
is a full :class:`Settings`, so the engine's own validation rejects what it would.

First the smallest need is found over the memory-minimal choice of every (tp, pp, cp) (the smallest micro-batch,
no vpp, recomputation and the distributed optimizer on): when even that does not fit, the error names it. Else
the candidates are ranked by predicted tokens/s (:func:`omnitron.plan.speed.predict`) and memory is checked
fastest first (:func:`omnitron.plan.memory.estimate`, every stage must fit) until ``top`` fit. A device-profile
search (``cluster``, :func:`_bounded`) screens a layout that would enter the list with the estimate without
backward's transient probes (less its rematerialised chunk: a lower bound, :func:`_floor`) and prices it with them:
every layout listed fits by the full memory model, as ``--layout`` prices it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from omnitron.core.config.parallel import ConfigError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(text: str) -> int:
    """``80GiB`` / ``80GB`` / ``8e10`` -> bytes; ConfigError on anything else."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"--device-memory {text!r} is not a size; give e.g. 80GiB, 80GB or 85899345920")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


@dataclass
class Choice:
    """One candidate layout: its flat flags (the flags that launch it), settings and prediction."""

    flags: dict
    settings: object
    step: object = None
    stages: list | None = None

    @property
    def peak(self) -> int:
        return max(s.total for s in self.stages)

    def name(self) -> str:
        pc, s = self.settings.parallel, self.settings
        vp = pc.virtual_pipeline_model_parallel_size or 1
        ep, sched = pc.expert_model_parallel_size, self.flags.get("pipeline_schedule")
        return (f"tp{pc.tensor_model_parallel_size} pp{pc.pipeline_model_parallel_size} cp{pc.context_parallel_size} "
                f"dp{s.dp}" + (f" ep{ep}" if ep > 1 else "") + (f" {sched}" if sched else "")
                + (f" vpp{vp}" if vp > 1 and not sched else "")
                + f" mbs{s.training.micro_batch_size}"
                + self._recompute()
                + (" distopt" if self.flags.get("use_distributed_optimizer") else ""))


    def _recompute(self) -> str:
        """`` recompute`` (full, every layer), `` recompute-block K`` (the first K layers of each chunk) or
        `` recompute-selective``; empty without recomputation."""
        f = self.flags
        if not f.get("recompute_granularity"):
            return ""
        if f["recompute_granularity"] == "selective":
            return " recompute-selective"
        return f" recompute-block{f.get('recompute_num_layers')}" if f.get("recompute_method") == "block" else \
            " recompute"


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


MAX_VPP = 16
"""The most virtual stages a rank's layers are split into in the search (each halves the bubble less)."""


def _schedules(slots: int, pp: int, m: int):
    """(vpp, --pipeline-schedule or None for the default) tried for ``pp`` stages and ``m`` micro-batches of a
    model of ``slots`` layers (the embedding / loss included under --account-for-...-in-pipeline-split)."""
    if pp == 1:
        yield 1, None
        return
    for vpp in _divisors(slots // pp):  # down to one layer a virtual stage, as Megatron allows
        if vpp == 1 or vpp <= MAX_VPP and not m % pp:
            yield vpp, None
    if (slots // pp) % 2 == 0:  # the V: two chunks per rank
        yield 2, "zb-v"
        if m >= 2 * pp:
            yield 2, "dualpipe-v"


_VPP_FLAGS = ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank")


def _split(cfg, pc, pp: int) -> tuple[int, dict] | None:
    """(the slots ``pp`` stages split: the layers, and the embedding / loss where they count as one; the flags the
    search adds for it), or None when they do not split. The user's split (``pc``) is kept; without one, layers that
    ``pp`` does not divide are split as Megatron users split them (Llama 3 405B's 126 layers over 16 stages): the
    loss, and the embedding if that is not enough, counted as a layer (``--account-for-loss-in-pipeline-split``,
    ``--account-for-embedding-in-pipeline-split``: the first / last virtual stage one layer fewer)."""
    if pc.uneven_pipeline:
        slots = cfg.num_layers + pc.account_for_embedding_in_pipeline_split + pc.account_for_loss_in_pipeline_split
        return (slots, {}) if slots % pp == 0 else None
    loss, both = {"account_for_loss_in_pipeline_split": True}, {"account_for_embedding_in_pipeline_split": True}
    for extra, flags in ((0, {}), (1, loss), (2, loss | both)):
        if (cfg.num_layers + extra) % pp == 0:
            return cfg.num_layers + extra, flags
    return None


CP_TOKENS = 4096
"""The fewest tokens a context-parallel rank holds in the search beyond cp 8 (Llama 3 405B ran cp16 at 131,072:
8,192 a rank); below it a ring's blocks are small and the search longer for layouts that rarely win."""


def _cp_sizes(seq: int) -> list[int]:
    """Context-parallel sizes the search tries: 1, 2, 4, 8, and the powers of two beyond while a rank keeps
    :data:`CP_TOKENS`; each splits the sequence into ``2 cp`` equal chunks (the causal load balance)."""
    out, cp = [], 1
    while seq % (2 * cp) == 0 and (cp <= 8 or seq // cp >= CP_TOKENS):
        out.append(cp)
        cp *= 2
    return out or [1]


def _grid(cfg, devices: int, gbs: int, max_tp: int | None = None, pc=None):
    """(tp, pp, cp, dp, mbs, vpp, schedule, (slots, split flags)) that pass the divisibility rules of the module
    docstring (tp <= ``max_tp``; the split: :func:`_split` of the user's parallel config ``pc``)."""
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.models.gpt.config import query_groups

    pc = pc or ParallelConfig()
    for tp in _divisors(devices):
        if cfg.num_attention_heads % tp or query_groups(cfg) % tp or (max_tp and tp > max_tp):
            continue
        for pp in _divisors(devices // tp):
            split = _split(cfg, pc, pp) if pp > 1 else (cfg.num_layers, {})
            if split is None:
                continue
            for cp in (c for c in _cp_sizes(cfg.seq_length) if (devices // (tp * pp)) % c == 0):
                dp = devices // (tp * pp * cp)
                for mbs in (b for b in (1, 2, 4, 8) if gbs % (b * dp) == 0):
                    for vpp, sched in _schedules(split[0], pp, gbs // (mbs * dp)):
                        yield tp, pp, cp, dp, mbs, vpp, sched, split


def _with_ep(cfg, grid):
    """Each grid point with every expert-parallel size of a MoE model (1 for a dense one): ep divides the experts
    and etp (= tp) x ep divides tp x cp x dp."""
    for tp, pp, cp, dp, mbs, vpp, sched, split in grid:
        experts = getattr(cfg, "num_experts", None) or 1
        for ep in _divisors(experts):
            if (tp * cp * dp) % (tp * ep) == 0:
                yield tp, pp, cp, dp, mbs, vpp, sched, ep, split


def candidates(given: dict, devices: int, minimal: bool = False, cluster: int | None = None) -> list[Choice]:
    """Every valid :class:`Choice` for the user's flags ``given`` on ``devices`` devices (``minimal``: only the
    memory-minimal variant of each (tp, pp, cp)). ``cluster``: the devices per node of a cluster search, which
    keeps tp inside a node and the distributed optimizer on wherever dp x cp > 1 (it moves 3/4 of the
    all-reduce's bytes, steps 1/(dp x cp) of the parameters and holds less: the other variant never wins)."""
    from omnitron.plan.settings import settings_of
    from omnitron.plan.memory import model_config

    given = {k: v for k, v in given.items() if k not in _VPP_FLAGS}  # the search sets the virtual stages
    base = settings_of(given | {"nproc_per_node": 1})
    cfg, gbs, pc = model_config(base), given.get("global_batch_size"), base.parallel
    if not gbs:
        raise ConfigError("--devices: give --global-batch-size (the recommendation keeps it fixed)")
    sized_ends = pc.decoder_first_pipeline_num_layers is not None or pc.decoder_last_pipeline_num_layers is not None
    out, seen = [], set()
    for tp, pp, cp, dp, mbs, vpp, sched, ep, (slots, split) in _with_ep(cfg, _grid(cfg, devices, gbs, cluster, pc)):
        for rec in ((True,) if minimal else (False, True)):
            for dist in ((True,) if minimal or cluster else (False, True)) if dp * cp > 1 else (False,):
                key = (tp, pp, cp, ep) if minimal else (tp, pp, cp, ep, mbs, vpp, sched, rec, dist)
                least = min(b for b in (1, 2, 4, 8) if gbs % (b * dp) == 0)
                if key in seen or minimal and (mbs, vpp, sched) != (least, 1, None):
                    continue
                seen.add(key)
                flags = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                         "context_parallel_size": cp, "micro_batch_size": mbs, "global_batch_size": gbs,
                         "sequence_parallel": tp > 1}
                if getattr(cfg, "num_experts", None):
                    flags["expert_model_parallel_size"] = ep
                if sched:
                    flags["pipeline_schedule"] = sched
                flags.update(split)
                if vpp > 1 and sized_ends:  # Megatron's one form for set first/last stage sizes
                    flags["num_virtual_stages_per_pipeline_rank"] = vpp
                elif vpp > 1:
                    flags["num_layers_per_virtual_pipeline_stage"] = slots // (pp * vpp)
                if rec:
                    flags.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
                if dist:
                    flags["use_distributed_optimizer"] = True
                try:
                    s = settings_of(given | flags)
                except ConfigError:
                    continue  # the engine's own rules (the reason is not shown: other candidates remain)
                if s.world_size == devices:
                    out.append(Choice(flags, s))
    return out


def _with_world(given: dict, devices: int) -> dict:
    return given | {"nproc_per_node": devices}


def recommend(given: dict, devices: int, memory: int, rates, overlap: str = "none", top: int = 5,
              cluster: int | None = None) -> list[Choice]:
    """The ``top`` fastest layouts that fit ``memory`` bytes on every stage; ConfigError naming the binding
    constraint when none does; memory by the full model (:func:`omnitron.plan.memory.estimate`, backward's
    transients included). ``cluster``: devices per node of a device-profile search (:func:`candidates`,
    :func:`_bounded`)."""
    from omnitron.plan.memory import estimate
    from omnitron.plan.speed import predict

    if devices < 1:
        raise ConfigError(f"--devices must be >= 1, got {devices}")
    given = _with_world(given, devices)
    cands = candidates(given, devices, cluster=cluster)
    full, load = cluster is None, getattr(rates, "expert_load", None)
    if not cands:
        raise ConfigError(f"no layout of {given.get('model') or 'the model'} divides {devices} devices: tp must "
                          "divide the heads and query groups, pp the layers, dp x micro-batch the global batch")
    if full:
        smallest = _smallest(given, devices, load=load)
        if smallest.peak > memory:
            raise ConfigError(_no_fit(smallest, memory))
    if not full:
        fit = _bounded(cands, memory, rates, overlap, top)
        if not fit:  # found out late (the smallest is not searched for up front: it is slow at scale)
            raise ConfigError(_no_fit(_smallest(given, devices, full, cluster, load, getattr(rates, "profile", None)),
                                      memory))
        return fit
    for c in cands:
        c.step = predict(c.settings, rates, overlap)
    cands.sort(key=lambda c: -c.step.tokens_per_s)
    fit = []
    for c in cands:
        c.stages = estimate(c.settings, load=load, device=getattr(rates, "profile", None))
        if c.peak <= memory:
            fit.append(c)
            if len(fit) == top:
                break
    return fit


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

    cfg, pc = model_config(settings), settings.parallel
    ddp, p = settings.ddp, cfg.params_dtype.itemsize
    g = 4 if ddp and ddp.accumulate_allreduce_grads_in_fp32 else p
    opt = 4 * (2 + (p != 4))
    share = settings.dp * pc.context_parallel_size if ddp and ddp.use_distributed_optimizer else 1
    layers = stage_layers(settings, cfg)
    pp, vp = pc.pipeline_model_parallel_size, pc.virtual_pipeline_model_parallel_size or 1
    most = max(sum(stage_param_groups(cfg, settings, r, [x for c in range(vp) for x in layers[(r, c)]]))
               for r in range(pp))
    return most * (p + g + opt / share)


def _smallest(given: dict, devices: int, transients: bool = True, cluster: int | None = None, load=None,
              device=None) -> Choice:
    """The candidate of least peak memory among the memory-minimal variant of every (tp, pp, cp); with ``load``
    (``--moe-expert-load``) each priced on its busiest ep rank, as the search prices them. ``transients`` False:
    ranked without backward's transient probes (slow at scale), the one found priced with them."""
    from omnitron.plan.memory import estimate

    best = None
    for c in candidates(given, devices, minimal=True, cluster=cluster):
        c.stages = estimate(c.settings, transients=transients, load=load, device=device)
        if best is None or c.peak < best.peak:
            best = c
    if not transients:
        best.stages = estimate(best.settings, load=load, device=device)
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


def format_choices(choices: list[Choice], devices: int, memory: int) -> str:
    w = max([44] + [len(c.name()) for c in choices])
    rows = [f"{'#':>2} {'layout':{w}s} {'step ms':>13} {'tokens/s':>12} {'GiB: max [per stage]':>22}"]
    for i, c in enumerate(choices, 1):
        per = " ".join(f"{s.total / 2**30:.3f}" for s in c.stages)
        rows.append(f"{i:>2} {c.name():{w}s} {c.step.total * 1e3:13,.1f} {c.step.tokens_per_s:12,.0f} "
                    f"{c.peak / 2**30:8.3f}  [{per}]")
        rows.append(f"   launch: --nproc-per-node {devices} (or torchrun's world) {launch_flags(c)}")
    rows += [f"assumption (#1): {a}" for a in choices[0].step.assumptions]
    rows += [f"fallback: {n}" for n in choices[0].step.notes]
    rows.append(f"fits {memory / 2**30:.4g} GiB per device by omnitron plan's memory model, backward's transients "
                "included (every stage)")
    return "\n".join(rows)
