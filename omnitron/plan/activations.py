"""Activation bytes of one micro-batch, per pipeline stage, measured on small probes and scaled.

Derivation. For a fixed layer configuration every tensor autograd saves is ``[s, b, w]`` for some width
``w`` (hidden, query/key/value, ffn, per-token norm statistics) or, where attention materialises
its scores (the unfused path taken with attention dropout), ``[b, heads, s, s]``; a mask over keys
is ``[s, s]``. So one layer's saved bytes are exactly ``b * (alpha * s + beta * s^2)``, and the
tensor-parallel shard of a layer holds the same structure at its local widths. We therefore measure
instead of modelling op by op (see :class:`omnitron.plan.measure.SavedBytes`):

1. a probe layer = the rank's local layer (heads, query groups and ffn divided by tp) with every width
   divided by ``k = k_heads * k_dim`` (fewer heads, a smaller head dimension) so that it is small, run in
   this process at ``b = 1`` and two sequence lengths ``s1, 2 s1``: ``alpha, beta`` solve the two
   equations; ``alpha`` times ``k``, ``beta`` (per head, whatever its dimension) times ``k_heads``;
2. the same at hidden ``2 h / k``: the difference is the part proportional to the hidden size, which
   sequence parallelism splits over tp, the inputs the column-parallel linears save included: they all-gather
   their input shard inside and save the shard (:mod:`omnitron.core.parallel.tensor.gather_linear`, since
   2026-12-05; before, each saved its all-gathered ``[s, b, h]`` input, ``e * h`` bytes per token per such
   linear that stayed whole, and the head likewise its output layer's); what SP adds whole is the input the
   key/value projection replicated over tp (fewer query groups than tp ranks) saves all-gathered, ``e * h``
   per token (``gathered``; ``e`` the activation dtype's size);
3. a layer's rate = (model of ``2 n`` layers - model of ``n`` layers) / ``n`` (``n`` = the recompute
   chunk with ``--recompute-granularity full``, else 1): recomputation is measured, not assumed;
4. the ends: a 2-layer probe split over 2 pipeline stages, each stage minus its layer, gives the first
   stage's embedding bytes and the last stage's head (final norm, logits, loss) bytes; the head at two
   vocabularies ``V1, 2 V1`` separates the part that scales with the rank's ``V_pad / tp`` columns. The
   ends are probed without multi-token prediction;
5. multi-token prediction (``--mtp-num-layers D``, on the last stage): each depth is a transformer layer
   (the layer rate), a head of its own (logits and loss, as the main head's) and its inputs: the shifted
   tokens' embedding, the two input norms and the ``[s, b, 2h]`` concatenation ``eh_proj`` saves. The last
   stage probed with one depth, minus the stage without it, its layer and its head, gives those inputs'
   bytes per token (``mtp_inputs``; all of them ``[s(/tp under SP), b, .]``).

Errors (bounded in tests/plan/test_activations.py): per-token norm statistics are multiplied by
``k`` in step 1 when ``k > 1`` (hidden sizes above 256 only; the tests' models are probed at ``k = 1``).
Multi-latent attention is probed at ``k_dim = 1`` (its head dimensions kept) with its latent ranks divided by
``k``; its shared rotated key part does not grow with the widths, so its layer's ``lin`` is split into the
part that does and the part that does not by one more probe at twice the widths (``lin = W + C``, real
``k W + C``; the norm statistics fall into ``C`` as well).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from omnitron.core.transformer.shapes import ffn_size
from omnitron.plan.measure import SavedBytes, probing
from omnitron.plan.transients import heads_doubled

_S1, _V1 = 64, 128


@dataclass(frozen=True)
class LayerRate:
    """Saved bytes per sample of one layer: ``lin * s + quad * s^2``, ``hidden`` the part of ``lin``
    proportional to the hidden size (split over tp by sequence parallelism), ``gathered`` what sequence
    parallelism adds whole beyond it (an all-gathered input a linear saves: :func:`_gathered_per_token`)."""

    lin: float
    quad: float
    hidden: float
    gathered: float = 0.0

    def bytes(self, s: int, b: int, tp: int = 1, sp: bool = False) -> float:
        lin = self.lin - (self.hidden * (1 - 1 / tp) - self.gathered if sp and tp > 1 else 0.0)
        return b * (lin * s + self.quad * s * s)


def _measure(cfg, layers: int, s: int) -> int:
    """Saved bytes of one forward (with the loss) of a ``layers``-layer model at ``b = 1``, sequence ``s``."""
    from omnitron.core.models.gpt import GPTModel
    from omnitron.core.parallel.groups import ParallelGroups

    c = replace(cfg, num_layers=layers, seq_length=s, max_position_embeddings=max(s, cfg.max_position_embeddings or s),
                recompute_num_layers=min(cfg.recompute_num_layers or 1, layers) if cfg.recompute_granularity == "full"
                else cfg.recompute_num_layers)
    torch.manual_seed(0)
    m = GPTModel(c, ParallelGroups.single())
    m.train()
    tokens = torch.randint(0, c.vocab_size, (1, s))
    rec = SavedBytes(m.parameters())
    if m.offloader is not None:
        _count_kept(m.offloader, rec)
    with rec.record():
        m(tokens=tokens, position_ids=torch.arange(s)[None], labels=tokens)
    return rec.total


def _count_kept(offloader, rec: SavedBytes) -> None:
    """Have ``rec`` count what ``offloader`` keeps on the device (below --min-offloaded-tensor-size, or a kind it
    does not move): its saved-tensor hooks, inside ``rec``'s, take every tensor of the modules it scopes."""
    pack = offloader._pack

    def counting(t, *args):
        held = pack(t, *args)
        if held is t:
            rec._pack(t)
        return held

    offloader._pack = counting


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _scale(h: int, heads: int, groups: int, d: int, ffn: int, ranks: tuple[int, ...] = ()) -> tuple[int, int]:
    """(k_heads, k_dim): the probe divides the head count by ``k_heads`` and the head dimension by ``k_dim``
    (every width by ``k = k_heads * k_dim``), the largest ``k`` dividing hidden and ffn with a hidden size
    of at least 256 and an even head dimension of at least 16 (RoPE pairs). Multi-latent attention
    (``ranks``: its latent ranks, which ``k`` must divide): ``k_dim = 1``, its head dimensions are kept."""
    best = (1, 1)
    for kh in _divisors(heads):
        if groups % kh:
            continue
        for kd in [1] if ranks else _divisors(d):
            k = kh * kd
            if h % k or ffn % k or h // k < 256 or any(r % k for r in ranks):
                continue
            if not ranks and ((d // kd) % 2 or d // kd < 16):
                continue
            if k > best[0] * best[1]:
                best = (kh, kd)
    return best


def without_offloading(cfg):
    """``cfg`` without activation offloading: the probes' layers save as the layers do (--cpu-offloading needs more
    layers than the probes have; what either offloading moves is priced apart: ``omnitron.plan.memory`` and
    :func:`fine_grained_bytes`)."""
    return replace(cfg, cpu_offloading=False, cpu_offloading_num_layers=0, fine_grained_activation_offloading=False,
                   offload_modules=None)


_FINE: dict[str, float] = {}


def fine_grained_bytes(cfg, tp: int, s: int, b: int, sp: bool = False) -> float:
    """Bytes one layer's --offload-modules move to the host for one micro-batch of ``b`` x ``s`` tokens (0 without
    --fine-grained-activation-offloading): the probe layer's saved bytes at ``_S1`` tokens less the same layer's
    with the offloader on, scaled to the real tokens and widths (every tensor those modules save is ``[s, b, w]``:
    linear in the tokens and the width). --min-offloaded-tensor-size is applied as at the real size: the probe's
    threshold divided by that scale. Under SP every such tensor is priced as a sequence shard (the attention
    projection's input stays whole there: the saving priced low, an upper bound on the memory), the threshold
    judged at the unsharded size (a shard within a factor tp above it is priced moved, though it stays)."""
    if not cfg.fine_grained_activation_offloading:
        return 0.0
    probe, kh, kd = probe_config(cfg, tp)
    scale = s * b / _S1 * kh * kd
    key = f"{probe!r}/{cfg.offload_modules}/{cfg.min_offloaded_tensor_size}/{scale}"
    if key not in _FINE:
        moved = replace(probe, fine_grained_activation_offloading=True, offload_modules=cfg.offload_modules,
                        min_offloaded_tensor_size=math.ceil(cfg.min_offloaded_tensor_size / scale))
        with probing():
            _FINE[key] = (_measure(probe, 1, _S1) - _measure(moved, 1, _S1)) * scale
    return _FINE[key] / (tp if sp and tp > 1 else 1)


def probe_config(cfg, tp: int):
    """(probe config, k_heads, k_dim): the tp-local layer with widths divided by ``k_heads * k_dim``."""
    heads, d = cfg.num_attention_heads, cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    groups = cfg.num_query_groups or heads
    ffn = ffn_size(cfg)
    lh, lg, lf = heads // tp, max(1, groups // tp), ffn // tp
    mla = getattr(cfg, "multi_latent_attention", False)
    ranks = tuple(r for r in (cfg.q_lora_rank, cfg.kv_lora_rank) if r) if mla else ()
    kh, kd = _scale(cfg.hidden_size, lh, lg, d, lf, ranks)
    k = kh * kd
    # NOTE: every layer is probed dense (the MLP at --ffn-hidden-size); an MoE layer's difference is
    # omnitron.plan.moe_activations'
    probe = replace(without_offloading(cfg), hidden_size=cfg.hidden_size // k, num_attention_heads=lh // kh,
                    kv_channels=d // kd, num_query_groups=(lg // kh) if cfg.num_query_groups else None,
                    ffn_hidden_size=lf // k, vocab_size=_V1, make_vocab_size_divisible_by=_V1, num_experts=None)
    if mla:  # the latents are per-token widths: divided with the hidden size; the head dimensions kept (kd = 1)
        probe = replace(probe, q_lora_rank=cfg.q_lora_rank // k if cfg.q_lora_rank else None,
                        kv_lora_rank=cfg.kv_lora_rank // k)
    return probe, kh, kd


def _layer_rate(probe, kh: int, kd: int, n: int) -> LayerRate:
    """Step 1-3 of the module docstring: widths scale back by ``k_heads * k_dim``, scores by ``k_heads``."""
    def per_layer(c, s):
        return (_measure(c, 2 * n, s) - _measure(c, n, s)) / n

    a, b2 = per_layer(probe, _S1), per_layer(probe, 2 * _S1)
    quad = (b2 - 2 * a) / (2 * _S1 * _S1)
    lin = (a - quad * _S1 * _S1) / _S1
    wide = replace(probe, hidden_size=2 * probe.hidden_size)
    hidden = (per_layer(wide, _S1) - a) / _S1  # the hidden-proportional part doubles
    k = kh * kd
    if k > 1 and getattr(probe, "multi_latent_attention", False):
        # multi-latent attention's shared rotated key part ([s, b, dr]) and the norms' statistics do not grow
        # with the widths: ``lin = W + C``; the probe at twice the widths (heads, hidden, ffn, latent ranks)
        # gives ``W`` and ``C``, and the real layer ``k W + C``
        lin2 = (per_layer(heads_doubled(probe), _S1) - 2 * quad * _S1 * _S1) / _S1
        return LayerRate((k - 1) * lin2 - (k - 2) * lin, kh * quad, k * hidden)
    return LayerRate(k * lin, kh * quad, k * hidden)


def _gathered_per_token(cfg, tp: int) -> float:
    """Bytes per token a layer saves whole under sequence parallelism beyond the probe's split hidden part: the
    input the key/value projection replicated over tp saves, all-gathered by ``gather_from_sp`` (``SelfAttention
    ._project``, fewer query groups than tp ranks; the probe's one-process layer saves that input once, as the
    shard the query projection keeps). Every column-parallel linear saves its input shard
    (:mod:`omnitron.core.parallel.tensor.gather_linear`)."""
    from omnitron.core.transformer.shapes import query_groups

    mla = getattr(cfg, "multi_latent_attention", False)
    return float(cfg.hidden_size * cfg.params_dtype.itemsize) if tp > 1 and not mla and query_groups(cfg) < tp else 0.0


@dataclass(frozen=True)
class ActivationModel:
    """Per-sample saved bytes: layers (recomputed or not) and the last stage's head at ``V_pad / tp``."""

    layer: LayerRate
    recomputed: LayerRate
    head_fixed: float
    """Per token: head and loss bytes independent of the vocabulary (split over tp under SP: the output layer keeps
    its input shard since 2026-12-05, :mod:`omnitron.core.parallel.tensor.gather_linear`; it kept the all-gathered
    input before, ``e h`` a token that stayed whole)."""
    head_vocab: float
    """Per token and vocabulary column of the rank's logits shard."""
    embedding: float
    """Per token: the first stage's embedding output (and dropout mask)."""
    mtp_inputs: float = 0.0
    """Per token and MTP depth: its embedding, input norms and ``eh_proj`` input (step 5 of the module doc)."""


_CACHE: dict[str, ActivationModel] = {}


def activation_model(cfg, tp: int) -> ActivationModel:
    """Measure the probes for ``cfg`` at tensor-parallel size ``tp`` (cached per config)."""
    key = f"{cfg!r}/{tp}"
    if key not in _CACHE:
        with probing():
            _CACHE[key] = _activation_model(cfg, tp)
    return _CACHE[key]


def _activation_model(cfg, tp: int) -> ActivationModel:
    probe, kh, kd = probe_config(cfg, tp)
    k = kh * kd
    plain = replace(probe, recompute_granularity=None, recompute_method=None, recompute_num_layers=None)
    if cfg.recompute_granularity == "selective":
        plain = replace(plain, recompute_granularity="selective")
    layer = replace(_layer_rate(plain, kh, kd, 1), gathered=_gathered_per_token(cfg, tp))
    recomputed = layer
    if cfg.recompute_granularity == "full":
        n = cfg.recompute_num_layers or 1 if cfg.recompute_method == "uniform" else 1
        recomputed = _layer_rate(replace(probe, recompute_method="uniform", recompute_num_layers=n), kh, kd, n)
    # embedding and head: the stages of a 2-layer, 2-stage probe minus their layer, at two vocabularies
    own = layer.lin * _S1 / k + layer.quad * _S1 * _S1 / kh  # the probe layer's own bytes
    main = replace(plain, mtp_num_layers=None)
    first, h1 = _ends(main, own)
    _, h2 = _ends(replace(main, vocab_size=2 * _V1, make_vocab_size_divisible_by=2 * _V1), own)
    per_col = (h2 - h1) / (_S1 * _V1)
    mtp_inputs = 0.0
    if cfg.mtp_num_layers:  # step 5: the stage with one depth, minus the stage without it, its layer and its head
        _, m1 = _ends(replace(plain, mtp_num_layers=1), own)
        mtp_inputs = (m1 - h1 - own - h1) / _S1 * k
    return ActivationModel(layer, recomputed, (h1 / _S1 - per_col * _V1) * k, per_col, first / _S1 * k, mtp_inputs)


def _ends(probe, own: float) -> tuple[float, float]:
    """(first stage, last stage) bytes beyond their one layer, of a 2-layer probe split over 2 stages."""
    from omnitron.core.checkpoint.reshard import Layout
    from omnitron.plan.measure import pipeline_bytes

    got = pipeline_bytes(replace(probe, num_layers=2, seq_length=_S1,
                                 max_position_embeddings=max(_S1, probe.max_position_embeddings or _S1)),
                         Layout(pp=2), 1)
    return got[(0, 0)] - own, got[(1, 0)] - own
