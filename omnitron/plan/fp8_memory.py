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

**Saved activations.** The block-wise forward saves its input wide (the tensor ``F.linear`` saves, which the
activation probes measure) and no activation scale: nothing to add. The per-tensor forward saves the input's FP8
transpose (1 byte an element, and a 4-byte scale) where ``F.linear`` would save the input: not modelled (the probes
run the wide model), so per-tensor activations are over-counted by up to 1 byte per FP8-linear input element held.

Not modelled: ``--torch-compile`` (a compiled layer quantizes the weight in its graph, uncached), backward's own
quantized operands and an emulated GEMM's fp32 dequantized copies (transients of one layer: 0.66 MiB at the tiny
GPT's block-wise peak on CPU, BENCHMARKS.md), the delayed reducer's packed buffers, ``--fp8-impl torchao``.
Multi-token prediction's layers are counted in FP8 under ``--first-last-layers-bf16`` too, as the engine runs them
(Megatron's ``layer_no=-1``: never kept wide).
"""
from __future__ import annotations

import fnmatch
import math
import re

from omnitron.core.parallel.pipeline.schedules import schedule_style
from omnitron.plan.stage_layers import wide_layers
from omnitron.plan.state import skeleton

PER_TENSOR_WEIGHT = 2
"""Bytes per weight element a per-tensor recipe caches: the FP8 weight and its contiguous transpose."""
SCALE = 4
"""Bytes of one scale (float32)."""
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
