"""Peak bytes of one micro-batch's forward and backward through a stage chunk, transients included.

The activation term (:mod:`.activations`) counts what autograd saves; a step's peak is higher because
backward creates tensors of its own while the saved ones are still held: the gradient of the logits,
gradients of activations, each weight's gradient before the data-parallel hook moves it into
``main_grad``, the rematerialised layers of full recomputation, and (tied embeddings on one stage) the
output layer's weight gradient, held until the embedding's half arrives.

Derivation. Run one probe chunk (the tp-local widths divided by ``k = k_heads * k_dim``, as
:func:`.activations.probe_config`) through forward and backward under a dispatch mode that logs every
storage created and freed (:class:`omnitron.kernels.alloc_log.Timeline`). Each logged storage is a product of the run's
dimensions: ``[s, b, w]`` activations, ``[b, heads, s, s]`` scores, ``[w, w]`` weight gradients, ``[s, b, V]`` logits,
so its bytes are ``c * s^a * b^e * kh^p * kd^q * V^v`` with small integer exponents. Six probes (the base,
and each of sequence, batch, head dimension, head count and vocabulary doubled) issue the same
allocations in the same order (checked; a probe with a single head or query group is logged at twice
its heads, as attention takes other paths for one); the ratio of a storage's bytes between the base and each
doubled probe gives its exponent, which scales it to the real layout. Replaying the scaled log gives the
real chunk's peak: exact for every storage that is such a monomial, which all of a dense layer's are.

A chunk of ``n`` layers is probed with ``min(n, 2 u)`` layers (``u`` the recompute chunk, else 1); its
excess over the activation model's own total at that depth is taken to be the same at ``n`` layers: the
peak falls in the top layer's or the head's backward, above every layer's saved tensors.

Not seen: buffers a fused kernel allocates internally (outside the dispatcher), the optimizer step's
temporaries (after backward has freed the activations), communication buffers. A chunk with MoE layers is
probed with every layer MoE at balanced routing (:func:`omnitron.plan.moe_activations.transient_probe`).
"""
from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, replace

import torch

from omnitron.core.parallel.pipeline.wgrad import backward_input
from omnitron.kernels.alloc_log import Timeline, peak
from omnitron.plan import probe_cache
from omnitron.plan.measure import probing

_S0, _B0 = 32, 2


@dataclass(frozen=True)
class Probe:
    """One probe chunk: ``layers`` layers of ``cfg`` (probe widths), holding the embedding (``first``)
    and the head and loss (``last``), run at sequence ``s`` and batch ``b``."""

    cfg: object
    layers: int
    first: bool
    last: bool
    s: int
    b: int
    split: bool = False
    """The backward split as the zero-bubble schedules run it: B (the runtime's
    :func:`~omnitron.core.parallel.pipeline.wgrad.backward_input`) then W, with :data:`FORWARD_END` and
    :data:`W_START` logged between (:func:`w_inputs`)."""


def _chunk(p: Probe):
    """The probe chunk as training builds it (tp 1): a stage of a 1-, 2- or 3-stage skeleton whose other
    stages hold one layer each."""
    from omnitron.core.checkpoint.reshard import Layout, skeleton_chunks

    n, cfg = p.layers, p.cfg
    if p.first and p.last:
        layout, total, key = Layout(pp=1), n, (0, 0)
    elif p.first:
        layout, total, key = Layout(pp=2, first=n, last=1), n + 1, (0, 0)
    elif p.last:
        layout, total, key = Layout(pp=2, first=1, last=n), n + 1, (1, 0)
    else:
        layout, total, key = Layout(pp=3, first=1, last=1), n + 2, (1, 0)
    c = replace(cfg, num_layers=total, seq_length=p.s,
                max_position_embeddings=max(p.s, cfg.max_position_embeddings or p.s),
                recompute_num_layers=min(cfg.recompute_num_layers or 1, n) if cfg.recompute_granularity == "full"
                else cfg.recompute_num_layers)
    torch.manual_seed(0)
    return skeleton_chunks(c, layout)[key].train()


def _main_grads(module) -> None:
    """The data-parallel wrapper's gradient path: each ``.grad`` is added into a buffer made beforehand
    (``main_grad``) and freed by a post-accumulate hook (omnitron.core.parallel.data.ddp)."""
    def hook(param):
        param.main_grad.add_(param.grad)
        param.grad = None

    for param in module.parameters():
        param.main_grad = torch.zeros_like(param, dtype=torch.float32)
        param.register_post_accumulate_grad_hook(hook)


_TIMELINES: dict[str, list[tuple[str | None, int]]] = {}

FORWARD_END = "<forward end>"
"""The marker event (0 bytes) every probe logs when its forward has returned; :data:`W_START` a split probe's when
its B has returned and the input gradient it sends is freed (:func:`w_inputs`)."""
W_START = "<weight gradient start>"


def timeline(p: Probe) -> list[tuple[str | None, int]]:
    """Events of one forward and backward of the probe chunk (after one warm-up pass; cached per probe, in this
    process and on disk between runs: :mod:`omnitron.plan.probe_cache`)."""
    key = repr(p)
    if key not in _TIMELINES:
        events = probe_cache.load(key)
        if events is None:
            events = _timeline(p)
            probe_cache.store(key, events)
        _TIMELINES[key] = events
    return _TIMELINES[key]


EXPERTS = "<experts backward>"
"""The marker event (0 bytes) logged when an MoE layer's local experts start their backward; :data:`EXPERTS_END`
when they end (:func:`experts_windows`); :data:`EXPERTS_FORWARD` and :data:`EXPERTS_FORWARD_END` around their forward.
The four are where expert parallelism's all-to-alls stand (the dispatch before the experts, the combine after
them, and their backwards): where ``--overlap-moe-expert-parallel-comm`` hands over (:mod:`.moe_overlap`)."""
EXPERTS_END = "<experts backward end>"
EXPERTS_FORWARD = "<experts forward>"
EXPERTS_FORWARD_END = "<experts forward end>"


@contextlib.contextmanager
def _mark_experts(tl: Timeline):
    """While active, the MoE layers' ``run_experts`` calls mark their forward's start and end and their backward's
    start and end in ``tl`` (the gradient of their output arrives; that of their input rows leaves)."""
    import omnitron.core.transformer.moe.layer as layer

    real, events = layer.run_experts, tl.events

    def marked(rows, *args, **kwargs):
        _mark(tl, EXPERTS_FORWARD)
        y = real(rows, *args, **kwargs)
        _mark(tl, EXPERTS_FORWARD_END)
        if y.requires_grad and rows.requires_grad:
            y.register_hook(lambda g: events.append((EXPERTS, 0)))
            rows.register_hook(lambda g: events.append((EXPERTS_END, 0)))
        return y

    layer.run_experts = marked
    try:
        yield
    finally:
        layer.run_experts = real


DECODER = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.")
"""A decoder layer's linear's module name; group 1 its layer number."""
ROUTED = re.compile(r"^mlp\.experts\.(\d+)\.linear_fc([12])$")
"""A routed expert's linear's name in its layer (group 1 the expert's index, group 2 which of its two linears)."""
LINEAR = "<linear "
"""Prefix of the marker events the transient probes log at each decoder linear's moments (:func:`marker`)."""


def marker(kind: str, layer: int, name: str, source: int | None = None) -> str:
    """The marker event of linear ``name`` (in its layer) of layer ``layer`` (counted from the chunk's top) at
    ``kind``: ``forward`` (its forward starts; ``source``: the index of the event that created its input's storage,
    None where the log did not see it created), ``done`` (the forward of the module holding it has returned),
    ``backward`` (its output's gradient has arrived), ``end`` (its own backward has ended: the gradient it passes
    to its input has arrived), ``weight`` (a split backward's W starts at its boundary: :func:`_mark_kept`)."""
    return f"{LINEAR}{kind} {layer} {name} {'-' if source is None else source}>"


def probe_recomputed(cfg, layers: int) -> set[int]:
    """The layers (counted from the top) a transient probe of ``layers`` layers recomputes in full
    (:func:`_chunk`'s recompute chunk): they keep their input only, no FP8 saved input."""
    from omnitron.core.models.gpt.config import recompute_layers

    if cfg.recompute_granularity != "full":
        return set()
    probe = replace(cfg, recompute_num_layers=min(cfg.recompute_num_layers or 1, layers))
    return {layers - 1 - i for run in recompute_layers(probe, layers) for i in run}


@contextlib.contextmanager
def _mark_linears(chunk, tl: Timeline):
    """While active, each decoder linear of ``chunk`` (the output layer's not) logs a marker event (0 bytes,
    :func:`marker`) into ``tl`` as its forward starts, as the forward of the module holding it ends (its input, that
    module's argument or local, is freed unless saved), as the gradient of its output arrives (its backward starts)
    and as its own backward has ended, each after logging the storages freed since the last op: the moments an FP8
    linear's own tensors and its 1-byte saved input are priced at (:func:`omnitron.plan.fp8_memory.fp8_replay_peak`).
    Layers are counted from the chunk's top (0: the top one). The linear gets an alias (``view_as``: no storage) of
    its input, whose gradient is its own, complete when its backward ends even where other ops read the input too
    (an MoE layer's shared expert, multi-latent attention's down-projections). Yields ``{id(parameter): key}`` of the
    marked linears' weights and biases (``key``: (layer, name), as in :func:`marker`; :func:`_mark_kept`).

    An MoE layer's routed experts run their linears' GEMMs without calling the modules (``expert_mlp``), so theirs are
    marked by wrapping each one's ``_gemm``; an expert's fc2 input, a local of ``expert_mlp``, is freed when it
    returns (its ``done``), its fc1 input, the dispatched rows, when the layer's ``experts_steps`` has returned."""
    from omnitron.core.precision.fp8.enable import linear_modules
    from omnitron.core.transformer.moe import experts as moe_experts
    from omnitron.core.transformer.moe.layer import MoELayer

    named = [(name, m, d) for name, m in linear_modules(chunk) for d in [DECODER.search(name)] if d]
    top = max((int(d.group(1)) for _, _, d in named), default=0)

    def mark(kind, key, source=None):
        _mark(tl, marker(kind, *key, source))

    def on_grad(t, kind, key):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(lambda g: mark(kind, key))

    def forward(args, key):
        """The marker, and ``args`` with the input replaced by an alias whose gradient marks the end (None: as
        they are)."""
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor):
            mark("forward", key)
            return None
        mark("forward", key, tl._live.get(x.untyped_storage()._cdata, (None, None))[1])
        if not x.requires_grad:
            return None
        alias = x.view_as(x)
        on_grad(alias, "end", key)
        return (alias, *args[1:])

    def gemm(real, key):
        def marked(x, weight, bias=None):
            x = (forward((x,), key) or (x,))[0]
            y = real(x, weight, bias)
            on_grad(y, "backward", key)
            return y
        return marked

    hooks, gemms, fc2, fc1, owners = [], [], {}, {}, {}
    for name, m, d in named:
        key = (top - int(d.group(1)), name[d.end():])
        owners.update({id(q): key for q in (m.weight, getattr(m, "bias", None)) if q is not None})
        parent = chunk.get_submodule(name.rsplit(".", 1)[0])
        routed = ROUTED.match(key[1])
        if routed:  # parent: the expert's MLP; its MoE layer two levels up
            m._gemm = gemm(m._gemm, key)
            gemms.append(m)
            if routed.group(2) == "2":
                fc2[id(parent)] = key
            else:
                fc1.setdefault(id(chunk.get_submodule(name.rsplit(".", 3)[0])), []).append(key)
            continue
        hooks += [m.register_forward_pre_hook(lambda mod, args, k=key: forward(args, k)),
                  m.register_forward_hook(lambda mod, args, out, k=key:
                                          on_grad(out[0] if isinstance(out, tuple) else out, "backward", k)),
                  parent.register_forward_hook(lambda mod, args, out, k=key: mark("done", k))]
    real_mlp, real_steps = moe_experts.expert_mlp, MoELayer.experts_steps

    def expert_mlp(mlp, x):
        y = real_mlp(mlp, x)
        if id(mlp) in fc2:
            mark("done", fc2[id(mlp)])
        return y

    def experts_steps(layer, *args):
        y = yield from real_steps(layer, *args)
        for k in fc1.get(id(layer), ()):
            mark("done", k)
        return y

    moe_experts.expert_mlp, MoELayer.experts_steps = expert_mlp, experts_steps
    try:
        yield owners
    finally:
        moe_experts.expert_mlp, MoELayer.experts_steps = real_mlp, real_steps
        for h in hooks:
            h.remove()
        for m in gemms:
            del m._gemm


def _timeline(p: Probe, fp8=None) -> list[tuple[str | None, int]]:
    """The events of :func:`timeline`; ``fp8`` (an ``FP8Config``): with the chunk's linears in FP8, as training
    converts them (the tests' reference for :func:`omnitron.plan.fp8_memory.fp8_replay_peak`): one amax reduction a
    step (``per_step``); under ``delayed``, the logged pass runs a step after the first (the reducer primed: each cast
    with its role's scale in force) with the weights' FP8 form cached at that step's scales, as every micro-batch of
    training after a step's first. Run as a probe (:func:`~omnitron.plan.measure.probing`: dropout as the
    backend's), with the cyclic garbage collector on from a full collection (:func:`_collector_from_empty`)."""
    with probing(), _collector_from_empty():
        return _logged(p, fp8)


@contextlib.contextmanager
def _collector_from_empty():
    """Python's cyclic collector on for the block, after a full collection (its previous state restored after).
    Some of a probe's storages are held by reference cycles until the collector frees them, so a probe's log
    depends on the collector: with it paused (a layout search pauses it, :func:`omnitron.plan.recommend.
    collector_paused`) a Mixtral-like MoE probe (h256, 2 layers, s32) kept two storages to its end that its
    sequence-doubled twin freed, the logs did not align and the estimate left backward's transients out
    (2026-12-07: Mixtral 8x7B at tp1 on 64 devices, the search and, through the probe cache, later ``--layout``
    runs). From an empty collection, its passes fall at the same events of a probe and its doubled twins.

    The heap the probe finds is frozen (``gc.freeze``: out of every collection until the probe ends) and the
    collection that empties the young generations walks only them: a full collection a probe walked the whole heap
    of a search (its meta skeletons and tables; 15 s of a 214 s GPT-2 search, 2026-12-07). What the probe left in
    cycles is collected as it ends, from its own objects only. Where the caller froze objects itself (its freeze
    would be undone), the full collection as before."""
    import gc

    was, own = gc.isenabled(), gc.get_freeze_count() == 0
    if own:
        gc.freeze()
    gc.collect()  # every generation's count to 0: the collector's passes fall where they fall from a full one
    gc.enable()
    try:
        yield
    finally:
        if own:
            gc.collect()  # the probe's own cycles (their storages), before the old heap comes back
            gc.unfreeze()
        if not was:
            gc.disable()


def _logged(p: Probe, fp8=None) -> list[tuple[str | None, int]]:
    m = _chunk(p)
    enabled = {}
    if fp8 is not None:
        from omnitron.core.precision.fp8.enable import enable_fp8

        enabled = enable_fp8(m, fp8, None, num_layers=p.cfg.num_layers, per_step=True)
    _main_grads(m)
    h = p.cfg.hidden_size
    torch.manual_seed(1)
    tokens = torch.randint(0, p.cfg.vocab_size, (p.b, p.s))
    positions = torch.arange(p.s).expand(p.b, p.s)
    hidden = None if p.first else torch.randn(p.s, p.b, h, dtype=p.cfg.params_dtype)
    dy = None if p.last else torch.randn(p.s, p.b, h, dtype=p.cfg.params_dtype)

    def step(tl=None):  # the received activation and output gradient are new buffers, as a pipeline's receives are
        x = None if hidden is None else hidden.clone().requires_grad_()
        y = m(tokens=tokens, position_ids=positions, hidden=x, labels=tokens if p.last else None)
        out = y.float().mean() if p.last else y
        _mark(tl, FORWARD_END)
        if not p.split:
            out.backward(None if p.last else dy.clone())
            return
        g_in, plan = backward_input(out, None if p.last else dy.clone(), x, params)
        del g_in  # sent: the boundary term's (omnitron/plan/memory.py)
        _mark(tl, W_START)
        _mark_kept(tl, plan, owners)
        plan.run()

    params = [q for q in m.parameters() if q.requires_grad]
    owners: dict = {}
    step()
    if fp8 is not None and fp8.fp8_recipe == "delayed":
        from omnitron.core.precision.fp8.enable import fp8_step

        fp8_step(enabled)
        step()
    tl = Timeline()
    experts = _mark_experts(tl) if p.cfg.num_experts else contextlib.nullcontext()
    with tl, _mark_linears(m, tl) as owners, experts:
        step(tl)
    return tl.events


def _mark(tl: Timeline | None, name: str) -> None:
    """Log the marker ``name`` (0 bytes) into ``tl`` after the storages freed since the last op (none: no log)."""
    if tl is not None:
        tl._sweep()
        tl.events.append((name, 0))


KEPT = "<kept "
"""Prefix of the marker events a split probe logs after :data:`W_START`, one per gradient its plan keeps for W
(:func:`_mark_kept`): ``<kept LAYER NAME SOURCE PARAMS>``, the linear whose boundary keeps it (``- -``: another
boundary, or the plan's output gradient), the event that created its storage and how many parameters the boundary
leads to (2: the linear's weight and bias)."""


def _mark_kept(tl: Timeline | None, plan, owners: dict) -> None:
    """Log a :data:`KEPT` marker into ``tl`` for each gradient ``plan`` (a split backward's
    :class:`~omnitron.core.parallel.pipeline.wgrad.WeightGradPlan` after B) keeps, naming the linear whose boundary
    keeps it where that boundary's weights are one marked linear's (``owners``, :func:`_mark_linears`): an FP8 linear
    keeps W's operands there instead (:func:`omnitron.plan.fp8_memory.fp8_w_inputs`); such a boundary logs that
    linear's ``weight`` :func:`marker` when W starts there (its weight-gradient pass, priced by
    :func:`omnitron.plan.fp8_memory.replay_fp8`)."""
    if tl is None:
        return
    weights = dict(plan.boundaries)
    kept = [(node, g) for node, gs in plan.kept.items() for g in gs if g is not None]
    kept += [(None, plan.grad)] if plan.grad is not None else []
    hooked: set = set()
    for node, g in kept:
        keys = {owners.get(id(q)) for q in weights.get(node, ())}
        key = next(iter(keys)) if len(keys) == 1 and None not in keys else ("-", "-")
        source = tl._live.get(g.untyped_storage()._cdata, (None, None))[1]
        if key[0] != "-" and node not in hooked:  # W starts at this linear's boundary: its weight-gradient pass
            hooked.add(node)
            node.register_prehook(lambda _g, key=key: _mark(tl, marker("weight", *key)))
        tl.events.append((f"{KEPT}{key[0]} {key[1]} {'-' if source is None else source} {len(weights.get(node, ()))}>",
                          0))


def kept_sources(events: list) -> dict[int, list[tuple[tuple[int, str] | None, int]]]:
    """``{creating event: [per boundary keeping that storage for W, (its linear's key (None: another keeper), the
    parameters it leads to)]}`` from a split probe's :data:`KEPT` markers."""
    out: dict = {}
    for op, _ in events:
        if op is not None and op.startswith(KEPT):
            layer, name, source, params = op[len(KEPT):-1].split(" ")
            if source != "-":
                out.setdefault(int(source), []).append((None if layer == "-" else (int(layer), name), int(params)))
    return out


def w_inputs(events: list, sizes: list[float]) -> float:
    """What a split probe's micro-batch holds between its B and its W beyond its saved tensors: the live bytes of a
    replayed log at :data:`W_START` less those at :data:`FORWARD_END` (the gradients kept at the weight
    boundaries and the output gradient, :mod:`omnitron.core.parallel.pipeline.wgrad`)."""
    live, at = 0.0, {}
    for i, (op, n) in enumerate(events):
        if op in (FORWARD_END, W_START):
            at[op] = live
        elif op is None:
            live -= sizes[n]
        else:
            live += sizes[i]
    return at[W_START] - at[FORWARD_END]


def heads_doubled(c):
    """``c`` with twice the heads (and query groups), hidden and ffn sizes (and multi-latent attention's latent
    ranks, which the probe divides with them), at the same head dimension."""
    d = c.kv_channels or c.hidden_size // c.num_attention_heads
    c = replace(c, num_attention_heads=2 * c.num_attention_heads, kv_channels=d,
                num_query_groups=2 * c.num_query_groups if c.num_query_groups else None,
                hidden_size=2 * c.hidden_size, ffn_hidden_size=2 * c.ffn_hidden_size)
    if getattr(c, "multi_latent_attention", False):
        c = replace(c, q_lora_rank=2 * c.q_lora_rank if c.q_lora_rank else None, kv_lora_rank=2 * c.kv_lora_rank)
    return _experts_doubled(c)


def _experts_doubled(c):
    """``c`` with its MoE widths (experts, shared expert) doubled, as the ffn."""
    if not c.num_experts:
        return c
    shared = c.moe_shared_expert_intermediate_size
    return replace(c, moe_ffn_hidden_size=2 * c.moe_ffn_hidden_size, moe_shared_expert_intermediate_size=2 * shared
                   if shared else None)


_DIMENSIONS = ("sequence", "batch", "head dimension", "heads", "vocabulary")


def _doubled(p: Probe) -> list[Probe]:
    """The five probes with one dimension doubled, in the order of ``_DIMENSIONS``."""
    c = p.cfg
    d = c.kv_channels or c.hidden_size // c.num_attention_heads
    vocab = replace(c, vocab_size=2 * c.vocab_size, make_vocab_size_divisible_by=2 * c.make_vocab_size_divisible_by)
    return [replace(p, s=2 * p.s), replace(p, b=2 * p.b),
            replace(p, cfg=_experts_doubled(replace(c, kv_channels=2 * d, hidden_size=2 * c.hidden_size,
                                                    ffn_hidden_size=2 * c.ffn_hidden_size))),
            replace(p, cfg=heads_doubled(c)), replace(p, cfg=vocab)]


def scaled_peak(p: Probe, s: int, b: int, kh: int, kd: int, vocab: int) -> float:
    """Peak bytes of the probe chunk's forward and backward scaled (:func:`scaled_log`)."""
    return peak(*scaled_log(p, s, b, kh, kd, vocab))


def experts_windows(events: list, sizes: list[float]) -> list[float]:
    """The most live bytes inside each MoE layer's local experts' backward (between the :data:`EXPERTS` markers) of
    a replayed log, in backward order."""
    live, out, inside = 0.0, [], False
    for i, (op, n) in enumerate(events):
        if op == EXPERTS:
            out.append(live)
            inside = True
        elif op == EXPERTS_END:
            inside = False
        elif op is None:
            live -= sizes[n]
        else:
            live += sizes[i]
            if inside:
                out[-1] = max(out[-1], live)
    return out


def scaled_log(p: Probe, s: int, b: int, kh: int, kd: int, vocab: int) -> tuple[list, list[float]]:
    """(events, each creation's bytes) of the probe chunk's forward and backward scaled to sequence ``s``, batch
    ``b``, heads times ``kh``, head dimension times ``kd`` and a vocabulary shard of ``vocab`` columns.

    A probe with one head or one query group (a tp rank's may) is logged at twice its heads, so heads scale
    by ``kh / 2``: attention takes other paths for a single head than for several."""
    c = p.cfg
    one = c.num_attention_heads == 1 or c.num_query_groups == 1
    if one:
        p = replace(p, cfg=heads_doubled(c))
    base = timeline(p)
    runs = [timeline(q) for q in _doubled(p)]
    for dim, run in zip(_DIMENSIONS, runs):
        if [op for op, _ in run] != [op for op, _ in base]:
            raise RuntimeError(f"plan: the transient probes' allocations differ with the {dim} doubled ({len(base)} "
                               f"against {len(run)} events); the memory model cannot scale them")
    factors = (s / p.s, b / p.b, kd, kh / 2 if one else kh, vocab / p.cfg.vocab_size)
    sizes = []
    for i, (op, n) in enumerate(base):
        if op is None or n == 0:
            sizes.append(float(n))
            continue
        scale = 1.0
        for f, run in zip(factors, runs):
            scale *= f ** math.log2(run[i][1] / n) if run[i][1] else 0.0
        sizes.append(n * scale)
    return base, sizes
