"""What ``--fp8-format`` holds on one pipeline rank beyond the wide model: the ``fp8`` term of
:mod:`omnitron.plan.memory`, counted from the code path training runs (eager, ``enable_fp8(..., per_step=True)`` in
``core/training/components.py``; :mod:`omnitron.core.precision.fp8.linear`).

**Which linears.** Those :func:`~omnitron.core.precision.fp8.enable.enable_fp8` converts: every linear of the rank's
chunks (:func:`~omnitron.core.precision.fp8.enable.linear_modules`, tp-local shapes) but the output layer
(``DEFAULT_EXCLUDE``) and the layers ``--first-last-layers-bf16`` keeps wide
(:func:`omnitron.plan.stage_layers.wide_layers`, the speed model's selection); a wide layer holds nothing of FP8.

**Per FP8 linear, weight ``[out, in]``** (held the whole step: ``FP8Linear.quantize_weight`` caches the weight's
FP8 form until an optimizer update changes it, and every micro-batch's forward saves the cached tensors):

- per-tensor recipes (``delayed``, ``tensorwise``): ``(q, q.t() contiguous, scale_inv)``: 2 bytes an element and a
  4-byte scale (:data:`PER_TENSOR_WEIGHT`);
- ``blockwise``: ``(q, scale_inv)``: 1 byte an element and one fp32 scale per 128x128 block
  (``ceil(out/128) x ceil(in/128)``, :data:`omnitron.core.precision.fp8.config.BLOCK_WEIGHT`);
- ``delayed`` also keeps per role (input, weight, output gradient) a ``DelayedScaling``: its amax history
  (``--fp8-amax-history-len`` fp32) and three fp32 scalars (scale, its inverse, the step's amax).

**Saved activations** (:func:`saved_less`, taken off the activation term by :mod:`omnitron.plan.memory`). The block-wise
forward saves its input wide (the tensor ``F.linear`` saves, which the activation probes measure) and no activation
scale: nothing changes. The per-tensor forward saves ``(qx_t, sx, qw_t, sw)``: the input's FP8 transpose (1 byte an
element) and its fp32 scale where ``F.linear`` saved the input (the cached weight's are in the weight term). The probes
run the wide model, which saves an input once however many linears read it; FP8 linears each save their own copy. So per
FP8 layer and micro-batch, for each group of its linears reading one input tensor (:func:`input_groups`: one hooked
forward of a one-layer probe; in a GPT layer qkv, proj, fc1 and fc2 each read their own),
``(e - n) x in x tokens - 4 n`` bytes less (``e`` the dtype's bytes, ``n`` the group's linears). Tokens are the micro-batch's whole sequence (over
cp): a row-parallel linear's input is not split by sequence, and under sequence parallelism a column-parallel linear
saves the input it all-gathered, each its own gather (a group of its own); a replicated linear (a one-rank group:
multi-latent attention's down-projections) reads the sequence shard, ``1 / tp`` of the tokens (:func:`_reads`). Full
recomputation: a recomputed layer keeps its input only (``recompute_layers``), nothing to take off; selective
recomputation reruns core attention only, the linears' inputs stay saved.

Not modelled: an input that is a view of a wider tensor, whose whole storage the wide linear keeps (multi-latent
attention without ``--qk-layernorm``: the key-value up-projection reads a slice of the down-projection's output; its
saving priced at the slice's width: the estimate over-counts the rest of that storage); the rematerialised chunk of full
recomputation (its FP8 linears' inputs priced wide: an over-count of one chunk's saving), multi-token prediction's
depths and their ``eh_proj``, an MoE layer's expert and router linears (their inputs priced wide; the attention linears
of an MoE layer are taken off), ``--torch-compile`` (a compiled layer quantizes the weight in its graph, uncached, and
inductor decides what it saves), backward's own quantized operands and an emulated GEMM's fp32 dequantized copies
(transients of one layer: 0.66 MiB at the tiny GPT's block-wise peak on CPU, 0.63 MiB at its tensorwise one,
BENCHMARKS.md), the delayed reducer's packed buffers, ``--fp8-impl torchao``.
Multi-token prediction's layers are counted in FP8 under ``--first-last-layers-bf16`` too, as the engine runs them
(Megatron's ``layer_no=-1``: never kept wide).
"""
from __future__ import annotations

import fnmatch
import math
import re

import torch

from omnitron.core.parallel.pipeline.schedules import schedule_style
from omnitron.plan.stage_layers import wide_layers
from omnitron.plan.state import skeleton

PER_TENSOR_WEIGHT = 2
"""Bytes per weight element a per-tensor recipe caches: the FP8 weight and its contiguous transpose."""
SCALE = 4
"""Bytes of one scale (float32)."""
SAVED_INPUT = 1
"""Bytes per element of what a per-tensor FP8 linear saves of its input: its FP8 transpose (``qx_t``)."""
DELAYED_SCALARS = 3
"""float32 scalars of one role's ``DelayedScaling`` beside its history: scale, scale_inv, step_amax."""
_DECODER = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.")


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


def linear_bytes(fp8, out: int, inp: int) -> int:
    """What one FP8 linear of weight ``[out, inp]`` holds under recipe ``fp8`` (an ``FP8Config``)."""
    if fp8.fp8_recipe == "blockwise":
        return out * inp + SCALE * math.ceil(out / 128) * math.ceil(inp / 128)
    held = PER_TENSOR_WEIGHT * out * inp + SCALE
    if fp8.fp8_recipe == "delayed":
        held += 3 * SCALE * (fp8.fp8_amax_history_len + DELAYED_SCALARS)
    return held


def fp8_bytes(settings, cfg, pp_rank: int) -> int:
    """The ``fp8`` term of pipeline rank ``pp_rank``: 0 without ``--fp8-format``."""
    return sum(linear_bytes(settings.fp8, o, i) for o, i in fp8_linears(settings, cfg, pp_rank))


_GROUPS: dict[str, tuple] = {}


def input_groups(cfg) -> tuple[tuple[str, ...], ...]:
    """One dense decoder layer's linears (names in the layer) grouped by the input tensor they read, from one
    forward (no grad) of a one-layer probe at the activation probes' widths
    (:func:`omnitron.plan.activations.probe_config`, one process: no sequence parallelism), a pre-hook on each
    linear keeping its input (so no later tensor reuses the storage); cached per config."""
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
        hooks = [m.register_forward_pre_hook(lambda mod, args, n=name[d.end():]: seen.append((n, args[0])))
                 for name, m in linear_modules(model) for d in [_DECODER.search(name)] if d is not None]
        try:
            tokens = torch.randint(0, probe.vocab_size, (1, s))
            with torch.no_grad():
                model(tokens=tokens, position_ids=torch.arange(s)[None])
        finally:
            for h in hooks:
                h.remove()
        groups: dict[int, list[str]] = {}
        for n, x in seen:
            groups.setdefault(x.untyped_storage().data_ptr(), []).append(n)
        _GROUPS[key] = tuple(tuple(g) for g in groups.values())
    return _GROUPS[key]


def _reads(settings, m) -> tuple[bool, int]:
    """(whether linear ``m`` saves an input of its own, the divisor of the micro-batch's tokens it reads) under
    the layout: with sequence parallelism over tp > 1 a column-parallel linear all-gathers its input (a copy of its
    own, the whole sequence) and a replicated one (a one-rank group: multi-latent attention's down-projections)
    reads the sequence shard; every other linear the whole sequence."""
    from omnitron.core.parallel.tensor.layers import ColumnParallelLinear

    pc = settings.parallel
    tp = pc.tensor_model_parallel_size
    if not (pc.sequence_parallel and tp > 1 and isinstance(m, ColumnParallelLinear)):
        return False, 1
    return (True, 1) if m.sequence_parallel and m.group.size > 1 else (False, tp if m.group.size == 1 else 1)


def saved_less(settings, cfg, pp_rank: int) -> dict[int, float]:
    """Per chunk of pipeline rank ``pp_rank``: the bytes one micro-batch's FP8 layers save less than the wide model
    the activation probes measure (module docstring, "Saved activations"); empty without a per-tensor recipe."""
    from omnitron.core.models.gpt.config import recompute_layers
    from omnitron.core.precision.fp8.enable import DEFAULT_EXCLUDE, linear_modules

    if settings.fp8 is None or not settings.fp8.per_tensor:
        return {}
    pc = settings.parallel
    tokens = cfg.seq_length // pc.context_parallel_size * settings.training.micro_batch_size
    elem, groups = cfg.params_dtype.itemsize, input_groups(cfg)
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
        less = 0.0
        for i, inputs in layers.items():
            if wide[(pp_rank, c)][i - first] or i - first in recomputed:
                continue
            for g in groups:
                mine = [inputs[n] for n in g if n in inputs]
                own = [(k, 1) for k, gathers, _ in mine if gathers]  # under SP: each its own gathered copy
                shared = [(k, split) for k, gathers, split in mine if not gathers]
                for part in [[o] for o in own] + ([shared] if shared else []):
                    (k, split), n = part[0], len(part)
                    less += (elem - n * SAVED_INPUT) * k * tokens / split - SCALE * n
        out[c] = less
    return out
