"""Predicted time of one training step of a layout, from the work of :mod:`omnitron.plan.work` priced by the
measured rates of :mod:`omnitron.plan.rates`.

Model (printed with every prediction; see ``BENCHMARKS.md`` for how close it comes on this CPU):

1. **Per micro-batch, per virtual stage**: forward = the stage's GEMMs (:func:`work.layer_gemms`, the last
   stage's logits) + core attention + its tensor-parallel collectives + ring hops + the send of its output
   to the next stage; backward = 2 x the forward GEMMs and attention (input and weight gradients), the
   backward collectives, and, with ``--recompute-granularity full``, the recomputed layers' forward again
   (``selective``: the core attention's forward again, the probabilities' dropout included). Context parallelism's
attention is its ring's steps,
   each block at the report's ``ring_block`` rate (the engine's block kernel with the ring's own dropout
   masks), plus the merges of the partial results and the backward's gradient accumulations.
2. **The pipeline**: those costs run through the schedule's own action table on an ideal clock
   (:func:`omnitron.core.parallel.pipeline.simulate.simulate`): the step's makespan. The bubble is the
   makespan minus the busiest rank's work, ``(pp - 1) / m`` of it for 1F1B with equal stages and
   ``/ vpp`` interleaved.
3. **Data parallelism** after the pipeline: the stage's gradient buckets all-reduced over dp x cp, or
   reduce-scattered and the parameters all-gathered with ``--use-distributed-optimizer``.
4. **Overlap** is an assumption (``--assume-overlap``): ``none`` adds every communication to the
   critical path; ``dp`` hides each chunk's gradient reduction behind the backward work that follows its
   readiness on the pipeline's timeline (``--overlap-grad-reduce``: a chunk's buckets during its last backward,
   the later chunks' behind the earlier chunks' cool-down, the expert gradients' after the rank's last backward;
   :mod:`omnitron.plan.dp_overlap`); ``all`` also hides
   the distributed optimizer's parameter all-gather behind the next step's forward, layer by layer
   (``--overlap-param-gather``), and the communication the engine runs beside compute (:data:`HIDDEN`: the cp
   ring's hops, pipeline sends) behind it: a stage's cost is ``max(compute + tp + ep, cp + pp)``; tensor-parallel
   collectives and expert all-to-alls are waited where issued, as the engine runs them. ``megatron`` is ``all``
   with the tensor-parallel collectives also hidden behind the GEMMs (``max(compute + ep, tp + cp + pp)``): what
   Megatron-LM's ``--tp-comm-overlap`` (userbuffers) does, for comparing with published runs that used it
   (benchmarks/plan_published_*.py); omnitron's engine runs ``all``.
5. **Shared cores** (CPU reports): every rank of the layout runs on one host of the report's
   ``cpu_count`` cores, with ``omnitron train``'s intra-op threads (cores / ranks, at least 1). The GEMM /
   attention rows measured at that thread count are used; each rank's work is slowed by what the comm
   report's ``host_gemm`` / ``host_stream`` rows measured for that many busy threads at once (hyperthreads,
   memory bandwidth, time-sharing), or without them by ``ranks x threads / cores`` when that exceeds 1 (the
   cores time-shared); the collectives (CPU work on gloo) likewise beyond the time-sharing of their
   measurement (:mod:`omnitron.plan.rates`).

6. **Element-wise ops** (norms, residual adds, dropouts, the MLP activation, cross-entropy; each forward and
   backward) and the optimizer step are priced per element from an ``omnitron bench elementwise`` report
   (:func:`work.layer_elementwise`); without one they are left out (noted).

7. **MoE layers** (:mod:`omnitron.plan.moe`) replace the dense MLP by the router, the local experts' GEMMs, the
   dispatch's all-to-alls over ep (and the gathers over etp), and the shared expert, at balanced routing, or
   with ``--moe-expert-load FILE`` at a measured routing histogram's imbalance and drops, priced on the ep
   group's busiest rank, each MoE layer at its own row where the histogram has one per MoE layer
   (:mod:`omnitron.plan.routing`; stated with the prediction); expert gradients are reduced over the
   expert-data-parallel group.

8. **The host's fixed cost of a layer** (Python, dispatch and autograd between and around its ops) from the
   elementwise report's ``host_layer`` rows, less what the per-op rates already price that small layer at
   (:func:`host_layer`); on a CPU it adds to the layer's time (the host is the device), on an accelerator the
   host runs ahead, and a layer takes the longer of the two. The q / k / v split's backward is priced as
   element-wise passes (:func:`work.qkv_split_backward`).

9. **FP8** (``--fp8-format``): the layers' GEMMs at the device's FP8 rate and the casts feeding them as
   element-wise passes (:mod:`omnitron.plan.fp8`); the layers ``--first-last-layers-bf16`` keeps wide priced
   as without FP8 on the stages that hold them (the first and last stages get slower; the pipeline's
   simulation and the busiest rank see it).

Not modelled: the data loader, the host's fixed costs outside the layers (embedding, loss, the optimizer's loop).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from omnitron.core.config.parallel import ConfigError
from omnitron.core.parallel.pipeline.schedules import place_stage, virtual_stage
from omnitron.plan import cp_comm, dp_overlap, fp8
from omnitron.plan import moe as moe_work
from omnitron.plan import work
from omnitron.plan.stage_layers import stage_layers, wide_layers
from omnitron.plan.state import expert_data_parallel_size

OVERLAPS = ("none", "dp", "all", "megatron")
KEYS = ("compute", "elementwise", "host", "tp", "cp", "pp", "ep")
HIDDEN = ("pp",)
"""The communication the engine runs beside compute, hidden under ``--assume-overlap all``, with the context-parallel
ring's hops (:attr:`StageCost.ring`: each posted before the blocks it computes meanwhile) and a pipeline send (posted with the next exchange,
waited only at the one after, its next action's work in between; its receiver still waits, :meth:`StageCost.lag`).
The tensor-parallel collectives (no userbuffers overlap: Megatron's ``--tp-comm-overlap`` is accepted and not run)
and the experts' all-to-alls (each waited where it is issued; under ``--overlap-moe-expert-parallel-comm`` a combined
pair's hide behind the other pass: :func:`pair_credit`) stay on the critical path: tests/sim/test_sim_plan_overlap.py
counts the GEMMs a real step on ``sim`` issues while each collective is in flight."""
BESIDE = {"all": HIDDEN, "megatron": HIDDEN + ("tp",)}
"""Per ``--assume-overlap`` that hides communication behind a stage's compute: the kinds it hides (with the cp ring's
hops). ``megatron`` adds the tensor-parallel collectives, as Megatron-LM's ``--tp-comm-overlap`` splits each GEMM and
runs its all-gather / reduce-scatter beside the pieces: for pricing published runs that used it, not omnitron's
engine (which accepts that flag and does not run it: omnitron/core/training/megatron_flags.py)."""
_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass
class StageCost:
    """Seconds of one micro-batch of one virtual stage: compute and each communication, forward / backward."""

    f: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KEYS, 0.0))
    b: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KEYS, 0.0))
    attention_f: float = 0.0
    """One layer's core-attention forward (what selective recomputation repeats)."""
    attention_ew_f: float = 0.0
    """The element-wise part of that forward priced apart (the probabilities' dropout): repeated with it."""
    ring: dict[str, float] = field(default_factory=lambda: {"F": 0.0, "B": 0.0})
    """The part of ``cp`` (per pass) the engine runs beside the ring's blocks: its point-to-point hops, less the
    backward's last (the key/value gradients taken home after the last block); ``--cp-comm-type`` a2a's and
    allgather's collectives are waited where issued."""
    handed: dict[str, float] = field(default_factory=lambda: {"F": 0.0, "B": 0.0})
    """The part of ``ep`` (per pass) at which a combined pair of ``--overlap-moe-expert-parallel-comm`` hands over
    to its other pass, which may hide it (:func:`pair_credit`): the rows' all-to-alls
    (:func:`omnitron.plan.moe.handed_over`); the token counts' exchange and the rest are waited where issued."""
    host_async: bool = False
    """The host's fixed costs run ahead of an asynchronous device (an accelerator) instead of adding to it."""

    def _parts(self, kind: str) -> tuple[float, float, float]:
        """(the pass's work, all its communication, its pipeline send)."""
        d = self.f if kind == "F" else self.b
        dev = d["compute"] + d["elementwise"]
        work = max(dev, d["host"]) if self.host_async else dev + d["host"]
        return work, d["tp"] + d["cp"] + d["pp"] + d["ep"], d["pp"]

    def _hidden(self, kind: str, overlap: str = "all") -> tuple[float, float]:
        """Under ``all`` / ``megatron``: (the pass's work with the communication waited for where it is issued, the
        communication run beside that work: :data:`BESIDE`)."""
        work, comm, _ = self._parts(kind)
        d = self.f if kind == "F" else self.b
        beside = sum(d[k] for k in BESIDE[overlap]) + self.ring[kind]
        return work + comm - beside, beside

    def total(self, kind: str, overlap: str) -> float:
        if overlap not in BESIDE:
            work, comm, _ = self._parts(kind)
            return work + comm
        exposed, beside = self._hidden(kind, overlap)
        return max(exposed, beside)

    def lag(self, kind: str, overlap: str = "all") -> float:
        """Under ``all`` / ``megatron``: seconds from the end of this pass (:meth:`total`) until its pipeline message is at the
        next (F) / previous (B) stage. The send starts when the work ends and takes its ``pp`` time; the part of
        it that already ran inside the pass (the hidden communication beyond the pass's exposed work) is not
        waited for twice."""
        exposed, beside = self._hidden(kind, overlap)
        return max(0.0, self._parts(kind)[2] - max(0.0, beside - exposed))


@dataclass
class StepTime:
    """One step's predicted seconds: the critical rank's compute and communication, the bubble, the total."""

    total: float
    compute: float
    elementwise: float
    host: float
    tp: float
    cp: float
    pp: float
    ep: float
    dp: float
    optimizer: float
    bubble: float
    tokens_per_s: float
    assumptions: list[str]
    notes: list[str]

    def breakdown(self) -> dict[str, float]:
        keys = ("compute", "elementwise", "host", "tp", "cp", "pp", "ep", "dp", "optimizer", "bubble")
        return {k: getattr(self, k) for k in keys}


def _threads(settings, rates, op: str = "host_gemm") -> tuple[int, float]:
    """(intra-op threads per rank, slow-down from ranks sharing the host's cores): the comm report's measured
    ``op`` slowdown (``host_gemm`` for GEMMs, attention and the host's own work, ``host_stream`` for
    element-wise passes) at the layout's busy threads, else ``ranks x threads / cores`` (time-sharing only)."""
    if rates.device_type != "cpu":
        return (max(rates.gemm) if rates.gemm else 1), 1.0
    world, cores = settings.world_size, rates.cpu_count
    threads = settings.threads or (max(1, cores // world) if world > 1 else max(1, min(cores, 8)))
    measured = rates.host_slowdown(op, world * threads)
    return threads, measured if measured is not None else max(1.0, world * threads / cores)


def layer_collectives(settings, cfg, moe: bool, share=None) -> tuple[list, list]:
    """(forward, backward) ``(key, op, bytes, ranks)`` of one layer's collectives per micro-batch: the tensor-
    parallel ones (``tp``: :func:`work.tp_collectives`; a MoE layer keeps the attention's half, and the MLP's
    for its shared expert) and a MoE layer's dispatch (``ep``: :func:`moe_work.moe_collectives`; ``share``: a
    routing histogram's row, :mod:`omnitron.plan.routing`)."""
    pc = settings.parallel
    tp, cp, sp = pc.tensor_model_parallel_size, pc.context_parallel_size, pc.sequence_parallel
    x = work.local_shapes(cfg, tp, cp, settings.training.micro_batch_size)
    elem = cfg.params_dtype.itemsize
    f, b = work.stage_tp_collectives(cfg, x, elem, sp, 1, False, False, regather=settings.fp8 is None)
    if moe:
        keep = 2 if cfg.moe_shared_expert_intermediate_size else 1  # halves: attention, then the MLP
        f, b = f[: len(f) // 2 * keep], b[: len(b) // 2 * keep]
    fwd, bwd = [("tp", op, n, tp) for op, n in f], [("tp", op, n, tp) for op, n in b]
    if moe:
        m = moe_work.moe_local(cfg, x, pc.expert_model_parallel_size, pc.etp, sp, share)
        mf, mb = moe_work.moe_collectives(cfg, m, elem, cp * (tp if sp else 1))
        fwd, bwd = fwd + [("ep", *c) for c in mf], bwd + [("ep", *c) for c in mb]
    return fwd, bwd


def _layer(settings, cfg, rates, moe: bool, row: int | None = None) -> StageCost:
    """:class:`StageCost` of one Transformer layer, dense or MoE (:mod:`omnitron.plan.moe`), without
    recomputation: the GEMMs, core attention, element-wise ops, tp / ep collectives and ring hops. With a
    routing histogram (``rates.expert_load``) a MoE layer is priced at its ``row``, or at the mean over its rows
    (``row`` None)."""
    load = getattr(rates, "expert_load", None)
    if not moe or load is None:
        return _layer_routed(settings, cfg, rates, moe, None)
    load.check(cfg.num_experts)
    if row is not None:
        return _layer_routed(settings, cfg, rates, True, load.shares[row])
    costs = [_layer_routed(settings, cfg, rates, True, share) for share in load.shares]
    out = replace(costs[0], attention_f=sum(c.attention_f for c in costs) / len(costs),
                  attention_ew_f=sum(c.attention_ew_f for c in costs) / len(costs))
    out.f, out.b = ({k: sum(getattr(c, d)[k] for c in costs) / len(costs) for k in KEYS} for d in ("f", "b"))
    out.handed = {kind: sum(c.handed[kind] for c in costs) / len(costs) for kind in "FB"}
    return out


def layer_gemms(settings, cfg, moe: bool, share=None) -> list[tuple[str, int, int, int]]:
    """(name, m, n, k) of one layer's forward GEMMs per micro-batch on one rank, as priced: the dense layer's
    (:func:`work.layer_gemms`), or attention's qkv and proj, then the MoE MLP's (:func:`moe_work.moe_gemms`;
    ``share``: a routing histogram's row, None balanced)."""
    pc = settings.parallel
    tp, sp = pc.tensor_model_parallel_size, pc.sequence_parallel
    x = work.local_shapes(cfg, tp, pc.context_parallel_size, settings.training.micro_batch_size)
    if not moe:
        return work.layer_gemms(x)
    m = moe_work.moe_local(cfg, x, pc.expert_model_parallel_size, pc.etp, sp, share)
    return work.layer_gemms(x)[:2] + moe_work.moe_gemms(m)


def _layer_routed(settings, cfg, rates, moe: bool, share) -> StageCost:
    """:func:`_layer` with a MoE layer's routing given by ``share`` (None: balanced)."""
    pc = settings.parallel
    tp, cp, sp = pc.tensor_model_parallel_size, pc.context_parallel_size, pc.sequence_parallel
    x = work.local_shapes(cfg, tp, cp, settings.training.micro_batch_size)
    dt, elem = _DTYPE.get(str(cfg.params_dtype).replace("torch.", ""), "fp32"), cfg.params_dtype.itemsize
    threads, slow = _threads(settings, rates)
    stream = _threads(settings, rates, "host_stream")[1]
    cpw = cp_comm.cp_work(x, elem, pc.cp_comm_type, cp_comm.a2a_size(pc))
    ring = cp > 1 and rates.ring_block_s(dt, 1.0, True, cfg.attention_dropout > 0, threads) is not None
    separate = not ring and not rates.fused_attention_dropout(threads)  # the probabilities' dropout, unpriced yet
    gemms, ew = layer_gemms(settings, cfg, moe, share), work.layer_elementwise(cfg, x, sp, attention_dropout=separate)
    if moe:
        m = moe_work.moe_local(cfg, x, pc.expert_model_parallel_size, pc.etp, sp, share)
        act = "silu_mul" if cfg.swiglu else "gelu"
        ew = [e for e in ew if e[0] != act] + moe_work.moe_elementwise(cfg, m)
    gemm = sum(rates.gemm_s(fp8.gemm_dtype(settings, cfg, name, dt), mm, n, k, threads)
               for name, mm, n, k in gemms) * slow
    cast_f, cast_b = fp8.casts(settings, gemms)
    attn = _attention(cfg, x, rates, dt, threads, cpw.blocks) * slow
    # the cp blocks' merges, gradient accumulations and reorders (their dropout is in the blocks' rate)
    ring_f, ring_b = (cpw.ew_f, cpw.ew_b) if ring else ([], [])
    c = StageCost(attention_f=attn / 3)
    c.f["compute"], c.b["compute"] = gemm + attn / 3, 2 * gemm + 2 * attn / 3
    c.f["cp"] = sum(rates.comm_s(op, n, k, group=g) for op, n, k, g in cpw.fwd)
    c.b["cp"] = sum(rates.comm_s(op, n, k, group=g) for op, n, k, g in cpw.bwd)
    # the ring's hops run beside its blocks, but the backward's last (each key/value gradient taken home) after them
    hops = {kind: [rates.comm_s(op, n, k, group=g) for op, n, k, g in rows if op == "p2p"]
            for kind, rows in (("F", cpw.fwd), ("B", cpw.bwd))}
    c.ring = {"F": sum(hops["F"]), "B": sum(hops["B"][:-1])}
    bias = work.bias_passes(cfg, x, [g for g in gemms if g[0] != "router"])
    c.f["elementwise"] = sum(rates.elementwise_s(op, "fwd", n, threads)
                             for op, n in ew + ring_f + bias + cast_f) * stream
    probs = work.attention_dropout_elements(cfg, x) if separate and cfg.attention_dropout > 0 else None
    c.attention_ew_f = rates.elementwise_s("dropout", "fwd", probs, threads) * stream if probs else 0.0
    c.b["elementwise"] = (sum(rates.elementwise_s(op, "bwd", n, threads) for op, n in ew) +
                          sum(rates.elementwise_s(op, "fwd", n, threads)
                              for op, n in ring_b + work.qkv_split_backward(x) + bias + cast_b)) * stream
    c.f["host"], c.b["host"] = (t * slow for t in host_layer(rates, threads))
    for d, rows in zip((c.f, c.b), layer_collectives(settings, cfg, moe, share)):
        for key, op, n, ranks in rows:
            group = "ep" if key == "ep" and ranks == pc.expert_model_parallel_size else "tp"  # etp, stats: tp-cp
            d[key] += rates.comm_s(op, n, ranks, group=group)
    if moe:
        c.handed = {kind: sum(rates.comm_s(op, n, ranks, group="ep") for op, n, ranks in rows)
                    for kind, rows in zip("FB", moe_work.handed_over(m, elem))}
    return c


def _layer_cached(settings, cfg, rates, moe: bool, row: int | None = None) -> StageCost:
    """:func:`_layer`, kept in ``rates.memo`` across the layouts of a search (a layer's cost depends on the model, tp,
    cp and its comm type, ep, SP and the micro-batch only; on a CPU also on the cores' sharing: the rank's threads,
    the measured slowdowns at the layout's busy threads, and every rank's threads, which scale the collectives)."""
    pc = settings.parallel
    host = None
    if rates.device_type == "cpu":
        host = (_threads(settings, rates), _threads(settings, rates, "host_stream"), rates.host_ranks)
    key = ("layer", repr(replace(cfg, recompute_granularity=None, recompute_method=None, recompute_num_layers=None)),
           pc.tensor_model_parallel_size, pc.context_parallel_size, pc.cp_comm_type,
           tuple(pc.hierarchical_context_parallel_sizes or ()), pc.sequence_parallel, pc.expert_model_parallel_size,
           pc.etp, settings.training.micro_batch_size, moe, getattr(getattr(rates, "expert_load", None), "key", None),
           row, repr(settings.fp8), host)
    if key not in rates.memo:
        rates.memo[key] = _layer(settings, cfg, rates, moe, row)
    return rates.memo[key]


def host_layer(rates, threads: int) -> tuple[float, float]:
    """(forward, backward) seconds of one layer's fixed host cost per micro-batch (Python, dispatch, autograd):
    the report's ``host_layer`` rows (one engine layer at shapes where the arithmetic is nothing) less what the
    per-op rates price that small layer's own work at, since each op's rate already holds its fixed cost
    (an op's time at small sizes is mostly that). (0, 0) without the rows (older reports; noted)."""
    if ("host_layer", threads) not in rates.memo:
        rates.memo[("host_layer", threads)] = _host_layer(rates, threads)
    return rates.memo[("host_layer", threads)]


def _host_layer(rates, threads: int) -> tuple[float, float]:
    from omnitron.bench.elementwise import host_layer_config

    f, b = rates.host_layer_s("fwd", threads), rates.host_layer_s("bwd", threads)
    if f is None or b is None:
        rates.note("host: no host_layer rows (an older `omnitron bench elementwise` report); the host's fixed "
                   "cost of each layer is not priced")
        return 0.0, 0.0
    cfg = host_layer_config()
    x = work.local_shapes(cfg, 1, 1, 1)
    gemm = sum(rates.gemm_s("fp32", m, n, k, threads) for _, m, n, k in work.layer_gemms(x))
    attn = rates.attention_s("fp32", 3 * work.attention_flops(x), True, threads)
    ew = work.layer_elementwise(cfg, x, False, attention_dropout=not rates.fused_attention_dropout(threads))
    bias = work.bias_passes(cfg, x, work.layer_gemms(x))
    ew_f = sum(rates.elementwise_s(op, "fwd", n, threads) for op, n in ew + bias)
    ew_b = sum(rates.elementwise_s(op, "bwd", n, threads) for op, n in ew) + sum(
        rates.elementwise_s(op, "fwd", n, threads) for op, n in work.qkv_split_backward(x) + bias)
    return max(0.0, f - gemm - attn / 3 - ew_f), max(0.0, b - 2 * gemm - 2 * attn / 3 - ew_b)


def _attention(cfg, x, rates, dt: str, threads: int, blocks: list | None = None) -> float:
    """Seconds of one layer's core attention, forward + backward, per micro-batch. At cp > 1 each of ``blocks``
    (:func:`cp_comm.cp_work`'s, per ``--cp-comm-type``; None: the ring's) at the report's ``ring_block`` rate; older
    reports without those rows: cp calls of ``1 / cp`` of the work at the attention rate (noted)."""
    drop = cfg.attention_dropout > 0
    if x.cp > 1:
        blocks = [rates.ring_block_s(dt, fl, causal, drop, threads, head_dim=x.head_dim)
                  for fl, causal in (work.cp_blocks(x) if blocks is None else blocks)]
        if None not in blocks:
            return sum(blocks)
        rates.note("attention: no ring_block rows (an older `omnitron bench attention` report); ring attention "
                   "priced as cp calls of the fused path and its merges left out")
    return x.cp * rates.attention_s(dt, 3 * work.attention_flops(x) / x.cp, drop, threads, local=x)


def stage_cost(settings, cfg, rates, layers: list[bool], first: bool, last: bool, nxt: bool,
               prev: bool, rows: list | None = None, wide: list | None = None) -> StageCost:
    """:class:`StageCost` of a virtual stage whose layers are ``layers`` (True: MoE) (``nxt`` / ``prev``: it
    has a next / previous stage to send its output / input gradient to; ``rows``: each layer's routing
    histogram row, :func:`~omnitron.plan.stage_layers.stage_layers`; ``wide``: each layer kept out of FP8 by
    ``--first-last-layers-bf16``, :func:`~omnitron.plan.stage_layers.wide_layers`, priced as without
    ``--fp8-format``: its GEMMs at the model dtype's rate, no casts). Full recomputation adds each recomputed
    layer's forward to the backward, selective the core attention's forward."""
    pc = settings.parallel
    tp, cp, sp = pc.tensor_model_parallel_size, pc.context_parallel_size, pc.sequence_parallel
    x = work.local_shapes(cfg, tp, cp, settings.training.micro_batch_size)
    dt, elem = _DTYPE.get(str(cfg.params_dtype).replace("torch.", ""), "fp32"), cfg.params_dtype.itemsize
    threads, slow = _threads(settings, rates)
    keys = list(zip(layers, rows or [None] * len(layers), wide or [False] * len(layers)))
    bf16 = replace(settings, fp8=None) if settings.fp8 is not None and any(wide or []) else settings
    kinds = {key: _layer_cached(bf16 if key[2] else settings, cfg, rates, *key[:2]) for key in set(keys)}
    c = StageCost(host_async=rates.device_type != "cpu")
    rec = _recomputed(cfg, len(layers))
    for i, key in enumerate(keys):
        one = kinds[key]
        for key in KEYS:
            c.f[key] += one.f[key]
            c.b[key] += one.b[key]
            if i < rec:  # full recomputation: this layer's forward again, before its backward
                c.b[key] += one.f[key]
        c.ring = {"F": c.ring["F"] + one.ring["F"],
                  "B": c.ring["B"] + one.ring["B"] + (one.ring["F"] if i < rec else 0.0)}
        # NOTE: a recomputed layer's forward all-to-alls (in B) are not credited: priced waited, an upper bound
        c.handed = {kind: c.handed[kind] + one.handed[kind] for kind in "FB"}
        if cfg.recompute_granularity == "selective":  # core attention again, its dropout included
            c.b["compute"] += one.attention_f
            c.b["elementwise"] += one.attention_ew_f
    if first:
        c.f["tp"] += sum(rates.comm_s(op, n, tp, group="tp") for op, n in work.first_stage_tp(cfg, x, elem, sp)[0])
        c.b["tp"] += sum(rates.comm_s(op, n, tp, group="tp") for op, n in work.first_stage_tp(cfg, x, elem, sp)[1])
    if last:
        _, m, n, k = work.head_gemm(x)
        c.f["compute"] += rates.gemm_s(dt, m, n, k, threads) * slow
        c.b["compute"] += 2 * rates.gemm_s(dt, m, n, k, threads) * slow
        c.f["tp"] += sum(rates.comm_s(op, n, tp, group="tp") for op, n in work.last_stage_tp(x, elem, sp)[0])
        c.b["tp"] += sum(rates.comm_s(op, n, tp, group="tp") for op, n in work.last_stage_tp(x, elem, sp)[1])
    ends = (work.embedding_elementwise(cfg, x, sp) if first else []) + (
        work.head_elementwise(cfg, x, sp) if last else [])
    stream = _threads(settings, rates, "host_stream")[1]
    c.f["elementwise"] += sum(rates.elementwise_s(op, "fwd", n, threads) for op, n in ends) * stream
    c.b["elementwise"] += sum(rates.elementwise_s(op, "bwd", n, threads) for op, n in ends) * stream
    msg = work.pp_message(x, elem, sp)
    c.f["pp"] = rates.comm_s("p2p", msg, 2, group="pp") if nxt else 0.0
    c.b["pp"] = rates.comm_s("p2p", msg, 2, group="pp") if prev else 0.0
    return c


def _recomputed(cfg, layers: int) -> int:
    if cfg.recompute_granularity != "full":
        return 0
    return min(cfg.recompute_num_layers or 1, layers) if cfg.recompute_method == "block" else layers


def stage_param_groups(cfg, settings, pp_rank: int, layers) -> tuple[float, float]:
    """(dense, expert) parameters (elements) one rank of pipeline stage ``pp_rank`` holds and reduces gradients
    of; ``layers``: the stage's layer count (dense) or its layers' MoE flags. Dense gradients are reduced over
    dp x cp, the experts' over the expert-data-parallel group."""
    from omnitron.core.models.gpt.config import max_positions, padded_vocab_size

    pc = settings.parallel
    tp, pp = pc.tensor_model_parallel_size, pc.pipeline_model_parallel_size
    kinds = [False] * layers if isinstance(layers, int) else list(layers)
    dense_moe, expert_moe = (moe_work.moe_layer_params(cfg, tp, pc.expert_model_parallel_size, pc.etp)
                             if any(kinds) else (0.0, 0.0))
    n = sum(dense_moe if moe else work.layer_params(cfg, tp) for moe in kinds)
    emb = padded_vocab_size(cfg, tp) // tp * cfg.hidden_size
    if pp_rank == 0:
        n += emb + (max_positions(cfg) * cfg.hidden_size if cfg.position_embedding_type == "learned_absolute" else 0)
    experts = sum(kinds) * expert_moe
    if pp_rank == _head_rank(settings):
        n += cfg.hidden_size * (2 if cfg.normalization == "LayerNorm" else 1)
        if cfg.untie_embeddings_and_output_weights or pp > 1:
            n += emb
        if getattr(cfg, "mtp_num_layers", None):  # the MTP depths live beside the head (transformer/mtp.py)
            dense, expert = mtp_params(cfg, tp, pc.expert_model_parallel_size, pc.etp)
            n += dense + (emb if pp > 1 and cfg.untie_embeddings_and_output_weights else 0)  # + the embedding copy
            experts += expert
    return n, experts


def mtp_params(cfg, tp: int, ep: int, etp: int) -> tuple[float, float]:
    """(dense, expert) parameters of the MTP depths on one rank: per depth enorm, hnorm, the replicated
    ``eh_proj [h, 2h]``, a final norm and one layer of the last decoder layer's kind."""
    from omnitron.core.transformer.moe.pattern import moe_layer_pattern

    h = cfg.hidden_size
    norm = h * (2 if cfg.normalization == "LayerNorm" else 1)
    moe = bool(cfg.num_experts) and moe_layer_pattern(cfg.moe_layer_freq, cfg.num_layers)[-1]
    dense, expert = moe_work.moe_layer_params(cfg, tp, ep, etp) if moe else (work.layer_params(cfg, tp), 0.0)
    return cfg.mtp_num_layers * (3 * norm + 2 * h * h + dense), cfg.mtp_num_layers * expert


def stage_params(cfg, settings, pp_rank: int, layers) -> float:
    """All parameters (elements) of one rank of pipeline stage ``pp_rank`` (:func:`stage_param_groups`)."""
    return sum(stage_param_groups(cfg, settings, pp_rank, layers))


def dp_collectives(settings, cfg, pp_rank: int, layers) -> list[tuple[str, int, int]]:
    """``(op, bytes, ranks)`` of one step's gradient reduction on a rank of pipeline stage ``pp_rank`` (its layers'
    MoE flags ``layers``), bucketed as the data-parallel wrapper buckets (:class:`GradBuffer`): dense gradients
    over dp x cp, the experts' over the expert-data-parallel group, buckets of ``--ddp-bucket-size`` (default
    ``max(40M, 1M x group)``) elements padded to a multiple of the group, and with a reduce-scatter (the
    distributed optimizer, ``--ddp-reduce-scatter``) the tied embedding in a bucket of its own. Each bucket is
    all-reduced, or reduce-scattered and its parameters all-gathered with ``--use-distributed-optimizer``."""
    return [c[1:] for c in _dp_collectives(settings, cfg, pp_rank, layers)]


def _dp_collectives(settings, cfg, pp_rank: int, layers) -> list[tuple[str, str, int, int]]:
    """:func:`dp_collectives`, each led by its group's name (``dp``: the dense gradients', ``edp``: the
    experts')."""
    from omnitron.core.models.gpt.config import padded_vocab_size
    from omnitron.core.parallel.data.buffers import BUCKET_ALIGN
    from omnitron.core.parallel.data.config import bucket_elements

    ddp, pc = settings.ddp, settings.parallel
    tp, pp = pc.tensor_model_parallel_size, pc.pipeline_model_parallel_size
    dist = bool(ddp and ddp.use_distributed_optimizer)
    fp32 = bool(ddp and ddp.accumulate_allreduce_grads_in_fp32)
    g_elem, p_elem = 4 if fp32 else cfg.params_dtype.itemsize, cfg.params_dtype.itemsize
    dense, expert = stage_param_groups(cfg, settings, pp_rank, layers)
    tied = not cfg.untie_embeddings_and_output_weights and pp_rank in (0, _head_rank(settings))
    scatter = dist or bool(ddp and ddp.reduce_scatter)
    iso = padded_vocab_size(cfg, tp) // tp * cfg.hidden_size if tied and scatter else 0
    out = []
    for name, n, group, own in (("dp", dense - iso, settings.dp * pc.context_parallel_size, [iso] if iso else []),
                                ("edp", expert, expert_data_parallel_size(settings), [])):
        if group <= 1 or n + sum(own) <= 0:
            continue
        bucket = bucket_elements(ddp, group, bucketing=pp_rank == 0)  # None: one bucket (Megatron's rule)
        sizes = ([int(n)] if n else []) if bucket is None else [bucket] * int(n // bucket) + \
            ([int(n % bucket)] if n % bucket else [])
        sizes += own
        # NOTE: sharded buckets end at multiples of lcm(group, 128) (GradBuffer, Megatron's layout); the 64-element
        # alignment of each parameter's start (< 64 elements a tensor) is not priced: the counts here are elements
        end = math.lcm(group, BUCKET_ALIGN) if scatter else 1
        for size in (-(-int(k) // end) * end for k in sizes):
            out += [(name, "reduce_scatter", size * g_elem, group), (name, "all_gather", size * p_elem, group)] \
                if dist else [(name, "all_reduce", size * g_elem, group)]
    return out


def dp_parts(settings, cfg, rates, pp_rank: int, layers) -> tuple[float, float, float]:
    """(the dense gradients' reduction, parameter all-gather, the expert gradients' reduction) seconds of
    :func:`dp_collectives` at the report's rates."""
    out = [0.0, 0.0, 0.0]
    for group, op, n, g in _dp_collectives(settings, cfg, pp_rank, layers):
        out[1 if op == "all_gather" else 2 * (group == "edp")] += rates.comm_s(op, n, g, group=group)
    return out[0], out[1], out[2]


def pair_credit(costs: dict[int, StageCost], overlap: str):
    """``(forward's stage, backward's stage) -> seconds`` a combined pair of ``--overlap-moe-expert-parallel-comm``
    runs in less than its forward and backward one after the other: each pass's expert-parallel all-to-alls run
    while the other pass computes (Megatron's combined 1F1B: the two hand over at every all-to-all,
    ``core/transformer/moe/overlap.py``), so of the forward's all-to-all time ``a_f`` the part that fits in the
    backward's work ``w_b`` is hidden, and likewise the backward's: ``min(a_f, w_b) + min(a_b, w_f)`` (under every
    ``--assume-overlap``: a pass's all-to-alls are never hidden behind its own work, :data:`HIDDEN`). ``a``: the
    rows' all-to-alls only (:attr:`StageCost.handed`); each MoE layer's token-count exchange, the router's statistics
    and the tp / etp gathers are waited where issued, within the pass."""
    def credit(f: int, b: int) -> float:
        fw, bw = costs[f]._parts("F")[0], costs[b]._parts("B")[0]
        return min(costs[f].handed["F"], bw) + min(costs[b].handed["B"], fw)
    return credit


def pipeline(settings, costs: dict[int, StageCost], overlap: str):
    """(timeline of the schedule on the ideal clock, the schedule) with ``costs`` per virtual stage: the table the
    run executes (:func:`omnitron.plan.moe_overlap.planned_schedule`: under ``--overlap-moe-expert-parallel-comm``
    the combined one, its deeper warm-up, and each pair's hidden all-to-all time taken off, :func:`pair_credit`)."""
    from omnitron.core.parallel.pipeline.simulate import simulate
    from omnitron.plan.moe_overlap import planned_schedule

    sched = planned_schedule(settings)

    table = {}
    for k, c in costs.items():
        b = c.total("B", overlap)
        table.update({(k, "F"): c.total("F", overlap), (k, "BW"): b, (k, "B"): b / 2, (k, "W"): b / 2})  # ZB-H1: B = W

    # under ``all`` / ``megatron`` a send overlaps the sender's next work, but its receiver still waits for the message
    transfer = None
    if overlap in BESIDE:
        hop = {(k, kind): c.lag(kind, overlap) for k, c in costs.items() for kind in "FB"}
        transfer = lambda k, kind: hop[(k, kind)]  # noqa: E731
    # complete=False: build_schedule's tables are checked by the schedule tests; a search simulates thousands
    return simulate(sched, stage_cost=lambda k, kind: table[(k, kind)], complete=False, transfer=transfer,
                    pair_credit=pair_credit(costs, overlap)), sched


def _stage_costs(settings, rates, overlap: str):
    """(model config, layers per virtual stage, :class:`StageCost` per virtual stage) of a layout."""
    from omnitron.plan.memory import model_config

    if overlap not in OVERLAPS:
        raise ConfigError(f"--assume-overlap {overlap!r} is not one of {', '.join(OVERLAPS)}")
    cfg = model_config(settings)
    pc = settings.parallel
    pp, vp = pc.pipeline_model_parallel_size, pc.virtual_pipeline_model_parallel_size or 1
    layers, wide = stage_layers(settings, cfg), wide_layers(settings, cfg)
    load = getattr(rates, "expert_load", None)
    rows = stage_layers(settings, cfg, len(load.shares)) if load is not None else {}
    rates.host_ranks = settings.world_size * _threads(settings, rates)[0]
    rates.bind(settings)
    costs, alike = {}, {}  # alike: a stage's cost by what decides it (a deep pipeline repeats a few kinds)
    style = _style(settings)
    for (r, c), kinds in layers.items():
        k = virtual_stage(r, c, pp, style)
        # NOTE: the V's turn (stage p-1 to p) stays on rank p-1: no transfer
        nxt = k < pp * vp - 1 and place_stage(k + 1, pp, style)[0] != r
        prev = k > 0 and place_stage(k - 1, pp, style)[0] != r
        ends = (k == 0, k == pp * vp - 1, nxt, prev)
        row = rows.get((r, c))
        key = (tuple(kinds), ends, None if row is None else tuple(row), tuple(wide[(r, c)]))
        if key not in alike:
            alike[key] = stage_cost(settings, cfg, rates, kinds, *ends, rows=row, wide=wide[(r, c)])
        costs[k] = alike[key]
    return cfg, layers, costs


def _style(settings) -> str:
    """The chunks' placement of the layout's ``--pipeline-schedule`` (``v`` for zb-v / dualpipe-v)."""
    from omnitron.core.parallel.pipeline.schedules import schedule_style

    return schedule_style(settings.training.pipeline_schedule)


def _head_rank(settings) -> int:
    """The pipeline rank holding the last stage (the output layer): rank 0 under a V-shaped schedule."""
    pp = settings.parallel.pipeline_model_parallel_size
    return place_stage(pp * (settings.parallel.virtual_pipeline_model_parallel_size or 1) - 1, pp,
                       _style(settings))[0]


def step_lower_bound(settings, rates, overlap: str = "none") -> float:
    """Seconds no less than :func:`predict`'s step: the busiest pipeline rank's work alone (no bubble, no data-
    parallel reduction, no optimizer step); a search prices exactly only what this bound cannot rule out."""
    _, _, costs = _stage_costs(settings, rates, overlap)
    pp = settings.parallel.pipeline_model_parallel_size
    per, stages = {}, {}
    for k, c in costs.items():
        r = place_stage(k, pp, _style(settings))[0]
        per[r] = per.get(r, 0.0) + c.total("F", overlap) + c.total("B", overlap)
        stages.setdefault(r, []).append(k)
    credit = pair_credit(costs, overlap) if getattr(settings.parallel, "overlap_moe_expert_parallel_comm", False) \
        else None
    if credit is not None:  # at most one pair per backward, each hiding at most the rank's largest credit
        per = {r: w - len(stages[r]) * max(credit(f, b) for f in stages[r] for b in stages[r]) for r, w in per.items()}
    return settings.num_microbatches * max(per.values())


def predict(settings, rates, overlap: str = "none") -> StepTime:
    """The :class:`StepTime` of ``settings``' layout on the machine of ``rates``."""
    cp_comm.check_one_type(settings.parallel)
    cfg, layers, costs = _stage_costs(settings, rates, overlap)
    pc = settings.parallel
    pp, vp = pc.pipeline_model_parallel_size, pc.virtual_pipeline_model_parallel_size or 1
    tl, sched = pipeline(settings, costs, overlap)
    m = settings.num_microbatches
    per_rank = {r: [costs[virtual_stage(r, c, pp, sched.style)] for c in range(vp)] for r in range(pp)}
    busy = {r: sum(tl_e - tl_s for tl_s, tl_e, _ in tl.spans[r]) for r in range(pp)}
    crit = max(busy, key=busy.get)
    parts = {key: m * sum(sc.f[key] + sc.b[key] for sc in per_rank[crit]) for key in KEYS}
    credit = pair_credit(costs, overlap) if sched.combined else None
    if credit is not None:  # the all-to-all time the critical rank's combined pairs hide (the simulation's credit)
        t = sched.tables[crit]
        parts["ep"] -= sum(min(credit(sched.stage(crit, t[i].chunk), sched.stage(crit, t[i + 1].chunk)),
                               costs[sched.stage(crit, t[i + 1].chunk)].total("B", overlap))
                           for i in sched.pairs.get(crit, ()))
    if overlap in BESIDE:  # hidden communication: what exceeds the exposed work beside it is charged to compute
        parts["cp"] -= m * sum(sc.ring["F"] + sc.ring["B"] for sc in per_rank[crit])
        parts.update(dict.fromkeys(BESIDE[overlap], 0.0))
        parts["compute"] = busy[crit] - sum(parts[k] for k in KEYS if k != "compute")
    held = {r: [x for c in range(vp) for x in layers[(r, c)]] for r in range(pp)}
    # a rank's parameters and gradient buckets depend on its layers and on whether it holds the embedding or the head
    alike, own, head = {}, {}, _head_rank(settings)
    for r in range(pp):
        key = (r == 0, r == head, tuple(held[r]))
        if key not in alike:
            alike[key] = (optimizer_time(settings, rates, *stage_param_groups(cfg, settings, r, held[r])),
                          dp_parts(settings, cfg, rates, r, held[r]))
        own[r] = alike[key]
    opt = max(o for o, _ in own.values())
    if overlap == "none":
        dp = max(sum(d) for _, d in own.values())
    else:
        shares = {r: _shares(per_rank[r], overlap) for r in range(pp)}
        dp = dp_overlap.exposed(tl, {r: (*own[r][1][:2], shares[r], _pieces(settings, cfg, r, held[r], shares[r],
                                                                            [len(layers[(r, c)]) for c in range(vp)]),
                                         own[r][1][2]) for r in range(pp)}, overlap)
    dp += _embedding_sync(settings, cfg, rates)
    total = tl.makespan + dp + opt
    tokens = settings.training.global_batch_size * cfg.seq_length
    return StepTime(total, parts["compute"], parts["elementwise"], parts["host"], parts["tp"], parts["cp"], parts["pp"],
                    parts["ep"],
                    dp, opt, tl.makespan - busy[crit], tokens / total, assumptions(settings, rates, overlap),
                    list(rates.notes))


def _pieces(settings, cfg, pp_rank: int, held, shares: list[float], layers: list[int]) -> list[int]:
    """Per chunk of a rank of stage ``pp_rank`` (its layers' MoE flags ``held``; each chunk's ``shares`` of its
    gradients and its ``layers``): the pieces its reduction becomes ready in over its last backward
    (:mod:`.dp_overlap`): one a layer, but no more than its gradient buckets (:class:`GradBuffer` closes a bucket
    at ``--ddp-bucket-size`` elements in backward order and reduces it once its last gradient is ready; a chunk
    after the first, and every chunk of a stage after the first, is one bucket, as in Megatron), the dense and the
    expert gradients bucketed apart (each chunk's share of the rank's, as its share of the backward)."""
    from omnitron.core.parallel.data.config import bucket_elements

    dense, expert = stage_param_groups(cfg, settings, pp_rank, held)
    groups = [(n, g) for n, g in ((dense, settings.dp * settings.parallel.context_parallel_size),
                                  (expert, expert_data_parallel_size(settings))) if n > 0 and g > 1]
    out = []
    for c, (w, n) in enumerate(zip(shares, layers)):
        # the overlap priced: buckets as --overlap-grad-reduce makes them (one for a chunk that does not bucket)
        sizes = [bucket_elements(settings.ddp, g, bucketing=c == 0 and pp_rank == 0, overlap=True) for _, g in groups]
        pieces = 1 if None in sizes else sum(math.ceil(e * w / b) for (e, _), b in zip(groups, sizes))
        out.append(max(1, min(n, pieces)))
    return out


def _shares(chunks: list, overlap: str) -> list[float]:
    """Each chunk's part of a rank's data-parallel bytes, taken as its part of the rank's backward work."""
    b = [sc.total("B", overlap) for sc in chunks]
    return [x / sum(b) for x in b] if sum(b) > 0 else [1 / len(b)] * len(b)


def optimizer_time(settings, rates, params: float, expert: float = 0.0) -> float:
    """The AdamW step over the elements this rank updates (with the distributed optimizer its 1 / (dp x cp)
    share of the dense ones and 1 / edp of the experts'), at the elementwise report's ``adamw`` rate; other
    optimizers are priced as AdamW (noted)."""
    ddp = settings.ddp
    if settings.optim.optimizer not in ("adam", "adamw"):
        rates.note(f"optimizer: --optimizer {settings.optim.optimizer} priced as AdamW")
    if ddp and ddp.use_distributed_optimizer:
        dp_cp = settings.dp * settings.parallel.context_parallel_size
        params = params / dp_cp + expert / expert_data_parallel_size(settings)
    else:
        params += expert
    threads, slow = _threads(settings, rates, "host_stream")
    return rates.elementwise_s("adamw", "step", params, threads) * slow


def _embedding_sync(settings, cfg, rates) -> float:
    """The tied word embedding's gradient all-reduce between the first and last stage (pp > 1, tied)."""
    from omnitron.core.models.gpt.config import padded_vocab_size

    pc = settings.parallel
    if pc.pipeline_model_parallel_size == 1 or cfg.untie_embeddings_and_output_weights or _style(settings) == "v":
        return 0.0  # V-shaped schedules: both copies on rank 0, summed there
    n = padded_vocab_size(cfg, pc.tensor_model_parallel_size) // pc.tensor_model_parallel_size * cfg.hidden_size
    return rates.comm_s("all_reduce", n * 4, 2, group="emb")


def assumptions(settings, rates, overlap: str) -> list[str]:
    threads, slow = _threads(settings, rates)
    what = {"none": "every communication on the critical path",
            "dp": "dp gradient reduction hidden behind the backward after each chunk's last one, bucket by bucket; "
                  "the experts' after the rank's last backward",
            "all": "pipeline sends and context-parallel ring hops hidden behind compute where shorter (a pipeline "
                   "message still reaches its receiver a transfer later); parameter all-gather behind the next "
                   "forward; tensor-parallel collectives and expert all-to-alls on the critical path, as the engine "
                   "waits for them",
            "megatron": "as all, and tensor-parallel collectives hidden behind the GEMMs where shorter, as "
                        "Megatron-LM's --tp-comm-overlap runs them (omnitron's engine does not: it runs all)"}
    out = [f"overlap: {overlap} ({what[overlap]})"] + ([fp8.describe(settings)] if settings.fp8 is not None else [])
    if getattr(settings.model, "num_experts", None):
        from omnitron.plan.memory import model_config
        from omnitron.plan.routing import describe

        out.append(describe(model_config(settings), settings, rates))
    if rates.device_type == "cpu":
        out.append(f"cores: {settings.world_size} rank(s) x {threads} thread(s) on {rates.cpu_count} cores: "
                   f"compute slowed x{slow:.2f}, collectives likewise beyond their measurement's sharing "
                   "(time-shared cores)")
    if getattr(settings.parallel, "overlap_moe_expert_parallel_comm", False):
        out.append("--overlap-moe-expert-parallel-comm: the combined 1F1B table; in each forward/backward pair the "
                   "all-to-alls of one pass hidden behind the other pass's work where shorter")
    out.append("not modelled: data loading, host overheads outside the layers, the loss and grad-norm reductions")
    return out


def format_step(st: StepTime) -> str:
    """The prediction: step time, tokens/s, the breakdown, assumptions and fallbacks."""
    rows = [f"predicted step {st.total * 1e3:.1f} ms, {st.tokens_per_s:,.0f} tokens/s",
            "  " + "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in st.breakdown().items())]
    rows += [f"  assumption: {a}" for a in st.assumptions] + [f"  fallback: {n}" for n in st.notes]
    return "\n".join(rows)
