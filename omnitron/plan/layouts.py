"""The layouts ``omnitron plan --devices N`` searches: every valid one of a model on N devices, each a
:class:`Choice` (its launch flags and full settings).

The search (:func:`candidates`): tp divides the devices, the attention heads and the query groups; pp divides
the rest and the layers, or the layers with the loss (and the embedding) counted as one (:func:`_split`); cp
(1, 2, 4, 8, and beyond 8 while a rank keeps at least 4,096 tokens: :func:`_cp_sizes`) divides the rest and
splits the sequence into ``2 cp`` chunks; dp is what remains and with the micro-batch size (1, 2, 4, 8) divides
the global batch, which stays as the flags give it; vpp (every divisor of the slots per stage up to 16, and one
layer a virtual stage) where pp > 1; where pp > 1 and the slots per stage are
even, the V-shaped schedules too (``--pipeline-schedule zb-v``, and ``dualpipe-v`` with at least 2 pp
micro-batches: two chunks per rank, their bubble from the schedule's simulation and their memory from walking
its table, as every schedule's); full recomputation (uniform, 1 layer) on / off (a device-profile search adds
block recomputation, the first k layers of each chunk, where a layout does not fit without:
:func:`omnitron.plan.recommend._blocks`);
the distributed optimizer on / off where dp x cp > 1; at cp > 1 a device-profile search also tries the all-gather and
the all-to-all (``--cp-comm-type allgather`` / ``a2a``: :func:`_cp_comms`); sequence parallelism always on with tp > 1
(it only saves memory); for MoE models, ep dividing the experts with etp (= tp) x ep dividing tp x cp x dp. Each
candidate is a full :class:`Settings`, so the engine's own validation rejects what it would.
"""
from __future__ import annotations

from dataclasses import dataclass

from omnitron.core.config.parallel import ConfigError


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
        comm = f"-{pc.cp_comm_type}" if pc.context_parallel_size > 1 and pc.cp_comm_type != "p2p" else ""
        return (f"tp{pc.tensor_model_parallel_size} pp{pc.pipeline_model_parallel_size} cp{pc.context_parallel_size}"
                f"{comm} dp{s.dp}" + (f" ep{ep}" if ep > 1 else "") + (f" {sched}" if sched else "")
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
"""The most virtual stages a rank's layers are split into in the search (each halves the bubble less), besides one
layer a virtual stage, which is always tried (a rank's 23 layers divide into 1 or 23 chunks only)."""


def _schedules(per_rank: int, pp: int, m: int):
    """(vpp, --pipeline-schedule or None for the default) tried for ``pp`` stages and ``m`` micro-batches, the
    ranks' layers splitting into chunks that ``per_rank`` divides (the layers a rank holds, the embedding / loss
    slots counted under --account-for-...-in-pipeline-split)."""
    if pp == 1:
        yield 1, None
        return
    for vpp in _divisors(per_rank):  # down to one layer a virtual stage, as Megatron allows
        if vpp == 1 or (vpp <= MAX_VPP or vpp == per_rank) and not m % pp:
            yield vpp, None
    if per_rank % 2 == 0:  # the V: two chunks per rank
        yield 2, "zb-v"
        if m >= 2 * pp:
            yield 2, "dualpipe-v"


_VPP_FLAGS = ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank")
_SPLIT_FLAGS = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
"""The user's pipeline split: kept by the search (:func:`_split`), checked per pipeline size."""


def _split(cfg, pc, pp: int) -> tuple[int, dict] | None:
    """(what the chunks of each of ``pp`` ranks must divide: the layers a rank holds, the embedding / loss slots
    counted where they count as one; the flags the search adds for the split), or None when the layers do not split
    over ``pp``. The user's split (``pc``) is kept: set first / last stage sizes split the rest evenly, and every
    rank's count must divide into the chunks. Without one, layers that ``pp`` does not divide are split as Megatron
    users split them (Llama 3 405B's 126 layers over 16 stages): the loss, and the embedding if that is not
    enough, counted as a layer (``--account-for-loss-in-pipeline-split``,
    ``--account-for-embedding-in-pipeline-split``: the first / last virtual stage one layer fewer)."""
    from math import gcd

    from omnitron.core.parallel.pipeline.layout import pipeline_layer_ranges

    first, last = pc.decoder_first_pipeline_num_layers, pc.decoder_last_pipeline_num_layers
    if first is not None or last is not None:
        try:
            return gcd(*(n for _, n in pipeline_layer_ranges(cfg.num_layers, pp, 1, first, last).values())), {}
        except ConfigError:
            return None
    given = pc.account_for_embedding_in_pipeline_split + pc.account_for_loss_in_pipeline_split
    loss, both = {"account_for_loss_in_pipeline_split": True}, {"account_for_embedding_in_pipeline_split": True}
    for extra, flags in ((given, {}),) if given else ((0, {}), (1, loss), (2, loss | both)):
        if (cfg.num_layers + extra) % pp == 0:
            return (cfg.num_layers + extra) // pp, flags
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


def _cp_comms(cfg, tp: int, cp: int, given: dict, cluster: int | None) -> tuple:
    """The ``--cp-comm-type`` values tried at ``cp``: the user's; else the ring (None: the default), and in a
    device-profile search at cp > 1 also the all-gather (Llama 3's) and the all-to-all where the heads a tp rank
    holds divide by cp (the hierarchical a2a+p2p only when the user gives it)."""
    if cp == 1 or given.get("cp_comm_type") or not cluster:
        return (None,)
    return (None, "allgather") + (("a2a",) if (cfg.num_attention_heads // tp) % cp == 0 else ())


def _grid(cfg, devices: int, gbs: int, max_tp: int | None = None, pc=None):
    """(tp, pp, cp, dp, mbs, vpp, schedule, (layers a rank, split flags)) that pass the divisibility rules of the
    module docstring (tp <= ``max_tp``; the split: :func:`_split` of the user's parallel config ``pc``)."""
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.models.gpt.config import query_groups

    pc = pc or ParallelConfig()
    for tp in _divisors(devices):
        if cfg.num_attention_heads % tp or query_groups(cfg) % tp or (max_tp and tp > max_tp):
            continue
        for pp in _divisors(devices // tp):
            split = _split(cfg, pc, pp) if pp > 1 else (cfg.num_layers, {})  # pp 1: nothing to balance
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
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.plan.memory import model_config
    from omnitron.plan.settings import settings_of

    if given.get("microbatch_group_size_per_vp_stage") is not None:  # its valid range hangs on each layout's pp, m
        raise ConfigError("--microbatch-group-size-per-virtual-pipeline-stage: the layout search sets the virtual "
                          "stages and micro-batch counts itself; drop it with --devices (a given layout is priced "
                          "with it)")
    given = {k: v for k, v in given.items() if k not in _VPP_FLAGS}  # the search sets the virtual stages
    split_given = {k: given[k] for k in _SPLIT_FLAGS if given.get(k) is not None}
    base = settings_of({k: v for k, v in given.items() if k not in split_given} | {"nproc_per_node": 1})
    cfg, gbs, pc = model_config(base), given.get("global_batch_size"), ParallelConfig(**split_given)
    if not gbs:
        raise ConfigError("--devices: give --global-batch-size (the recommendation keeps it fixed)")
    sized_ends = pc.decoder_first_pipeline_num_layers is not None or pc.decoder_last_pipeline_num_layers is not None
    out, seen = [], set()
    for tp, pp, cp, dp, mbs, vpp, sched, ep, (per_rank, split) in _with_ep(cfg,
                                                                           _grid(cfg, devices, gbs, cluster, pc)):
        for rec, comm in ((r, c) for r in ((True,) if minimal else (False, True))
                          for c in ((None,) if minimal else _cp_comms(cfg, tp, cp, given, cluster))):
            for dist in ((True,) if minimal or cluster else (False, True)) if dp * cp > 1 else (False,):
                key = (tp, pp, cp, ep) if minimal else (tp, pp, cp, ep, mbs, vpp, sched, rec, dist, comm)
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
                    flags["num_layers_per_virtual_pipeline_stage"] = per_rank // vpp
                if rec:
                    flags.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
                if comm:
                    flags["cp_comm_type"] = comm
                if dist:
                    flags["use_distributed_optimizer"] = True
                try:
                    s = settings_of(given | flags)
                except ConfigError:
                    continue  # the engine's own rules (the reason is not shown: other candidates remain)
                if s.world_size == devices:
                    out.append(Choice(flags, s))
    return out
