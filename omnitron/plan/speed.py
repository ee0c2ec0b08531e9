"""Predicted time of one training step of a layout, from the work of :mod:`omnitron.plan.work` priced by the
measured rates of :mod:`omnitron.plan.rates`.

Model (printed with every prediction; see ``BENCHMARKS.md`` for how close it comes on this CPU):

1. **Per micro-batch, per virtual stage**: forward = the stage's GEMMs (:func:`work.layer_gemms`, the last
   stage's logits) + core attention + its tensor-parallel collectives + ring hops + the send of its output
   to the next stage; backward = 2 x the forward GEMMs and attention (input and weight gradients), the
   backward collectives, and, with ``--recompute-granularity full``, the recomputed layers' forward again
   (``selective``: the core attention's forward again).
2. **The pipeline**: those costs run through the schedule's own action table on an ideal clock
   (:func:`omnitron.core.parallel.pipeline.simulate.simulate`): the step's makespan. The bubble is the
   makespan minus the busiest rank's work, ``(pp - 1) / m`` of it for 1F1B with equal stages and
   ``/ vpp`` interleaved.
3. **Data parallelism** after the pipeline: the stage's gradient buckets all-reduced over dp x cp, or
   reduce-scattered and the parameters all-gathered with ``--use-distributed-optimizer``.
4. **Overlap** is an assumption (``--assume-overlap``): ``none`` adds every communication to the
   critical path; ``dp`` hides the gradient reduction behind the last micro-batch's backward (Megatron's
   ``--overlap-grad-reduce``); ``all`` also hides tp / cp / pp communication behind the compute it runs beside
   (a stage's cost is ``max(compute, communication)``).
5. **Shared cores** (CPU reports): every rank of the layout runs on one host of the report's
   ``cpu_count`` cores, with ``omnitron train``'s intra-op threads (cores / ranks, at least 1). The GEMM /
   attention rows measured at that thread count are used; when ranks x threads exceed the cores, each
   rank's compute is slowed by ``ranks x threads / cores`` (the cores are time-shared), and so are the
   collectives (CPU work on gloo) beyond the time-sharing of their measurement (:mod:`omnitron.plan.rates`).

6. **Element-wise ops** (norms, residual adds, dropouts, the MLP activation, cross-entropy; each forward and
   backward) and the optimizer step are priced per element from an ``omnitron bench elementwise`` report
   (:func:`work.layer_elementwise`); without one they are left out (noted).

Not modelled: the data loader, host overheads between ops; MoE (``--num-experts``) is refused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from omnitron.core.config.parallel import ConfigError
from omnitron.plan import work

OVERLAPS = ("none", "dp", "all")
KEYS = ("compute", "elementwise", "tp", "cp", "pp")
_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass
class StageCost:
    """Seconds of one micro-batch of one virtual stage: compute and each communication, forward / backward."""

    f: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KEYS, 0.0))
    b: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KEYS, 0.0))

    def total(self, kind: str, overlap: str) -> float:
        d = self.f if kind == "F" else self.b
        work, comm = d["compute"] + d["elementwise"], d["tp"] + d["cp"] + d["pp"]
        return max(work, comm) if overlap == "all" else work + comm


@dataclass
class StepTime:
    """One step's predicted seconds: the critical rank's compute and communication, the bubble, the total."""

    total: float
    compute: float
    elementwise: float
    tp: float
    cp: float
    pp: float
    dp: float
    optimizer: float
    bubble: float
    tokens_per_s: float
    assumptions: list[str]
    notes: list[str]

    def breakdown(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in ("compute", "elementwise", "tp", "cp", "pp", "dp", "optimizer", "bubble")}


def _threads(settings, rates) -> tuple[int, float]:
    """(intra-op threads per rank, compute slow-down from ranks sharing the host's cores)."""
    if rates.device_type != "cpu":
        return max(rates.gemm), 1.0
    world, cores = settings.world_size, rates.cpu_count
    threads = settings.threads or (max(1, cores // world) if world > 1 else max(1, min(cores, 8)))
    return threads, max(1.0, world * threads / cores)


def stage_cost(settings, cfg, rates, layers: int, first: bool, last: bool, nxt: bool, prev: bool) -> StageCost:
    """:class:`StageCost` of a virtual stage of ``layers`` layers (``nxt`` / ``prev``: it has a next / previous
    stage to send its output / input gradient to)."""
    pc = settings.parallel
    tp, cp, sp = pc.tensor_model_parallel_size, pc.context_parallel_size, pc.sequence_parallel
    x = work.local_shapes(cfg, tp, cp, settings.training.micro_batch_size)
    dt, elem = _DTYPE.get(str(cfg.params_dtype).replace("torch.", ""), "fp32"), cfg.params_dtype.itemsize
    threads, slow = _threads(settings, rates)
    gemm = sum(rates.gemm_s(dt, m, n, k, threads) for _, m, n, k in work.layer_gemms(x)) * slow
    # ring attention: cp block calls of 1 / cp of the work each (a smaller call's rate); the merge of the
    # blocks' partial results is not priced
    attn = cp * rates.attention_s(dt, 3 * work.attention_flops(x) / cp, cfg.attention_dropout > 0, threads) * slow
    fwd, bwd = work.stage_tp_collectives(cfg, x, elem, sp, layers, first, last)
    layer_f, _ = work.stage_tp_collectives(cfg, x, elem, sp, 1, False, False)
    hops_f, hops_b, per = work.cp_ring(x, elem)
    hop = rates.comm_s("p2p", per, cp) if cp > 1 else 0.0
    c = StageCost()
    c.f["compute"] = layers * (gemm + attn / 3)
    c.b["compute"] = layers * (2 * gemm + 2 * attn / 3)
    c.f["tp"] = sum(rates.comm_s(op, n, tp) for op, n in fwd)
    c.b["tp"] = sum(rates.comm_s(op, n, tp) for op, n in bwd)
    c.f["cp"], c.b["cp"] = layers * hops_f * hop, layers * hops_b * hop
    rec = _recomputed(cfg, layers)
    c.b["compute"] += rec * (gemm + attn / 3) if cfg.recompute_granularity == "full" else 0.0
    c.b["compute"] += layers * attn / 3 if cfg.recompute_granularity == "selective" else 0.0
    c.b["tp"] += rec * sum(rates.comm_s(op, n, tp) for op, n in layer_f) if cfg.recompute_granularity == "full" else 0.0
    c.b["cp"] += rec * hops_f * hop if cfg.recompute_granularity == "full" else 0.0
    if last:
        _, m, n, k = work.head_gemm(x)
        c.f["compute"] += rates.gemm_s(dt, m, n, k, threads) * slow
        c.b["compute"] += 2 * rates.gemm_s(dt, m, n, k, threads) * slow
    _elementwise(c, cfg, x, sp, rates, threads, slow, layers, rec, first, last)
    msg = work.pp_message(x, elem, sp)
    c.f["pp"] = rates.comm_s("p2p", msg, 2) if nxt else 0.0
    c.b["pp"] = rates.comm_s("p2p", msg, 2) if prev else 0.0
    return c


def _elementwise(c: StageCost, cfg, x, sp: bool, rates, threads: int, slow: float, layers: int, rec: int,
                 first: bool, last: bool) -> None:
    """The stage's element-wise ops (:func:`work.layer_elementwise` and the ends), forward and backward; the
    recomputed layers' forward again."""
    def price(ops, mode):
        return sum(rates.elementwise_s(op, mode, n, threads) for op, n in ops) * slow

    layer = work.layer_elementwise(cfg, x, sp)
    ends = (work.embedding_elementwise(cfg, x, sp) if first else []) + (work.head_elementwise(cfg, x, sp) if last else [])
    c.f["elementwise"] = layers * price(layer, "fwd") + price(ends, "fwd")
    c.b["elementwise"] = layers * price(layer, "bwd") + rec * price(layer, "fwd") + price(ends, "bwd")


def _recomputed(cfg, layers: int) -> int:
    if cfg.recompute_granularity != "full":
        return 0
    return min(cfg.recompute_num_layers or 1, layers) if cfg.recompute_method == "block" else layers


def stage_params(cfg, settings, pp_rank: int, layers: int) -> float:
    """Parameters (elements) one rank of pipeline stage ``pp_rank`` holds and reduces gradients of."""
    from omnitron.core.models.gpt.config import max_positions, padded_vocab_size

    pc = settings.parallel
    tp, pp = pc.tensor_model_parallel_size, pc.pipeline_model_parallel_size
    n = layers * work.layer_params(cfg, tp)
    emb = padded_vocab_size(cfg, tp) // tp * cfg.hidden_size
    if pp_rank == 0:
        n += emb + (max_positions(cfg) * cfg.hidden_size if cfg.position_embedding_type == "learned_absolute" else 0)
    if pp_rank == pp - 1:
        n += cfg.hidden_size * (2 if cfg.normalization == "LayerNorm" else 1)
        if cfg.untie_embeddings_and_output_weights or pp > 1:
            n += emb
    return n


def dp_time(settings, cfg, rates, params: float) -> float:
    """Seconds of one step's gradient reduction (and the distributed optimizer's parameter all-gather) for a rank
    holding ``params`` elements: bucket by bucket over the dp x cp replica group."""
    ddp, pc = settings.ddp, settings.parallel
    group = settings.dp * pc.context_parallel_size
    fp32 = bool(ddp and ddp.accumulate_allreduce_grads_in_fp32)
    g_elem, p_elem = 4 if fp32 else cfg.params_dtype.itemsize, cfg.params_dtype.itemsize
    bucket = (ddp.bucket_size if ddp else None) or max(40_000_000, 1_000_000 * group)
    sizes = [bucket] * int(params // bucket) + ([params % bucket] if params % bucket else [])
    if ddp and ddp.use_distributed_optimizer:
        return sum(rates.comm_s("reduce_scatter", s * g_elem, group) + rates.comm_s("all_gather", s * p_elem, group)
                   for s in sizes)
    return sum(rates.comm_s("all_reduce", s * g_elem, group) for s in sizes)


def pipeline(settings, costs: dict[int, StageCost], overlap: str):
    """(timeline of the schedule on the ideal clock, the schedule) with ``costs`` per virtual stage."""
    from omnitron.core.parallel.pipeline.schedules import build_schedule
    from omnitron.core.parallel.pipeline.simulate import simulate

    pc = settings.parallel
    sched = build_schedule(settings.training.pipeline_schedule, pc.pipeline_model_parallel_size,
                           pc.virtual_pipeline_model_parallel_size, settings.num_microbatches)

    def cost(k: int, kind: str) -> float:
        b = costs[k].total("B", overlap)
        return costs[k].total("F", overlap) if kind == "F" else b if kind == "BW" else b / 2  # ZB-H1: B = W

    return simulate(sched, stage_cost=cost), sched


def predict(settings, rates, overlap: str = "none") -> StepTime:
    """The :class:`StepTime` of ``settings``' layout on the machine of ``rates``."""
    from omnitron.plan.memory import chunk_layers, model_config

    if overlap not in OVERLAPS:
        raise ConfigError(f"--assume-overlap {overlap!r} is not one of {', '.join(OVERLAPS)}")
    cfg = model_config(settings)
    if getattr(cfg, "num_experts", None):
        raise ConfigError("--num-experts: the speed model does not cover MoE layers yet; plan memory only "
                          "(drop --bench)")
    pc = settings.parallel
    pp, vp = pc.pipeline_model_parallel_size, pc.virtual_pipeline_model_parallel_size or 1
    layers = chunk_layers(settings, cfg)
    rates.host_ranks = settings.world_size * _threads(settings, rates)[0]
    costs = {}
    for (r, c), n in layers.items():
        k = c * pp + r
        costs[k] = stage_cost(settings, cfg, rates, n, first=k == 0, last=k == pp * vp - 1, nxt=k < pp * vp - 1,
                              prev=k > 0)
    tl, sched = pipeline(settings, costs, overlap)
    m = settings.num_microbatches
    per_rank = {r: [costs[c * pp + r] for c in range(vp)] for r in range(pp)}
    busy = {r: sum(tl_e - tl_s for tl_s, tl_e, _ in tl.spans[r]) for r in range(pp)}
    crit = max(busy, key=busy.get)
    parts = {key: m * sum(sc.f[key] + sc.b[key] for sc in per_rank[crit]) for key in KEYS}
    if overlap == "all":  # hidden communication: what exceeds the compute beside it is charged to compute
        parts.update(compute=busy[crit] - parts["elementwise"], tp=0.0, cp=0.0, pp=0.0)
    params = [stage_params(cfg, settings, r, sum(layers[(r, c)] for c in range(vp))) for r in range(pp)]
    dp = max(dp_time(settings, cfg, rates, n) for n in params)
    opt = optimizer_time(settings, rates, max(params))
    dp += _embedding_sync(settings, cfg, rates)
    if overlap in ("dp", "all"):
        dp = max(0.0, dp - sum(sc.total("B", overlap) for sc in per_rank[crit]))
    total = tl.makespan + dp + opt
    tokens = settings.training.global_batch_size * cfg.seq_length
    return StepTime(total, parts["compute"], parts["elementwise"], parts["tp"], parts["cp"], parts["pp"], dp, opt,
                    tl.makespan - busy[crit], tokens / total, assumptions(settings, rates, overlap), list(rates.notes))


def optimizer_time(settings, rates, params: float) -> float:
    """The AdamW step over the elements this rank updates (its 1 / (dp x cp) share with the distributed
    optimizer), at the elementwise report's ``adamw`` rate; other optimizers are priced as AdamW (noted)."""
    ddp = settings.ddp
    if settings.optim.optimizer not in ("adam", "adamw"):
        rates.note(f"optimizer: --optimizer {settings.optim.optimizer} priced as AdamW")
    if ddp and ddp.use_distributed_optimizer:
        params /= settings.dp * settings.parallel.context_parallel_size
    threads, slow = _threads(settings, rates)
    return rates.elementwise_s("adamw", "step", params, threads) * slow


def _embedding_sync(settings, cfg, rates) -> float:
    """The tied word embedding's gradient all-reduce between the first and last stage (pp > 1, tied)."""
    from omnitron.core.models.gpt.config import padded_vocab_size

    pc = settings.parallel
    if pc.pipeline_model_parallel_size == 1 or cfg.untie_embeddings_and_output_weights:
        return 0.0
    n = padded_vocab_size(cfg, pc.tensor_model_parallel_size) // pc.tensor_model_parallel_size * cfg.hidden_size
    return rates.comm_s("all_reduce", n * 4, 2)


def assumptions(settings, rates, overlap: str) -> list[str]:
    threads, slow = _threads(settings, rates)
    what = {"none": "every communication on the critical path",
            "dp": "dp gradient reduction hidden behind the last backward",
            "all": "all communication hidden behind compute where shorter"}
    out = [f"overlap: {overlap} ({what[overlap]})"]
    if rates.device_type == "cpu":
        out.append(f"cores: {settings.world_size} rank(s) x {threads} thread(s) on {rates.cpu_count} cores: "
                   f"compute slowed x{slow:.2f}, collectives likewise beyond their measurement's sharing "
                   "(time-shared cores)")
    out.append("not modelled: data loading, host overheads between ops, the loss and grad-norm reductions")
    return out


def format_step(st: StepTime) -> str:
    """The prediction: step time, tokens/s, the breakdown, assumptions and fallbacks."""
    rows = [f"predicted step {st.total * 1e3:.1f} ms, {st.tokens_per_s:,.0f} tokens/s",
            "  " + "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in st.breakdown().items())]
    rows += [f"  assumption: {a}" for a in st.assumptions] + [f"  fallback: {n}" for n in st.notes]
    return "\n".join(rows)
