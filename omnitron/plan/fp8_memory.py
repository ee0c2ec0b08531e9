"""What ``--fp8-format`` holds on one pipeline rank beyond the wide model: the ``fp8`` term of
:mod:`omnitron.plan.memory`, counted from the code path training runs (eager, ``enable_fp8(..., per_step=True)`` in
``core/training/components.py``; :mod:`omnitron.core.precision.fp8.linear`).

**Which linears.** Those :func:`~omnitron.core.precision.fp8.enable.enable_fp8` converts: every linear of the rank's
chunks (:func:`~omnitron.core.precision.fp8.enable.linear_modules`, tp-local shapes) but the output layer
(``DEFAULT_EXCLUDE``) and the layers ``--first-last-layers-bf16`` keeps wide
(:func:`omnitron.plan.stage_layers.wide_layers`, the speed model's selection); a wide layer holds nothing of FP8.

**Per FP8 linear, weight ``[out, in]``** (held the whole step: ``FP8Linear.quantize_weight`` caches the weight's
FP8 form until an optimizer update changes it, and every micro-batch's forward saves the cached tensors):

- per-tensor recipes (``delayed``, ``tensorwise``): ``(q, q.t() contiguous, scale_inv)``: 2 bytes an element
  (:data:`PER_TENSOR_WEIGHT`) and, tensorwise, a 4-byte scale (delayed: the weight role's own ``scale_inv``, in its
  state; :func:`~omnitron.plan.fp8_passes.own_scale`);
- ``blockwise``: ``(q, scale_inv)``: 1 byte an element and one fp32 scale per 128x128 block
  (``ceil(out/128) x ceil(in/128)``, :data:`omnitron.core.precision.fp8.config.BLOCK_WEIGHT`);
- ``delayed`` also keeps per role (input, weight, output gradient) a ``DelayedScaling``: its amax history
  (``--fp8-amax-history-len`` fp32) and three fp32 scalars (scale, its inverse, the step's amax)
  (:func:`delayed_state`, :func:`fp8_state_bytes`; made with the model, updated in place at each step's end).

Delayed is priced as training runs it after its first step (``per_step``, the reducer primed): every cast uses its
role's scale in force and returns that role's ``scale_inv``, nothing new (:mod:`omnitron.plan.fp8_passes`). Its
first step quantizes as tensorwise does (no history yet), a few 4-byte scalars more.

**Saved activations** (:func:`saved_less`, taken off the activation term by :mod:`omnitron.plan.memory`). The block-wise
forward saves its input wide (the tensor ``F.linear`` saves, which the activation probes measure) and no activation
scale: nothing changes. The per-tensor forward saves ``(qx_t, sx, qw_t, sw)``: the input's FP8 transpose (1 byte an
element) and its fp32 scale (tensorwise: a new one; delayed: the input role's, in the weight term) where ``F.linear``
saved the input (the cached weight's are in the weight term). The probes
run the wide model, which saves an input once however many linears read it; FP8 linears each save their own copy. So per
FP8 layer and micro-batch, for each group of its linears reading one input tensor (:func:`input_groups`: one hooked
forward of a one-layer probe; in a GPT layer qkv, proj, fc1 and fc2 each read their own),
``(e - n) x in x tokens - 4 n`` bytes less (``e`` the dtype's bytes, ``n`` the group's linears; delayed: no
``4 n``), or ``- n x in x tokens - 4 n`` where another op saves that tensor too, so the wide one stays (the same
probe's saved-tensor hook: core attention's output, the projection's input, which ``scaled_dot_product_attention``'s
fused paths save; :func:`kept_inputs`). An MoE layer's experts: :func:`omnitron.plan.fp8_moe.layer_less` (their rows
at the plan's routing, balanced or a histogram's on each ep rank). Tokens are the micro-batch's whole sequence (over
cp): a row-parallel linear's input is not split by sequence, and under sequence parallelism an FP8 column-parallel
linear saves the input it all-gathered, the whole sequence, where the wide one keeps the shard
(:mod:`omnitron.core.parallel.tensor.gather_linear`, since 2026-12-05: the wide model's input of such a group is the
shard, ``e / tp`` bytes a token and element); a replicated linear (a one-rank group: multi-latent attention's
down-projections) reads the sequence shard, ``1 / tp`` of the tokens (:func:`_reads`, :func:`_group_less`). Full
recomputation: a recomputed layer keeps its input only (``recompute_layers``), nothing to take off; selective
recomputation reruns core attention only, the linears' inputs stay saved.

**Transients** (:func:`replay_fp8`, in the ``transient`` term of :mod:`omnitron.plan.memory`). The transient probes run
the wide model and log a marker at each decoder linear's forward (with the event that created its input), at the end of
its module's forward, at the arrival of its output's gradient and at the end of its own backward
(:func:`omnitron.plan.transients._mark_linears`; an MoE layer's routed experts through their GEMM seam); the replayed
log adds, at a linear's forward and backward markers, what its FP8 pass creates (:func:`linear_peak`, at the rows it
sees: an expert's, :func:`omnitron.plan.fp8_moe.probe_experts`), holds its FP8 copy from its forward to its backward's
end (a split backward's B, which runs dx and the bias gradient only: to its W), and takes its wide input off from its
module's end (until then the wide input, the module's argument, is live beside the FP8 copy) until the wide log
frees it (once a storage; never where another op keeps it). Per pass (``t`` tokens, weight ``[out, in]``;
:mod:`omnitron.plan.fp8_passes`): backward, the output gradient's FP8 form and transpose and, tensorwise, scale
(``2 t out + 4``), then dx, the FP8 form freed, the bias gradient, then dw; emulated, each GEMM's fp32 copies
of its operands and its fp32 product, and the reference cast's fp32 copy
(:func:`~omnitron.plan.fp8_passes.per_tensor_backward`); delayed, its cast's amax and step-amax update (4 bytes each;
natively the Triton cast's per-tile amaxes: :func:`~omnitron.plan.fp8_passes.per_tensor_cast`); block-wise, the gradient
quantized twice and the saved wide input once in 128-tiles, each with an fp32 copy, and the emulated GEMMs' fp32
operands and products (:func:`~omnitron.plan.fp8_passes.blockwise_backward`); the forwards likewise. Native or emulated
as the engine's provider decides, from the device profile (:func:`~omnitron.plan.fp8_passes.native_gemm`): per-tensor
GEMMs native where it has an ``fp8`` peak, block-wise where ``[fp8] block_gemm`` is ``native``; the block-wise
quantizations are torch code with an fp32 copy on every device.

Not modelled: an input that is a view of a wider tensor, whose whole storage the wide linear keeps (multi-latent
attention without ``--qk-layernorm``: the key-value up-projection reads a slice of the down-projection's output; its
saving priced at the slice's width: the estimate over-counts the rest of that storage); the rematerialised chunk of full
recomputation without the transient probes (``estimate(..., transients=False)``: its FP8 linears' inputs priced wide, an
over-count of one chunk's saving; the probes' replay holds them as FP8), multi-token prediction's depths and their
``eh_proj`` (an MoE depth's experts too), ``--torch-compile``'s saved tensors (inductor decides what a compiled layer
saves; its weights' FP8 form is held for the step as eager's is: ``core/precision/fp8/static_weights.py``), the delayed
reducer's step-end temporaries (``push_packed``'s stacked histories, a few ``[roles, history]`` fp32 tensors, after the
backward has freed the activations), ``--fp8-impl torchao``, which op keeps a linear's input on another device (the
probe's attention path is this CPU's); in the transients, block-wise tiles that are not whole (a ragged dimension pads a
copy and expands the scales), ``_scaled_mm``'s alignment padding (a dimension not a multiple of 16), the experts of
the layers ``--first-last-layers-bf16`` keeps wide under ``--moe-grouped-gemm`` (they run the grouped GEMM, which
stacks the local experts' weights in its forward and again in its backward, but are priced as each expert's own
GEMMs: FP8 experts run those, so the plan probes every layer without the grouped GEMM,
:func:`omnitron.plan.fp8_moe.experts_as_run`), the experts of a probe with fewer experts than the model (16 for
more that divide by it: each expert's rows and passes larger, an upper bound), and a wide input a module keeps past
its own return.
Multi-token prediction's layers are counted in FP8 under ``--first-last-layers-bf16`` too, as the engine runs them
(Megatron's ``layer_no=-1``: never kept wide).
"""
from __future__ import annotations

import fnmatch
import math

import torch

from omnitron.core.parallel.pipeline.schedules import schedule_style
from omnitron.plan.fp8_passes import (SCALE, blockwise_backward, blockwise_forward, blockwise_wgrad, gemm_bias,
                                     own_scale, per_tensor_backward, per_tensor_forward, per_tensor_wgrad)
from omnitron.plan.stage_layers import wide_layers
from omnitron.plan.state import skeleton
from omnitron.plan.transients import DECODER as _DECODER, LINEAR, W_START, probe_recomputed

PER_TENSOR_WEIGHT = 2
"""Bytes per weight element a per-tensor recipe caches: the FP8 weight and its contiguous transpose."""
SAVED_INPUT = 1
"""Bytes per element of what a per-tensor FP8 linear saves of its input: its FP8 transpose (``qx_t``)."""
DELAYED_SCALARS = 3
"""float32 scalars of one role's ``DelayedScaling`` beside its history: scale, scale_inv, step_amax."""


def fp8_linears(settings, cfg, pp_rank: int) -> list[tuple[int, int]]:
    """``(out, in)`` weight shapes of the linears that run in FP8 on pipeline rank ``pp_rank`` (module docstring)."""
    from omnitron.core.precision.fp8.enable import DEFAULT_EXCLUDE, linear_modules

    if settings.fp8 is None:
        return []
    chunks = skeleton(cfg, settings.parallel, pp_rank, schedule_style(settings.training.pipeline_schedule))
    wide = wide_layers(settings, cfg)
    out = []
    for c, chunk in enumerate(chunks):
        named = [(name, m, _DECODER.search(name)) for name, m in linear_modules(chunk)]
        first = min((int(d.group(1)) for _, _, d in named if d), default=0)
        for name, m, d in named:
            if any(fnmatch.fnmatch(name, p) for p in DEFAULT_EXCLUDE):
                continue
            if d and wide[(pp_rank, c)][int(d.group(1)) - first]:
                continue
            out.append(tuple(m.weight.shape))
    return out


def delayed_state(fp8) -> int:
    """Bytes of one FP8 linear's delayed-scaling state (0 for the other recipes): per role (input, weight, output
    gradient) its amax history and three fp32 scalars. Made at ``enable_fp8`` and updated in place at each step's end
    (``push_packed``), so it exists before any step (the benchmark's step peak counts it 0)."""
    return 3 * SCALE * (fp8.fp8_amax_history_len + DELAYED_SCALARS) if fp8.fp8_recipe == "delayed" else 0


def linear_bytes(fp8, out: int, inp: int) -> int:
    """What one FP8 linear of weight ``[out, inp]`` holds under recipe ``fp8`` (an ``FP8Config``)."""
    if fp8.fp8_recipe == "blockwise":
        return out * inp + SCALE * math.ceil(out / 128) * math.ceil(inp / 128)
    return PER_TENSOR_WEIGHT * out * inp + own_scale(fp8) + delayed_state(fp8)


def fp8_bytes(settings, cfg, pp_rank: int) -> int:
    """The ``fp8`` term of pipeline rank ``pp_rank``: 0 without ``--fp8-format``."""
    return sum(linear_bytes(settings.fp8, o, i) for o, i in fp8_linears(settings, cfg, pp_rank))


def fp8_state_bytes(settings, cfg, pp_rank: int) -> int:
    """What of :func:`fp8_bytes` is delayed-scaling state (:func:`delayed_state`): 0 for the other recipes."""
    if settings.fp8 is None:
        return 0
    return delayed_state(settings.fp8) * len(fp8_linears(settings, cfg, pp_rank))


_GROUPS: dict[str, tuple] = {}


def input_groups(cfg) -> tuple[tuple[tuple[str, ...], bool], ...]:
    """One dense decoder layer's linears (names in the layer) grouped by the input tensor they read, each group with
    whether an op other than a linear saves that tensor for backward too (then the wide model keeps it whatever the
    linears do: core attention's output, which ``scaled_dot_product_attention``'s flash and memory-efficient paths
    save, is the projection's input). From one forward of a one-layer probe at the activation probes' widths
    (:func:`omnitron.plan.activations.probe_config`, one process: no sequence parallelism, training mode), a pre-hook
    on each linear keeping its input (so no later tensor reuses the storage) and a saved-tensor hook noting what is
    saved outside the linears' calls; cached per config."""
    from dataclasses import replace

    from omnitron.core.models.gpt import GPTModel
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.precision.fp8.enable import linear_modules
    from omnitron.plan.activations import probe_config

    key = repr(cfg)
    if key not in _GROUPS:
        s = 16
        probe = replace(probe_config(cfg, 1)[0], num_layers=1, seq_length=s, max_position_embeddings=s,
                        mtp_num_layers=None, recompute_granularity=None, recompute_method=None,
                        recompute_num_layers=None)
        torch.manual_seed(0)
        model = GPTModel(probe, ParallelGroups.single())
        seen: list[tuple[str, torch.Tensor]] = []
        inside: list[str] = []  # the decoder linear whose call runs now
        kept: set[int] = set()  # storages saved outside those calls

        def enter(name, x):
            seen.append((name, x))
            inside.append(name)

        def leave(*_):
            inside.pop()  # (a forward hook's return value would replace the output)

        def pack(t):
            if not inside:
                kept.add(t.untyped_storage().data_ptr())
            return t

        named = [(name[d.end():], m) for name, m in linear_modules(model) for d in [_DECODER.search(name)] if d]
        hooks = [h for n, m in named for h in (m.register_forward_pre_hook(lambda mod, args, n=n: enter(n, args[0])),
                                               m.register_forward_hook(leave))]
        try:
            tokens = torch.randint(0, probe.vocab_size, (1, s))
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                model(tokens=tokens, position_ids=torch.arange(s)[None])
        finally:
            for h in hooks:
                h.remove()
        groups: dict[int, list[str]] = {}
        for n, x in seen:
            groups.setdefault(x.untyped_storage().data_ptr(), []).append(n)
        _GROUPS[key] = tuple((tuple(g), ptr in kept) for ptr, g in groups.items())
    return _GROUPS[key]


def kept_inputs(cfg) -> set[str]:
    """Names (in the layer) of the dense decoder linears whose wide input stays saved whatever their own FP8 saves
    (:func:`input_groups`): another op saves it too, or it is the input of an earlier linear of its group (the one
    that stands for the group's wide input; multi-latent attention's two down-projections read one)."""
    return {n for names, kept in input_groups(cfg) for i, n in enumerate(names) if kept or i}


def _reads(settings, m) -> tuple[bool, int]:
    """(whether linear ``m`` all-gathers its input, the divisor of the micro-batch's tokens its GEMM reads) under
    the layout: with sequence parallelism over tp > 1 a column-parallel linear all-gathers its input shard (its FP8
    GEMM saves a copy of its own, the whole sequence) and a replicated one (a one-rank group: multi-latent attention's
    down-projections) reads the sequence shard; every other linear the whole sequence."""
    from omnitron.core.parallel.tensor.layers import ColumnParallelLinear

    pc = settings.parallel
    tp = pc.tensor_model_parallel_size
    if not (pc.sequence_parallel and tp > 1 and isinstance(m, ColumnParallelLinear)):
        return False, 1
    # the plan's skeleton is built without the layout's SP flag: every column-parallel linear of a tp group gathers
    return (True, 1) if m.group.size > 1 else (False, tp)


def saved_less(settings, cfg, pp_rank: int, routed=None) -> dict[int, float]:
    """Per chunk of pipeline rank ``pp_rank``: the bytes one micro-batch's FP8 layers save less than the wide model
    the activation probes measure (module docstring, "Saved activations"), an MoE layer's experts' included
    (:func:`omnitron.plan.fp8_moe.layer_less`) at balanced routing or, with ``routed`` (``(routing, ep rank)``,
    ``routing`` as :func:`omnitron.plan.memory.moe_routing`'s), each MoE layer at its histogram rows on that ep rank's
    experts; empty without a per-tensor recipe."""
    from omnitron.core.models.gpt.config import recompute_layers
    from omnitron.core.precision.fp8.enable import DEFAULT_EXCLUDE, linear_modules
    from omnitron.plan.fp8_moe import layer_less

    if settings.fp8 is None or not settings.fp8.per_tensor:
        return {}
    pc = settings.parallel
    tokens = cfg.seq_length // pc.context_parallel_size * settings.training.micro_batch_size
    elem, groups, scale = cfg.params_dtype.itemsize, input_groups(cfg), own_scale(settings.fp8)
    chunks = skeleton(cfg, pc, pp_rank, schedule_style(settings.training.pipeline_schedule))
    wide = wide_layers(settings, cfg)
    out = {}
    for c, chunk in enumerate(chunks):
        layers: dict[int, dict[str, tuple]] = {}
        for name, m in linear_modules(chunk):
            d = _DECODER.search(name)
            if d and not any(fnmatch.fnmatch(name, p) for p in DEFAULT_EXCLUDE):
                layers.setdefault(int(d.group(1)), {})[name[d.end():]] = (m.weight.shape[1], *_reads(settings, m))
        first = min(layers, default=0)
        recomputed = {i for run in recompute_layers(cfg, len(wide[(pp_rank, c)])) for i in run}
        moe = [i for i in sorted(layers) if any("experts" in n for n in layers[i])]
        less = 0.0
        for i, inputs in layers.items():
            if wide[(pp_rank, c)][i - first] or i - first in recomputed:
                continue
            if i in moe:
                less += _experts_less(settings, cfg, layer_less, None if routed is None else
                                      (routed[0][(pp_rank, c)][moe.index(i)], routed[1]))
            for g, kept in groups:
                less += _group_less([inputs[n] for n in g if n in inputs], 0 if kept else elem, tokens, scale,
                                   pc.tensor_model_parallel_size)
        out[c] = less
    return out


def _group_less(mine: list, was: int, tokens: int, scale: int, tp: int) -> float:
    """What the FP8 linears ``mine`` (``(in, gathers, split)`` each, :func:`_reads`) reading one input tensor save less
    than the wide model, which saves that input once (``was`` bytes an element; 0 where another op keeps it): the
    whole sequence, or its shard under SP (when a member reads the shard: a replicated linear, or one that all-gathers
    it, whose wide GEMM saves the shard: :mod:`omnitron.core.parallel.tensor.gather_linear`); each FP8 linear saves its
    own 1-byte copy of what its GEMM reads (an all-gathering one: the whole sequence) and a scale."""
    if not mine:
        return 0.0
    k = mine[0][0]
    wide = was * k * tokens / (tp if any(gathers or split > 1 for _, gathers, split in mine) else 1)
    return wide - sum(SAVED_INPUT * k * tokens / split for k, _, split in mine) - scale * len(mine)


def _experts_less(settings, cfg, fn, routed) -> float:
    """``fn`` (:func:`omnitron.plan.fp8_moe.layer_less`) of one MoE layer: balanced (``routed`` None), or the mean
    over the histogram rows of ``routed`` (``(rows, ep rank)``) on that rank's experts."""
    pc = settings.parallel
    args = (settings.fp8, cfg, cfg.seq_length // pc.context_parallel_size, settings.training.micro_batch_size,
            pc.tensor_model_parallel_size, pc.sequence_parallel, pc.expert_model_parallel_size, pc.etp)
    if routed is None:
        return fn(*args)
    rows, rank = routed
    return sum(fn(*args, share, rank) for share in rows) / len(rows)


def chunk_linears(settings, cfg, pp_rank: int) -> dict[int, dict[tuple[int, str], tuple]]:
    """Per chunk of pipeline rank ``pp_rank``: ``{(layer counted from the chunk's top, name in the layer): (out, in,
    saved less, saved, tokens, bias)}`` of its FP8 decoder linears (tp-local weight shapes) as the transient probe runs
    them. ``saved less``: what its 1-byte saved input takes off the wide activations where its layer keeps them
    (per-tensor: ``(e - 1) x in x tokens - 4``, the :func:`saved_less` of a linear reading its own input; block-wise:
    0); ``saved``: the bytes of that saved input and its scale (``in x tokens + 4``, delayed without the 4; block-wise:
    0, it saves the wide input); ``tokens``: the rows its GEMMs see (the micro-batch's whole sequence over cp);
    ``bias``: whether its GEMM gets one (``fp8_passes.gemm_bias``; added after the FP8 GEMM, its gradient made in the
    backward: :func:`~.fp8_passes.bias_add`, :func:`~.fp8_passes.bias_grad`). A chunk
    with MoE layers is probed with every layer MoE: each of its FP8 layers gets the probe's experts'
    (:func:`omnitron.plan.fp8_moe.probe_experts`). Empty without ``--fp8-format``."""
    from omnitron.core.precision.fp8.enable import DEFAULT_EXCLUDE, linear_modules
    from omnitron.plan.fp8_moe import probe_experts

    if settings.fp8 is None:
        return {}
    pc = settings.parallel
    t = cfg.seq_length // pc.context_parallel_size * settings.training.micro_batch_size
    e = cfg.params_dtype.itemsize
    chunks = skeleton(cfg, pc, pp_rank, schedule_style(settings.training.pipeline_schedule))
    wide, kept = wide_layers(settings, cfg), kept_inputs(cfg) if settings.fp8.per_tensor else set()
    out = {}
    for c, chunk in enumerate(chunks):
        named = [(name, m, d) for name, m in linear_modules(chunk) for d in [_DECODER.search(name)]
                 if d and not any(fnmatch.fnmatch(name, p) for p in DEFAULT_EXCLUDE)]
        first = min((int(d.group(1)) for _, _, d in named), default=0)
        flags = wide[(pp_rank, c)]
        moe = next((chunk.get_submodule(name[:d.end() - 1]) for name, _, d in named if "experts" in name[d.end():]),
                   None)
        experts = probe_experts(settings, cfg, moe) if moe is not None else {}
        out[c] = {(len(flags) - 1 - i, n): v for i, kept_wide in enumerate(flags) if not kept_wide
                  for n, v in experts.items()}
        for name, m, d in named:
            i = int(d.group(1)) - first
            if flags[i] or "experts" in name[d.end():]:
                continue
            o, k = m.weight.shape
            saved = SAVED_INPUT * k * t + own_scale(settings.fp8) if settings.fp8.per_tensor else 0
            was = 0 if name[d.end():] in kept else e * k * t  # another op keeps the input: the FP8 copy is extra
            has_bias = gemm_bias(m, name, cfg)
            out[c][(len(flags) - 1 - i, name[d.end():])] = (o, k, was - saved if saved else 0, saved, t, has_bias)
    return out


def linear_peak(settings, cfg, kind: str, out: int, inp: int, native: bool, t: float | None = None,
                bias: bool = False) -> float:
    """Peak bytes one FP8 linear of weight ``[out, inp]`` (with a ``bias`` or not) creates in its ``kind`` pass
    (``forward``, ``backward``; of a split backward ``input``, B's half, or ``weight``, W's) for ``t`` rows (None:
    one micro-batch of ``settings``, the whole sequence over cp) in the model's dtype."""
    if t is None:
        t = cfg.seq_length // settings.parallel.context_parallel_size * settings.training.micro_batch_size
    e = cfg.params_dtype.itemsize
    if kind == "weight":
        return (per_tensor_wgrad if settings.fp8.per_tensor else blockwise_wgrad)(t, out, inp, e, native)
    deferred = kind == "input"
    if settings.fp8.per_tensor:
        delayed = settings.fp8.fp8_recipe == "delayed"
        return per_tensor_forward(t, out, inp, e, native, delayed, bias) if kind == "forward" else \
            per_tensor_backward(t, out, inp, e, e, native, delayed, bias, deferred)
    return blockwise_forward(t, out, inp, e, native, bias) if kind == "forward" else \
        blockwise_backward(t, out, inp, e, e, native, bias, deferred)


def fp8_replay_peak(settings, cfg, events: list, sizes: list[float], linears: dict, native: bool,
                    layers: int) -> float:
    """Peak of a wide transient probe's replayed log as the chunk's FP8 linears run it, plus the probed layers' 1-byte
    savings, which the activation term takes off the whole chunk (:func:`replay_fp8`)."""
    return sum(replay_fp8(settings, cfg, events, sizes, linears, native, layers))


def replay_fp8(settings, cfg, events: list, sizes: list[float], linears: dict, native: bool,
               layers: int, record: list | None = None) -> tuple[float, float]:
    """(peak of a wide transient probe's replayed log (:func:`omnitron.plan.transients.scaled_log`, with
    :func:`~omnitron.plan.transients.marker` events) as the chunk's FP8 linears (``linears``: :func:`chunk_linears`'s
    entry for it) run it, the probed layers' 1-byte savings (``saved less``) that the activation term takes off the
    whole chunk). A linear's FP8 saved input is held from its forward to the end of its own backward (of a split
    backward whose B defers its weight gradient, to its ``weight`` marker: W's GEMM reads it). Its wide input,
    which the wide log holds until the last linear saving it has run its backward, is taken off from the end of the
    forward of the module holding the linear (until then it is that module's argument or local) to that free in the
    wide log, once a storage, unless another op keeps it (``saved less + saved`` 0: :func:`kept_inputs`). At a
    linear's ``forward``, ``backward`` and ``weight`` markers, what its FP8 pass creates (:func:`linear_peak`; B's
    half at ``backward`` where W makes the weight gradient) is added.
    ``layers``: the probe's; a layer it recomputes in full (:func:`~omnitron.plan.transients.probe_recomputed`) holds
    its FP8 saved inputs from its rerun forward, and the activation term takes nothing off for it. ``record``: a list
    this appends the replay to as ``(name, bytes)`` steps of the live bytes, in order (the wide log's events and
    markers under their names, a free as ``"free"`` with its signed change; :func:`fp8_log`)."""
    recomputed = probe_recomputed(cfg, layers)
    note = record.append if record is not None else (lambda step: None)
    stash, freed = split_operands(settings, cfg, events, sizes, linears)
    live = held = total = best = 0.0
    seen, pending, holding, alive, credits, stashed = {}, {}, set(), set(), {}, set()
    for i, (op, n) in enumerate(events):
        if op is None:
            credit = credits.pop(n, 0.0)
            live -= sizes[n]
            alive.discard(n)
            held -= credit  # the wide input freed in the wide log: nothing more to take off
            note(("free", credit - sizes[n]))
            continue
        if op == W_START:  # B has ended: the output gradients only FP8 linears kept give way to their stand-ins
            held -= cfg.params_dtype.itemsize * len(stashed)  # (one element each, :func:`w_operands`)
            note(("fp8 stand-ins", cfg.params_dtype.itemsize * len(stashed)))
            for source in freed:
                if source in alive and source not in credits:
                    credits[source] = sizes[source]
                    held += sizes[source]
                    note(("fp8 gradient freed", -sizes[source]))
        if not op.startswith(LINEAR):
            live += sizes[i]
            alive.add(i)
            best = max(best, live - held)
            note((op, sizes[i]))
            continue
        kind, layer, name, source = op[len(LINEAR):-1].split(" ")
        key = (int(layer), name)
        if key not in linears:
            continue
        o, k, less, saved, t, *bias = linears[key]
        if kind in ("forward", "backward", "weight"):  # B of a split backward: its weight-gradient GEMM in W
            priced = "input" if kind == "backward" and key in stash else kind
            has_bias = bool(bias and bias[0])
            own = linear_peak(settings, cfg, priced, o, k, native, t, has_bias)
            best = max(best, live - held + own)
            note(("fp8 " + kind, own))
            note(("fp8 " + kind + " end", -own))
        if kind == "forward":
            seen[key] = seen.get(key, 0) + 1
            if seen[key] == (2 if key[0] in recomputed else 1):  # kept: the forward; recomputed: the rerun
                pending[key] = None if source == "-" else int(source)
                held -= saved  # the saved FP8 input beside the wide one
                note(("fp8 saved input", saved))
                total += 0 if key[0] in recomputed else less
        elif kind == "done" and key in pending:  # the wide input, an argument or local of its module, is freed now
            source = pending.pop(key)
            holding.add(key)
            if less + saved > 0 and source in alive and source not in credits:
                credits[source] = sizes[source]
                held += sizes[source]
                note(("wide input off", -sizes[source]))
        elif kind == ("weight" if key in stash else "end") and key in holding:  # W's GEMM reads it: kept till W
            holding.discard(key)
            held += saved
            note(("fp8 saved input freed", -saved))
        if kind == "end" and key in stash and key not in stashed:  # B stashed W's operands beside the kept gradient
            stashed.add(key)
            held -= stash[key] - cfg.params_dtype.itemsize  # the stand-in comes when B has ended
            note(("fp8 w operands", stash[key] - cfg.params_dtype.itemsize))
        elif kind == "weight" and key in stashed:  # W has read them
            stashed.discard(key)
            held += stash[key]
            note(("fp8 w operands freed", -stash[key]))
    return best, total


def fp8_log(settings, cfg, events: list, sizes: list[float], linears: dict, native: bool,
            layers: int) -> tuple[list, list[float]]:
    """A wide transient probe's log as the chunk's FP8 linears run it (:func:`replay_fp8`'s ``record``), in the
    form the plan replays, ``(events, sizes)``: every step a creation of its signed bytes, the wide log's markers
    kept under their names (so :mod:`omnitron.plan.moe_overlap` cuts it where it cuts the wide one)."""
    steps: list = []
    replay_fp8(settings, cfg, events, sizes, linears, native, layers, steps)
    return [(name, i) for i, (name, _) in enumerate(steps)], [float(d) for _, d in steps]


def w_operands(fp8, out: int, t: float, e: int, bias: bool) -> float:
    """What an FP8 linear of weight ``[out, in]`` holds from a split backward's B to its W for ``t`` rows
    (``core/precision/fp8/linear.py``: B quantizes the output gradient once and stashes W's operands): the codes W's
    GEMM reads, ``[out, t]`` at 1 byte, with per-tensor the scale (tensorwise a new one; delayed the role's, in the
    fp8 term) or block-wise one fp32 scale per 1x128 tile along the rows (``BLOCK_ACT``); the bias gradient B already
    made (``out`` elements in the weight's dtype, ``e`` bytes); and the one-element stand-in ``wgrad.py`` keeps in the
    output gradient's place (``e`` bytes)."""
    codes = out * t
    scales = SCALE * out * math.ceil(t / 128) if fp8.fp8_recipe == "blockwise" else own_scale(fp8)
    return codes + scales + (out * e if bias else 0) + e


def split_operands(settings, cfg, events: list, sizes: list[float], linears: dict) -> tuple[dict, list[int]]:
    """(per FP8 linear (``linears``: :func:`chunk_linears`'s entry) whose boundary a split probe's plan keeps a
    gradient at, its :func:`w_operands`; the events creating the output gradients only such linears keep, which
    ``wgrad.py`` swaps for stand-ins once B has ended) from the probe's
    :func:`~omnitron.plan.transients.kept_sources`; empty for an unsplit probe."""
    from omnitron.plan.transients import kept_sources

    e, bias, freed = cfg.params_dtype.itemsize, {}, []
    for source, keepers in kept_sources(events).items():
        mine = [(key, params) for key, params in keepers if key in linears]
        for key, params in mine:
            bias[key] = bias.get(key, False) or params > 1
        if mine and len(mine) == len(keepers):
            freed.append(source)
    stash = {key: w_operands(settings.fp8, linears[key][0], linears[key][4], e, b) for key, b in bias.items()}
    return stash, freed


def fp8_w_inputs(settings, cfg, events: list, sizes: list[float], linears: dict) -> float:
    """:func:`omnitron.plan.transients.w_inputs` of a wide split probe's replayed log as the chunk's FP8 linears
    (``linears``: :func:`chunk_linears`'s entry) hold it after B: an output gradient kept only at FP8 linears'
    boundaries is freed, and each of those linears holds its :func:`w_operands` instead; a gradient another boundary
    keeps too (a norm's, the plan's received gradient) stays whole beside them (:func:`split_operands`). Under full
    recomputation B's rerun keeps each weight boundary's saved tensors for W (``tensor/recompute.py``): a rerun
    per-tensor FP8 linear's are its 1-byte input copy and scale, where the wide log's linear kept its wide input
    (once a group reading one tensor; another op's copy is not kept: its node is no weight boundary)."""
    from omnitron.plan.transients import w_inputs

    stash, freed = split_operands(settings, cfg, events, sizes, linears)
    later = {n for names, _ in input_groups(cfg) for n in names[1:]} if settings.fp8.per_tensor else set()
    e, reran = cfg.params_dtype.itemsize, _reran(events)
    rerun_less = sum((0 if key[1] in later else e * linears[key][1] * linears[key][4]) - linears[key][3]
                     for key in stash if key in reran and linears[key][3])
    return w_inputs(events, sizes) - sum(sizes[s] for s in freed) + sum(stash.values()) - rerun_less


def _reran(events: list) -> set:
    """The linears (keys as in :func:`chunk_linears`) whose forward a probe's log runs twice (full recomputation)."""
    from collections import Counter

    forwards = Counter(tuple(op[len(LINEAR):-1].split(" ")[1:3]) for op, _ in events
                       if op is not None and op.startswith(LINEAR + "forward "))
    return {(int(layer), name) for (layer, name), n in forwards.items() if n > 1}
