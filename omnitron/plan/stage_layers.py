"""Which layers each pipeline stage of a layout holds, as the speed and memory models both read them: the layers'
kinds (MoE or dense) per virtual stage, the routing histogram row each MoE layer is priced at
(``omnitron plan --moe-expert-load``), and which layers ``--first-last-layers-bf16`` keeps out of FP8. Its own
module so :mod:`omnitron.plan.speed` and :mod:`omnitron.plan.memory` share it without importing each other."""
from __future__ import annotations

from omnitron.core.parallel.pipeline.layout import config_layer_ranges
from omnitron.core.parallel.pipeline.schedules import schedule_style
from omnitron.core.transformer.moe.pattern import moe_layer_pattern


def _ranges(settings, cfg) -> dict:
    """``{(pp_rank, chunk): (first layer, layer count)}`` of the layout's pipeline (global 0-based numbering)."""
    return config_layer_ranges(cfg.num_layers, settings.parallel, schedule_style(settings.training.pipeline_schedule))


def stage_layers(settings, cfg, histogram_rows: int | None = None):
    """``{(pp_rank, chunk): [is MoE] of its layers}`` (the pipeline's layer ranges); with ``histogram_rows``
    (a routing histogram's row count) instead ``[histogram row of each layer]``: row ``j`` for the ``j``-th MoE
    layer when there is one row per MoE layer, None for dense layers and otherwise (the mean over the rows)."""
    moe = moe_layer_pattern(cfg.moe_layer_freq, cfg.num_layers) if cfg.num_experts else [False] * cfg.num_layers
    if histogram_rows is not None:
        ordinal = [sum(moe[:i]) if m else None for i, m in enumerate(moe)]
        moe = ordinal if histogram_rows == sum(moe) else [None] * len(moe)
    return {k: moe[start:start + n] for k, (start, n) in _ranges(settings, cfg).items()}


def wide_layers(settings, cfg) -> dict:
    """``{(pp_rank, chunk): [kept out of FP8] of its layers}``: under ``--fp8-format`` with
    ``--first-last-layers-bf16`` the model's first ``--num-layers-at-start-in-bf16`` and last
    ``--num-layers-at-end-in-bf16`` layers (global numbering, wherever the pipeline puts them), as
    :func:`omnitron.core.precision.fp8.enable.enable_fp8` keeps them wide; every flag False otherwise."""
    fp8, n = settings.fp8, cfg.num_layers
    keep = fp8 is not None and fp8.first_last_layers_bf16
    wide = [keep and (i < fp8.num_layers_at_start_in_bf16 or i >= n - fp8.num_layers_at_end_in_bf16)
            for i in range(n)]
    return {k: wide[start:start + c] for k, (start, c) in _ranges(settings, cfg).items()}
