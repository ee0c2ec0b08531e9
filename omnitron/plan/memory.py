"""Memory per rank and pipeline stage of a layout, before launch (``omnitron plan``, ``--log-memory-estimate``).

Terms (bytes, one rank of each pipeline stage; every tp / dp / cp rank of a stage holds the same up to
distributed-optimizer slice boundaries, and the largest is reported):

- parameters, gradients, optimizer state: counted exactly on a meta-device skeleton (:mod:`.state`);
- activations: one micro-batch's saved tensors per chunk (:mod:`.activations`: measured on small probes, their
  dropout saving the mask the backend's would (:func:`.measure.probing`: 1 byte an element on a device),
  scaled by batch x sequence, and s^2 where attention materialises scores: not under context parallelism's
  block kernels, whose attention dropout stores nothing score-sized, :mod:`.cp_blocks`) times the micro-batches the
  schedule holds: walking the rank's action table, a forward adds its chunk's micro-batch and the end of
  its backward (the ``W`` of a split ZB-H1 backward, whose weight gradient still needs the inputs) removes
  it; the peak over the table counts. A sent chunk output is not held (the runtime keeps its autograd node
  only). The split backward's B retains the whole graph for W, so a micro-batch keeps its saved tensors to the
  end of its W (ZB-H1: up to ``2p - 1 - r`` micro-batches on rank r, where 1F1B holds ``p - r``). Under
  ``--overlap-moe-expert-parallel-comm`` the table is the combined one (deeper warm-up) and a forward/backward pair
  holds what was held before it plus the pair's replayed excess (:mod:`.moe_overlap`). Under context
  parallelism a rank's sequence is ``s / cp``, plus what ``--cp-comm-type allgather`` / ``a2a`` / ``a2a+p2p`` keep
  beyond the ring (gathered or repeated keys and values, orders: :func:`.cp_comm.saved_extra`);
- boundary: the pipeline send still in flight while a backward runs: a rank releases a send's tensor at the
  exchange after the next action (``core/parallel/pipeline/p2p.py``), so a ``B`` or ``W`` that follows an
  action which sent an activation or input gradient (``[s(/tp under SP), b, h]``) runs beside it: the most
  of that over the table, independent of the number of micro-batches;
- W inputs (:func:`w_input_bytes`; zb-h1, zb-v, dualpipe-v's split cool-down): what a micro-batch holds from its
  B to its W beyond its saved tensors: the gradient kept at each weight boundary for W (every linear's and norm's
  output gradient: 11 h a token for a GPT-2 layer) and the received output gradient, probed by running the
  runtime's own B (:func:`.transients.w_inputs`); a B adds it in the table walk, its W takes it off (a
  one-layer h128 GPT-2 chunk at s128 b2: 1.5 MiB a micro-batch against its 4 MiB of saved tensors). The
  logits' gradient is not among them: the loss writes it over the saved logits (``inplace_backward``). An FP8
  linear holds B's quantized output gradient instead of the wide one (1 byte an element and its scales,
  :func:`.fp8_memory.fp8_w_inputs`), and its weight-gradient GEMM runs in W (:func:`.fp8_memory.replay_fp8`);
- logits: the last stage's vocabulary-shard part of the head (``V_pad / tp`` columns, per token);
- multi-token prediction (:func:`mtp_bytes`): on the last stage, each of the ``--mtp-num-layers`` depths holds
  one layer's activations, its embedding and projection inputs, and a head's loss buffers and logits as the
  main head's (in the activation and logit terms of the last chunk's micro-batch);
- FP8 (:mod:`.fp8_memory`): each FP8 linear's cached FP8 weight and scales (and the delayed recipe's amax
  histories), none for the output layer or the layers ``--first-last-layers-bf16`` keeps wide; under a
  per-tensor recipe the activation term holds the FP8 linears' saved inputs at 1 byte an element
  (:func:`.fp8_memory.saved_less`, taken off the probes' wide bytes); in the transient term, each FP8 linear's own
  forward and backward tensors (FP8 operands; emulated GEMMs' fp32 copies where the device has no FP8 GEMM:
  ``estimate``'s ``device``) at its moments of the replayed probe (:func:`.fp8_memory.replay_fp8`);

- recompute and transient: what one micro-batch's forward and backward through the chunk holds at its
  peak beyond that micro-batch's activation and logit terms, replayed from probes and scaled
  (:mod:`.transients`); the stage takes its largest chunk's, on top of the activations it holds. Of it,
  ``recompute`` is one recompute chunk's rematerialised activations (full recomputation; at most the
  excess), ``transient`` the rest: the gradients backward creates while the saved tensors are still held
  (logits' and activations' gradients, a weight's gradient before the data-parallel hook adds it into
  ``main_grad``, a tied output layer's gradient held until the embedding's arrives) and the pipeline's
  received activations and gradients; with attention dropout on cp's block kernels, their chunk's peak
  (:func:`.cp_blocks.block_dropout_bytes`).
- Mixture-of-Experts layers (:mod:`.moe_activations`): what an MoE layer saves beyond the
  dense layer the probe measures (router, dispatch pairs, gate weights, expert rows and MLPs, shared expert,
  ep / etp permutations), per chunk by ``--moe-layer-freq``; their backward probed with the layers MoE, and the
  etp all-gather's buffers. At balanced routing, or with a routing histogram (``--moe-expert-load``,
  :mod:`.routing`) on each stage's **busiest ep rank**: every ep rank ``r`` is priced with each MoE layer's rows
  for ``r``'s experts (the histogram row of that layer, capped or padded at the capacity by
  :func:`.routing.expert_rows`, the speed model's rows), and the rank whose activations and etp buffers peak
  highest is the stage's figure (:attr:`StageMemory.ep_rank`, beside the balanced total).

- optimizer step (:mod:`.optimizer_step`): the precision-aware Adam step's fp32 chunk copies (moments below
  fp32, masters kept as remainders); it runs after backward, so the total takes the larger of it and the terms
  the micro-batches hold.

Not modelled: communication buffers (but the etp all-gather's), allocator fragmentation, the fp32 optimizer step's
temporaries, buffers fused kernels allocate internally. Under a routing histogram the rank's local experts'
backward is priced at its rows (:mod:`.moe_backward`), the rematerialised chunk at the rank's rows of the stage's
heaviest MoE layers, and the multi-token prediction depths' MoE layers at the mean of the last chunk's rows (the
histogram has no rows of theirs). The transient
probe runs the tp-local layer without collectives and without sequence or context parallelism: under SP
it counts the hidden-sized gradients whole, where the real run holds the all-gather and reduce-scatter
buffers instead (tp2 + SP measured within 1%, with pp2 within 6.1%: BENCHMARKS.md).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from omnitron.core.parallel.pipeline.schedules import schedule_style
from omnitron.plan.activations import activation_model, fine_grained_bytes, without_offloading
from omnitron.plan.cp_blocks import block_dropout_bytes, priced_config
from omnitron.plan import cp_comm
from omnitron.plan.cp_comm import saved_extra
from omnitron.plan.fp8_memory import chunk_linears, fp8_bytes, fp8_log, fp8_replay_peak, fp8_w_inputs, saved_less
from omnitron.plan.fp8_moe import experts_as_run
from omnitron.plan.fp8_passes import native_gemm
from omnitron.plan.state import state_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageMemory:
    """One rank of pipeline stage ``stage``: bytes of each term."""

    stage: int
    layers: int
    params: int
    grads: int
    optimizer: int
    activations: int
    logits: int
    fp8: int
    recompute: int
    """Full recomputation: one recompute chunk's activations, rematerialised during its backward (at most
    what the step's peak holds beyond the activations and logits: the layers above are freed by then)."""
    inflight: int
    """Most micro-batches (over chunks) held at once by this rank's schedule."""
    transient: int = 0
    """Backward's own tensors at the step's peak, beyond the terms above (:mod:`.transients`); with FP8 linears, the
    probe's log replayed as they run it (:func:`.fp8_memory.replay_fp8`): their own forward and backward tensors."""
    boundary: int = 0
    """The pipeline send in flight beside a backward (one boundary tensor at most; :func:`send_in_flight`)."""
    w_inputs: int = 0
    """Split backwards (zb-h1, zb-v, dualpipe-v's cool-down): what the micro-batches between their B and W hold
    beyond their saved tensors (the gradients kept for W, :func:`w_input_bytes`), added to the activations' peak
    (:func:`peak_held`); 0 without the transient probes."""
    ep_rank: int | None = None
    """Under a routing histogram: the ep rank priced (the stage's busiest); None at balanced routing."""
    balanced: int | None = None
    """Under a routing histogram: the stage's total at balanced routing."""
    step: int = 0
    """The optimizer step's temporaries (:mod:`.optimizer_step`): the step runs after backward freed the
    activations, so the total takes the larger of it and the micro-batches' terms."""
    probed: bool = True
    """Whether backward's transients were probed; False where they were not run (``transients=False``) or their logs
    did not align (warned): ``transient`` and ``w_inputs`` are then 0 and the total is short of the step's peak."""

    @property
    def total(self) -> int:
        held = (self.activations + self.logits + self.recompute + self.transient + self.boundary + self.w_inputs)
        return self.params + self.grads + self.optimizer + self.fp8 + max(held, self.step)


def check_family(settings) -> None:
    """The planner prices decoder-only GPT-family models (GPT-2, Llama, MoE, MLA presets); its probes run GPT
    stages. Other families are refused in one line (ConfigError) rather than probed wrongly."""
    if getattr(settings, "model_type", "gpt") != "gpt":
        from omnitron.core.config.parallel import ConfigError

        raise ConfigError(f"omnitron plan prices GPT-family decoders (--model-type gpt: GPT-2, Llama, MoE, MLA); "
                          f"--model-type {settings.model_type} is not modelled: measure it with a short "
                          f"omnitron train run (peak memory is logged each --log-interval)")


def model_config(settings):
    """The model config as training builds it: the vocabulary is the tokenizer's (preset's without one)."""
    from omnitron.core.data import build_tokenizer
    from omnitron.core.data.tokenizers import tokenizer_kwargs
    from omnitron.core.models.family import family_of

    d, cfg = settings.data, settings.model
    try:
        tok = build_tokenizer(**tokenizer_kwargs(d), **family_of(cfg).tokenizer_kwargs(cfg))
        return replace(cfg, vocab_size=tok.vocab_size)
    except Exception:  # noqa: BLE001  no tokenizer files at plan time: the preset's vocabulary
        return cfg


def vocabulary_line(settings) -> str:
    """Which vocabulary the estimate priced, and how to change it: the tokenizer's, as ``omnitron train`` builds
    the model (a preset's own vocabulary is not used: ``--model llama3_8b`` with the default tokenizer prices
    GPT-2's 50257 rows, not Llama 3's 128256, which nothing said before)."""
    d, vocab = settings.data, model_config(settings).vocab_size
    given = "tokenizer_type" in settings.flat
    line = f"vocabulary priced: {vocab:,} rows from --tokenizer-type {d.tokenizer_type}{'' if given else ' (default)'}"
    preset = _preset_vocabulary(settings.flat.get("model"))
    if preset is not None and preset != vocab:
        line += f"; the {settings.flat['model']} preset's own is {preset:,}"
    return line + ("" if given else "; --tokenizer-type (and its --tokenizer-model / --vocab-file) sets the one "
                   "omnitron train builds")


def _preset_vocabulary(name) -> int | None:
    from omnitron.core.models.family import family_of_preset

    family = family_of_preset(name) if name else None
    return getattr(family.presets[name](), "vocab_size", None) if family is not None else None


def _ranges(settings, cfg) -> dict[tuple[int, int], tuple[int, int]]:
    from omnitron.core.parallel.pipeline.layout import config_layer_ranges

    return config_layer_ranges(cfg.num_layers, settings.parallel, schedule_style(settings.training.pipeline_schedule))


def chunk_layers(settings, cfg) -> dict[tuple[int, int], int]:
    """``{(pp_rank, chunk): local layer count}``."""
    return {k: n for k, (_, n) in _ranges(settings, cfg).items()}


def chunk_moe_layers(settings, cfg) -> dict[tuple[int, int], int]:
    """``{(pp_rank, chunk): how many of its layers are Mixture-of-Experts}`` (``--moe-layer-freq``)."""
    from omnitron.core.transformer.moe.pattern import is_moe_layer

    return {k: sum(is_moe_layer(cfg, i) for i in range(o, o + n)) for k, (o, n) in _ranges(settings, cfg).items()}


def moe_routing(settings, cfg, load) -> dict[tuple[int, int], list[tuple]]:
    """``{(pp_rank, chunk): [the histogram rows one MoE layer of the chunk is priced at, per MoE layer]}``:
    its own row when ``load`` has one per MoE layer, else all of them (priced at their mean), as the speed
    model maps them (:func:`omnitron.plan.stage_layers.stage_layers`)."""
    from omnitron.plan.stage_layers import stage_layers

    load.check(cfg.num_experts)
    kinds, rows = stage_layers(settings, cfg), stage_layers(settings, cfg, len(load.shares))
    return {k: [load.shares if j is None else (load.shares[j],) for moe, j in zip(kinds[k], rows[k]) if moe]
            for k in kinds}


def _moe_args(settings, cfg) -> tuple:
    pc = settings.parallel
    return (cfg, cfg.seq_length // pc.context_parallel_size, settings.training.micro_batch_size,
            pc.tensor_model_parallel_size, pc.sequence_parallel, pc.expert_model_parallel_size, pc.etp)


def _routed(fn, args: tuple, spec: tuple, rank: int) -> float:
    """``fn`` of one MoE layer priced at each histogram row of ``spec`` on ep rank ``rank``, their mean."""
    return sum(fn(*args, share, rank) for share in spec) / len(spec)


def _distinct(specs: list) -> list[tuple[tuple, int]]:
    """(spec, how many layers have it) of a :func:`moe_routing` list: the layers priced at the mean over every
    row share one spec, priced once (a histogram of 61 rows for 58 layers at ep 64 is 226k layer prices else)."""
    counts, first = {}, {}
    for spec in specs:
        counts[id(spec)] = counts.get(id(spec), 0) + 1
        first.setdefault(id(spec), spec)
    return [(first[k], n) for k, n in counts.items()]


def moe_extra(settings, cfg, moe: int, routed=None) -> float:
    """``moe`` MoE layers' saved bytes beyond the dense layers the probe prices (:mod:`.moe_activations`), one
    micro-batch, for layers that keep their activations (a fully recomputed layer keeps its input only).
    ``routed``: (the chunk's :func:`moe_routing` list, an ep rank): its last ``moe`` MoE layers priced at their
    histogram rows on that rank's experts; None: balanced."""
    if not moe:
        return 0.0
    from omnitron.plan.moe_activations import moe_layer_extra

    args = _moe_args(settings, cfg)
    if routed is None:
        return moe * moe_layer_extra(*args)
    specs, rank = routed
    return sum(n * _routed(moe_layer_extra, args, spec, rank) for spec, n in _distinct(specs[len(specs) - moe:]))


def _moe_exchange(settings, cfg, specs=(), rank: int | None = None) -> float:
    """An MoE layer's backward exchange buffers beyond the dense probe's transients (:mod:`.moe_activations`):
    balanced, or the largest of the MoE layers ``specs`` (:func:`moe_routing` rows) on ep rank ``rank``."""
    from omnitron.plan.moe_activations import moe_exchange_transient

    args = _moe_args(settings, cfg)
    if rank is None:
        return moe_exchange_transient(*args)
    return max((_routed(moe_exchange_transient, args, spec, rank) for spec, _ in _distinct(specs)), default=0.0)


def _experts_skew(settings, cfg, specs: list, rank: int, room: float | None) -> int:
    """What a chunk's peak gains from ep rank ``rank``'s local experts' backward at its rows under the chunk's
    :func:`moe_routing` ``specs``: the largest over its MoE layers of :func:`.moe_backward.skew_bytes` beyond
    ``room``, how far the chunk's balanced peak lay above the experts' backward in the probe
    (:func:`transient_bytes`); 0 without MoE layers, or when their probes do not align (warned)."""
    from omnitron.plan.moe_backward import skew_bytes

    if room is None or not specs:
        return 0
    try:
        most = max(_routed(skew_bytes, _moe_args(settings, cfg), spec, rank) for spec, _ in _distinct(specs))
    except RuntimeError as e:
        log.warning("%s; the MoE experts' backward is priced at balanced routing", e)
        return 0
    return max(0, round(most - room))


def _recomputed(cfg, layers: int) -> int:
    """How many of a chunk's ``layers`` layers full recomputation reruns (they keep their inputs only)."""
    if cfg.recompute_granularity != "full":
        return 0
    return min(cfg.recompute_num_layers or 1, layers) if cfg.recompute_method == "block" else layers


def _offloaded(cfg, layers: int) -> int:
    """How many of a chunk's ``layers`` layers keep their saved activations in host memory under
    ``--cpu-offloading-num-layers`` (the first N of every chunk, :mod:`omnitron.core.transformer.offload`)."""
    from omnitron.core.models.gpt.config import offload_layers

    return min(offload_layers(cfg), layers) if cfg.cpu_offloading_activations else 0


def microbatch_bytes(settings, cfg, layers: int, last: bool, first: bool = False, moe: int = 0,
                     routed=None) -> tuple[float, float]:
    """(activations, logits) bytes of one micro-batch of a chunk of ``layers`` layers, ``moe`` of them MoE
    (``routed``: their routing, :func:`moe_extra`). Offloaded layers (:func:`_offloaded`) keep nothing on the
    device, and under --fine-grained-activation-offloading every layer keeps what its --offload-modules do not
    save (:func:`~.activations.fine_grained_bytes`; what the backward brings back: :func:`reload_bytes`)."""
    pc, t = settings.parallel, settings.training
    tp, sp = pc.tensor_model_parallel_size, pc.sequence_parallel
    s, b = cfg.seq_length // pc.context_parallel_size, t.micro_batch_size
    am = activation_model(cfg, tp)
    n_rec, n_off = _recomputed(cfg, layers), _offloaded(cfg, layers)
    kept = layers - n_rec - n_off
    one = am.layer.bytes(s, b, tp, sp) + saved_extra(settings, cfg) - fine_grained_bytes(cfg, tp, s, b, sp)
    acts = n_rec * am.recomputed.bytes(s, b, tp, sp) + kept * one
    acts += moe_extra(settings, cfg, min(max(0, moe - n_rec), kept), routed)
    if first:
        acts += s * b * am.embedding / (tp if sp else 1)
    if not last:
        return acts, 0.0
    from omnitron.core.models.gpt.config import padded_vocab_size

    head = s * b * am.head_fixed / (tp if sp else 1)
    logits = s * b * am.head_vocab * padded_vocab_size(cfg, tp) / tp
    mtp_acts, mtp_logits = mtp_bytes(settings, cfg, head, logits, routed)
    return acts + head + mtp_acts, logits + mtp_logits


def reload_bytes(settings, cfg, layers: int, moe: int = 0) -> float:
    """What one micro-batch's backward through a chunk of ``layers`` layers holds beyond its kept layers' saved
    tensors while it brings offloaded layers back: an offloaded layer returns as the layer after it starts its
    backward, so two layers are on the device then (the later ones and the head freed already); 0 without
    offloading or where the kept layers are two or more. MoE layers among them where the chunk has any.
    --fine-grained-activation-offloading: one layer's offloaded tensors, back while that layer's backward runs."""
    pc = settings.parallel
    tp, sp = pc.tensor_model_parallel_size, pc.sequence_parallel
    s, b = cfg.seq_length // pc.context_parallel_size, settings.training.micro_batch_size
    n_off = _offloaded(cfg, layers)
    kept = layers - n_off
    if not n_off or kept >= 2:
        return fine_grained_bytes(cfg, tp, s, b, sp) if layers else 0.0
    one = activation_model(cfg, tp).layer.bytes(s, b, tp, sp) + saved_extra(settings, cfg)
    return (2 - kept) * one + moe_extra(settings, cfg, max(0, min(2, moe) - min(moe, kept)))


def mtp_bytes(settings, cfg, head: float, logits: float, routed=None) -> tuple[float, float]:
    """(activations, logits) bytes of one micro-batch through the multi-token prediction depths on the last stage:
    per depth a layer (not recomputed: the depths sit outside the decoder's recompute chunks; MoE when the
    decoder's last layer is, as the engine builds it), its inputs
    (``mtp_inputs``, split over tp under SP) and a head of ``head`` and ``logits`` bytes, the main head's (under
    SP its output layer keeps its input shard; before 2026-12-05 the all-gathered sequence, priced as one
    ``[s/tp, b, h]`` more a depth). ``routed``: the last
    chunk's (:func:`moe_routing` rows, ep rank), as :func:`moe_extra`: a depth's MoE layer at the mean of those
    rows on that rank (a histogram has none of the depths': ``--moe-expert-load-out`` does not count them)."""
    depths = cfg.mtp_num_layers or 0
    if not depths:
        return 0.0, 0.0
    pc = settings.parallel
    tp, sp = pc.tensor_model_parallel_size, pc.sequence_parallel
    s, b = cfg.seq_length // pc.context_parallel_size, settings.training.micro_batch_size
    am = activation_model(cfg, tp)
    inputs = s * b * am.mtp_inputs / tp if sp else s * b * am.mtp_inputs
    from omnitron.core.transformer.moe.pattern import is_moe_layer

    mine = None if routed is None or not routed[0] else ([tuple(x for spec in routed[0] for x in spec)], routed[1])
    layer = am.layer.bytes(s, b, tp, sp) + moe_extra(settings, cfg, is_moe_layer(cfg, cfg.num_layers - 1), mine)
    return depths * (layer + inputs + head), depths * logits


def output_bytes(settings, cfg, last: bool) -> float:
    """A chunk's output, ``[s(/tp under SP), b, h]``, the size of every pipeline message: 0 on the last chunk,
    which returns the loss."""
    pc = settings.parallel
    if last:
        return 0.0
    s, b = cfg.seq_length // pc.context_parallel_size, settings.training.micro_batch_size
    return s * b * cfg.hidden_size * cfg.params_dtype.itemsize / (pc.tensor_model_parallel_size if pc.sequence_parallel
                                                                  else 1)


def peak_held(schedule, rank: int, per_chunk: dict[int, float], after_b: dict[int, float] | None = None,
              pairs: dict[tuple[int, int], float] | None = None) -> tuple[float, int]:
    """(peak bytes, peak micro-batches) held by ``rank`` walking its action table: a forward adds its chunk's
    ``per_chunk`` bytes, a split backward's B its ``after_b`` (the W inputs, :func:`w_input_bytes`), the end of the
    backward (W, or an unsplit B) takes both off. A combined pair's forward (``schedule.combined``,
    ``--overlap-moe-expert-parallel-comm``) runs beside its backward: it holds what was held before the pair and
    ``pairs[(its forward's chunk, its backward's chunk)]`` (:func:`.moe_overlap.pair_extras`; missing: 0), its
    forward's micro-batch whole only once the backward has freed its own."""
    split = schedule.split_backward(rank)
    after_b, pairs = after_b or {}, pairs or {}
    held, waiting = {c: 0 for c in per_chunk}, {c: 0 for c in per_chunk}
    best, most = 0.0, 0
    table = schedule.tables[rank]
    for i, a in enumerate(table):
        key = (a.chunk, a.microbatch)
        level = sum(per_chunk[c] * n + after_b.get(c, 0.0) * waiting[c] for c, n in held.items())
        if a.kind == "F" and schedule.combined and schedule.paired(rank, i):
            best = max(best, level + pairs.get((a.chunk, table[i + 1].chunk), 0.0))
            held[a.chunk] += 1
            most = max(most, sum(held.values()))
        elif a.kind == "F" or (a.kind == "B" and key in split):
            held[a.chunk] += a.kind == "F"
            waiting[a.chunk] += a.kind == "B"
            best = max(best, level + (per_chunk[a.chunk] if a.kind == "F" else after_b.get(a.chunk, 0.0)))
            most = max(most, sum(held.values()))
        elif a.kind == "W" or a.kind == "B":
            held[a.chunk] -= 1
            waiting[a.chunk] -= a.kind == "W"
    return best, most


def split_chunks(schedule, rank: int) -> dict[int, tuple[bool, bool]]:
    """Per chunk of ``rank``: (whether some of its backwards are split into B and W, whether some are not)."""
    split = schedule.split_backward(rank)
    backs = [(a.chunk, a.microbatch) for a in schedule.tables[rank] if a.kind == "B"]
    return {c: (any(k in split for k in backs if k[0] == c), any(k not in split for k in backs if k[0] == c))
            for c in range(schedule.vp)}


def send_in_flight(schedule, rank: int, boundary: float) -> float:
    """Bytes of the send still in flight while a backward (``B`` or ``W``) runs on ``rank``, the most over its
    table: the previous action's message (an activation from a forward short of the last stage, an input
    gradient from a backward past the first), ``boundary`` bytes each; released at the next exchange."""
    table, last = schedule.tables[rank], schedule.num_stages - 1
    best = 0.0
    for prev, a in zip(table, table[1:]):
        k = schedule.stage(rank, prev.chunk)
        sends = (prev.kind == "F" and k < last) or (prev.kind == "B" and k > 0)
        if a.kind in "BW" and sends:
            best = boundary
    return best


def recompute_bytes(settings, cfg, routed=None) -> int:
    """One full-recompute chunk's plain activations (one micro-batch): what its backward rematerialises.
    ``routed``: (the stage's :func:`moe_routing` rows, an ep rank): its MoE layers at that rank's rows of the
    stage's heaviest MoE layers (which chunk is rematerialised at the peak is not known: an upper bound)."""
    if cfg.recompute_granularity != "full":
        return 0
    pc = settings.parallel
    tp = pc.tensor_model_parallel_size
    s, b = cfg.seq_length // pc.context_parallel_size, settings.training.micro_batch_size
    n = 1 if cfg.recompute_method == "block" else (cfg.recompute_num_layers or 1)
    moe = n if cfg.num_experts else 0  # NOTE: the rematerialised chunk priced as MoE layers when the model has any
    one = activation_model(cfg, tp).layer.bytes(s, b, tp, pc.sequence_parallel) + saved_extra(settings, cfg)
    heavy = _heaviest(settings, cfg, moe, *routed) if routed and routed[0] and moe else moe_extra(settings, cfg, moe)
    return round(n * one + heavy)


def _heaviest(settings, cfg, moe: int, specs: list, rank: int) -> float:
    """The most ``moe`` of the MoE layers ``specs`` (:func:`moe_routing` rows) save on ep rank ``rank`` (the
    heaviest one again where they are fewer)."""
    from omnitron.plan.moe_activations import moe_layer_extra

    args = _moe_args(settings, cfg)
    per = sorted((v for spec, n in _distinct(specs) for v in [_routed(moe_layer_extra, args, spec, rank)] * n),
                 reverse=True)
    return sum(per[:moe]) + per[0] * max(0, moe - len(per))


def _unit(cfg) -> int:
    """The recompute chunk (1 without full recomputation): the transient probes run ``min(layers, 2 u)`` layers."""
    return (cfg.recompute_num_layers or 1) if cfg.recompute_granularity == "full" else 1


def _probe_log(settings, cfg, n: int, first: bool, last: bool, moe: bool, split: bool) -> tuple[list, list[float]]:
    """(events, scaled sizes) of the transient probe of ``n`` layers of a chunk (:func:`.transients.scaled_log`):
    the tp-local layer without SP, every layer MoE when the chunk has any (``moe``); ``split``: its backward
    split into B and W as the zero-bubble schedules run it."""
    from omnitron.core.models.gpt.config import padded_vocab_size
    from omnitron.plan.activations import probe_config
    from omnitron.plan.transients import _B0, _S0, Probe, scaled_log

    pc = settings.parallel
    tp = pc.tensor_model_parallel_size
    probe, kh, kd = probe_config(cfg, tp)
    s, b = cfg.seq_length // pc.context_parallel_size, settings.training.micro_batch_size
    if moe:
        from omnitron.plan.moe_activations import transient_probe

        probe = transient_probe(cfg, probe, kh * kd, tp, pc.etp)
    return scaled_log(Probe(probe, n, first, last, _S0, _B0, split), s, b, kh, kd, padded_vocab_size(cfg, tp) // tp)


def _pair_log(settings, cfg, n: int, end: tuple[bool, bool], moe: bool, fp8: dict | None,
              native: bool) -> tuple[list, list[float]]:
    """The unsplit probe log of ``n`` layers a combined pair replays (:func:`.moe_overlap.pair_extras`): the wide
    one, or with FP8 linears ``fp8`` as they run it (:func:`.fp8_memory.fp8_log`: their saved inputs and scales
    per recipe, their passes' own tensors, the wide inputs they free), as the plain transient term replays it."""
    log = _probe_log(settings, cfg, n, *end, moe, False)
    return fp8_log(settings, cfg, *log, fp8, native, n) if fp8 else log


def w_input_bytes(settings, cfg, layers: int, first: bool, last: bool, moe: bool = False,
                  fp8: dict | None = None) -> float:
    """What one micro-batch of a chunk of ``layers`` layers holds between its B and its W beyond its saved tensors
    (which the retained graph keeps to the end of W: the activation term): the gradients the split backward keeps
    at each weight boundary for W (every linear's and norm's output gradient) and the received output gradient,
    as the probe running the runtime's B holds them (:func:`.transients.w_inputs`). Probed at ``n = min(layers,
    2 u)`` layers and, past that, ``u`` layers more at the rate between ``u`` and ``2 u`` (the same boundaries
    each layer). Under SP priced whole (the probe has no SP: the kept norm and row-parallel output gradients
    are sequence shards there), an upper bound; MoE layers at balanced routing. ``fp8``: the chunk's FP8 linears
    (:func:`.fp8_memory.chunk_linears`): each holds B's quantized output gradient for W instead of the wide one
    (:func:`.fp8_memory.fp8_w_inputs`)."""
    from omnitron.plan.transients import w_inputs

    def held_at(k: int) -> float:
        log = _probe_log(settings, cfg, k, first, last, moe, True)
        return fp8_w_inputs(settings, cfg, *log, fp8) if fp8 else w_inputs(*log)

    unit = _unit(cfg)
    n = min(layers, 2 * unit)
    held = held_at(n)
    if layers > n:
        held += (layers - n) * (held - held_at(unit)) / unit
    return held


def transient_bytes(settings, cfg, layers: int, first: bool, last: bool, moe: bool = False,
                    slack: bool = False, fp8: dict | None = None, native: bool = False, split: bool = False):
    """What one micro-batch's forward and backward through a chunk of ``layers`` layers holds at its peak
    beyond the chunk's activation and logit terms: rematerialised layers and backward's transients (module
    doc); probed at ``min(layers, 2 u)`` layers, ``u`` the recompute chunk (1 without full recomputation),
    every one MoE when the chunk has any (``moe``, :func:`omnitron.plan.moe_activations.transient_probe`).
    ``split``: the backward split into B and W (:func:`w_input_bytes`): beyond its W inputs as well, and past
    ``2 u`` layers grown at the rate between the probes at ``u`` and ``2 u`` (the probes' W inputs): under full
    recomputation B's rerun keeps each layer's weight-boundary tensors for W (``tensor/recompute.py``), which
    grow with the depth; without it the rate is ~0 (the peak falls in the top layer's or the head's pass).
    ``slack``: (that, how far the peak lies above the most the MoE experts' backward holds in the probe; None
    without MoE layers): how much more the experts' backward may hold before it sets the peak. ``fp8``: the chunk's
    FP8 linears (:func:`.fp8_memory.chunk_linears`): the wide probe replayed as they run it, their own tensors (GEMMs
    ``native`` or emulated) and 1-byte saved inputs at their moments (:func:`.fp8_memory.fp8_replay_peak`)."""
    from omnitron.kernels.alloc_log import peak
    from omnitron.plan.transients import experts_windows

    unit = _unit(cfg)
    n = min(layers, 2 * unit)
    events, sizes = _probe_log(settings, cfg, n, first, last, moe, split)
    real = fp8_replay_peak(settings, cfg, events, sizes, fp8, native, n) if fp8 else peak(events, sizes)
    excess = _probe_excess(settings, cfg, n, first, last, moe, split, events, sizes, real, fp8)
    if split and layers > n:  # W's own tensors may grow with the depth: see the docstring
        low = _probe_log(settings, cfg, unit, first, last, moe, True)
        at_unit = fp8_replay_peak(settings, cfg, *low, fp8, native, unit) if fp8 else peak(*low)
        grown = excess - _probe_excess(settings, cfg, unit, first, last, moe, True, *low, at_unit, fp8)
        excess += (layers - n) * grown / unit
    excess = max(0, round(excess))
    if not slack:
        return excess
    windows = experts_windows(events, sizes)
    return excess, (real - max(windows) if windows else None)


def _probe_excess(settings, cfg, n: int, first: bool, last: bool, moe: bool, split: bool, events: list,
                  sizes: list[float], real: float, fp8: dict | None = None) -> float:
    """A probe's peak ``real`` beyond the activation and logit terms of its ``n`` layers (and its W inputs when
    ``split``: as its FP8 linears ``fp8`` hold them, the term the table walk adds), its sent output and what SP's
    re-gather adds (:func:`transient_bytes`)."""
    from omnitron.plan.transients import w_inputs

    pc = settings.parallel
    whole = replace(settings, parallel=replace(pc, sequence_parallel=False))
    acts, logits = microbatch_bytes(whole, without_offloading(cfg), n, last=last, first=first)  # as probed
    if moe:
        from omnitron.plan.moe_activations import probe_layer_extra

        s, b = cfg.seq_length // pc.context_parallel_size, settings.training.micro_batch_size
        acts += (n - _recomputed(cfg, n)) * probe_layer_extra(cfg, s, b, pc.tensor_model_parallel_size, pc.etp)
    if split:
        acts += fp8_w_inputs(settings, cfg, events, sizes, fp8) if fp8 else w_inputs(events, sizes)
    return real - acts - output_bytes(whole, cfg, last) - logits + regather_bytes(settings, cfg, last)


def regather_bytes(settings, cfg, last: bool) -> float:
    """What a plain column-parallel linear's backward holds under SP beyond the one-process probe's (no SP) replay:
    its input gradient's ``[s/tp, b, h]`` shard, reduce-scattered before it re-gathers its saved input shard for the
    weight gradient (:mod:`omnitron.core.parallel.tensor.gather_linear`), beside that whole-sequence input, where the
    probe's ``F.linear`` backward held the whole input gradient in the input's place (measured 2026-12-05 on the tp2
    SP rows of benchmarks/plan_memory.py: the plan 0.7% under each step peak without it, the shard's size). 0 without
    SP, and on a chunk whose column-parallel linears are all FP8 (the output layer, on the last, never is)."""
    pc = settings.parallel
    tp = pc.tensor_model_parallel_size
    if not pc.sequence_parallel or tp == 1 or (settings.fp8 is not None and not last):
        return 0.0
    s, b = cfg.seq_length // pc.context_parallel_size, settings.training.micro_batch_size
    return s * b * cfg.hidden_size * cfg.params_dtype.itemsize / tp


def _held(settings, cfg, schedule, r: int, ends: dict, chunks: tuple, routing, rank: int | None,
          less: dict, w: dict, pairs: dict | None = None) -> tuple:
    """(activation peak, most micro-batches in flight, logit peak, the etp exchange's buffers, what the W inputs
    ``w`` (per chunk, :func:`w_input_bytes`) add to the activation peak) of pipeline rank
    ``r`` with ep rank ``rank``'s rows of the :func:`moe_routing` ``routing`` (None: balanced); ``chunks``: the
    (:func:`chunk_layers`, :func:`chunk_moe_layers`) the caller computed once for every rank; ``less``: per chunk
    what per-tensor FP8 linears' 1-byte saved inputs take off (:func:`.fp8_memory.saved_less`); ``pairs``: what
    each combined pair adds (:func:`.moe_overlap.pair_extras`, in the activation peak: the replayed pair holds the
    logits and transients of one micro-batch, which the other terms count)."""
    layers, moe = chunks
    acts, logits, specs = {}, {}, []
    for c, (first, last) in ends.items():
        routed = None if rank is None else (routing[(r, c)], rank)
        specs += [] if rank is None else routing[(r, c)]
        acts[c], logits[c] = microbatch_bytes(settings, cfg, layers[(r, c)], last=last, first=first, moe=moe[(r, c)],
                                              routed=routed)
        acts[c] -= less.get(c, 0.0)
    exchange = round(_moe_exchange(settings, cfg, specs, rank)) if any(moe[(r, c)] for c in ends) else 0
    act_peak, most = peak_held(schedule, r, acts, pairs=pairs)
    return (act_peak, most, peak_held(schedule, r, logits)[0], exchange,
            peak_held(schedule, r, acts, w, pairs)[0] - act_peak)


def _w_inputs(settings, cfg, schedule, r: int, ends: dict, chunks: tuple) -> dict[int, float]:
    """Per chunk of pipeline rank ``r`` whose backwards the schedule splits: :func:`w_input_bytes` (none when the
    probes' logs do not align: warned, as the transients)."""
    layers, moe = chunks
    split, fp8 = split_chunks(schedule, r), chunk_linears(settings, cfg, r)
    try:
        return {c: w_input_bytes(settings, cfg, layers[(r, c)], first, last, moe[(r, c)] > 0, fp8.get(c))
                for c, (first, last) in ends.items() if split[c][0]}
    except RuntimeError as e:
        log.warning("%s; the memory estimate leaves the split backward's W inputs out", e)
        return {}


def _transient(settings, cfg, layers: int, end: tuple[bool, bool], moe: bool, fp8, native: bool,
               split: tuple[bool, bool]) -> tuple:
    """:func:`transient_bytes` (with its slack) of a chunk whose backwards are split (``split[0]``, beyond the W
    inputs) or not (``split[1]``), the larger where the schedule runs both."""
    got = [transient_bytes(settings, cfg, layers, first=end[0], last=end[1], moe=moe, slack=True, fp8=fp8,
                           native=native, split=kind) for kind, runs in zip((True, False), split) if runs]
    return max(got, key=lambda t: t[0])


class _Skipped(Exception):
    """The transient probes not run (``estimate(..., transients=False)``)."""


def _excess(settings, cfg, given, schedule, r: int, ends: dict, chunks: tuple, routing, rank: int | None,
            exchange: int, transients: bool, device=None) -> tuple[int, int, int, bool]:
    """(what pipeline rank ``r``'s peak holds beyond its activations, logits and W inputs (``schedule``'s split
    backwards, :func:`_transient`), one rematerialised chunk's
    activations, what ep rank ``rank``'s rows add to the two over balanced routing, whether the transients were
    probed). Under a routing histogram the rematerialised chunk is priced at the rank's rows
    (:func:`recompute_bytes`) and so is its local experts' backward (:func:`_experts_skew`), each added to the
    balanced probe's peak where it would set it (the chunk's: whole, an upper bound), and offloaded layers brought
    back (:func:`reload_bytes`). Without the probes (``transients`` False, or logs that do not align): the
    rematerialised chunk and the layers brought back alone."""
    layers, moe = chunks
    plain_rec = recompute_bytes(settings, cfg)
    stage = [] if rank is None else [s for c in ends for s in routing[(r, c)]]
    rec = plain_rec if rank is None else recompute_bytes(settings, cfg, (stage, rank))
    back = round(max(reload_bytes(settings, cfg, layers[(r, c)], moe[(r, c)]) for c in ends))
    try:
        if not transients:
            raise _Skipped
        fp8, native = chunk_linears(settings, cfg, r), settings.fp8 is not None and native_gemm(settings.fp8, device)
        split = split_chunks(schedule, r)
        probes = [_transient(settings, cfg, layers[(r, c)], ends[c], moe[(r, c)] > 0, fp8.get(c), native, split[c])
                  for c in ends]
        plain = max(t for t, _ in probes)
        skew = rec - plain_rec
        if rank is not None:
            skew += max(t + _experts_skew(settings, cfg, routing[(r, c)], rank, room)
                        for c, (t, room) in zip(ends, probes)) - plain
        return plain + skew + block_dropout_bytes(settings, given) + exchange + back, rec, skew, True
    except _Skipped:
        pass
    except RuntimeError as e:  # the probes' logs do not align: the saved tensors and one rematerialised chunk
        log.warning("%s; the memory estimate leaves backward's transients out", e)
    return rec + back, rec, rec - plain_rec, False


def estimate(settings, transients: bool = True, load=None, device=None) -> list[StageMemory]:
    """Every pipeline stage's :class:`StageMemory` for ``settings``; ``transients=False`` leaves backward's own
    tensors out (their probes take seconds per new tp / recompute setting at 70B: a cluster search screens
    layouts without them and prices with them those it may list, :func:`omnitron.plan.recommend._bounded`),
    counting one rematerialised chunk as the probes' failure path does (not a bound of the full estimate: the
    probes' excess may be less than that chunk).
    ``load``: a routing histogram (:class:`omnitron.plan.routing.ExpertLoad`): each stage on its busiest ep rank.
    ``device``: the :class:`~omnitron.plan.profile.DeviceProfile` run on (whether FP8 GEMMs are native there:
    :func:`.fp8_passes.native_gemm`); None: this process's backend."""
    from omnitron.plan.moe_overlap import pair_extras, planned_schedule

    check_family(settings)
    cp_comm.check_one_type(settings.parallel)
    given, pc = model_config(settings), settings.parallel
    cfg = priced_config(settings, given)  # attention dropout on cp's block kernels: probed without it
    cfg = experts_as_run(settings, cfg)  # FP8 experts: each its own GEMMs, --moe-grouped-gemm or not
    pp, vp = pc.pipeline_model_parallel_size, pc.virtual_pipeline_model_parallel_size or 1
    schedule = planned_schedule(settings)  # combined pairs under --overlap-moe-expert-parallel-comm
    layers, moe = chunk_layers(settings, cfg), chunk_moe_layers(settings, cfg)
    routing = moe_routing(settings, cfg, load) if load is not None and cfg.num_experts else None
    out = []
    for r in range(pp):
        ends = {c: (schedule.stage(r, c) == 0, schedule.stage(r, c) == schedule.num_stages - 1) for c in range(vp)}
        has_moe = any(moe[(r, c)] for c in range(vp))
        ranks = range(pc.expert_model_parallel_size) if routing is not None and has_moe else [None]
        less = saved_less(settings, cfg, r)
        w = _w_inputs(settings, cfg, schedule, r, ends, (layers, moe)) if transients else {}
        fp8, native = chunk_linears(settings, cfg, r), settings.fp8 is not None and native_gemm(settings.fp8, device)
        pairs = pair_extras(schedule, r, lambda c: _pair_log(
            settings, cfg, min(layers[(r, c)], 2 * _unit(cfg)), ends[c], moe[(r, c)] > 0, fp8.get(c), native)) \
            if transients else {}
        each = {k: _held(settings, cfg, schedule, r, ends, (layers, moe), routing, k,
                         less if k is None else saved_less(settings, cfg, r, (routing, k)), w, pairs) for k in ranks}
        stage = [s for c in ends for s in routing[(r, c)]] if routing is not None else []
        rank = max(each, key=lambda k: each[k][0] + each[k][4] + transients * each[k][3] +
                   (recompute_bytes(settings, cfg, (stage, k)) if k is not None else 0))
        act_peak, most, logit_peak, exchange, w_peak = each[rank]
        st = state_bytes(settings, cfg, r)
        excess, rec, skew, probed = _excess(settings, cfg, given, schedule, r, ends, (layers, moe), routing, rank,
                                            exchange, transients, device)
        rec = min(rec, excess)  # what of the excess is rematerialised activations
        m = StageMemory(r, sum(layers[(r, c)] for c in range(vp)), st.params, st.grads, st.optimizer,
                        round(act_peak), round(logit_peak), fp8_bytes(settings, cfg, r), rec, most, excess - rec,
                        round(send_in_flight(schedule, r, output_bytes(settings, cfg, False))), w_inputs=round(w_peak),
                        step=st.step, probed=probed)
        if rank is not None:  # the same stage at balanced routing, for the comparison printed beside it
            plain = _held(settings, cfg, schedule, r, ends, (layers, moe), None, None, less, w, pairs)
            m = replace(m, ep_rank=rank, balanced=m.total - round(act_peak + w_peak - plain[0] - plain[4])
                        - probed * (exchange - plain[3]) - skew)
        out.append(m)
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:9.3f}" if n >= 2**27 else f"{n / 2**20:8.2f}M"


def memory_table(settings) -> str:
    """:func:`format_table` of :func:`estimate`: what ``--log-memory-estimate`` logs at the start of training. A
    layout the planner does not price (a per-layer --cp-comm-type, a model family it does not model) raises its
    one-line ConfigError; the training loop logs it and trains on."""
    return format_table(estimate(settings))


def format_table(stages: list[StageMemory]) -> str:
    """One row per stage (GiB; values under 128 MiB in MiB, suffixed M) and the largest rank."""
    head = f"{'stage':>5} {'layers':>6} {'in-flight':>9} {'params':>9} {'grads':>9} {'optimizer':>9} " \
           f"{'activations':>11} {'logits':>9} {'fp8':>9} {'recompute':>9} {'transient':>9} {'boundary':>9} " \
           f"{'w-inputs':>9} {'opt-step':>9} {'total':>9}"
    rows = [head] + [f"{s.stage:>5} {s.layers:>6} {s.inflight:>9} {_gib(s.params)} {_gib(s.grads)} {_gib(s.optimizer)}"
                     f"   {_gib(s.activations)} {_gib(s.logits)} {_gib(s.fp8)} {_gib(s.recompute)} {_gib(s.transient)}"
                     f" {_gib(s.boundary)} {_gib(s.w_inputs)} {_gib(s.step)} {_gib(s.total)}"
                     for s in stages]
    top = max(stages, key=lambda s: s.total)
    rows.append(f"largest rank: stage {top.stage}, {top.total / 2**30:.3f} GiB ({top.total} bytes)")
    routed = [s for s in stages if s.ep_rank is not None]
    if routed:
        rows.append("routing histogram: each stage priced on its busiest ep rank (" + "; ".join(
            f"stage {s.stage}: ep rank {s.ep_rank}, {s.total / 2**30:.3f} GiB, balanced {s.balanced / 2**30:.3f} GiB"
            for s in routed) + ")")
    return "\n".join(rows)
