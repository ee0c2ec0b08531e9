"""Which layers each pipeline stage of a layout holds, as the speed and memory models both read them: the layers'
kinds (MoE or dense) per virtual stage, or the routing histogram row each MoE layer is priced at
(``omnitron plan --moe-expert-load``). Its own module so :mod:`omnitron.plan.speed` and
:mod:`omnitron.plan.memory` share it without importing each other."""
from __future__ import annotations

from omnitron.core.parallel.pipeline.layout import pipeline_layer_ranges
from omnitron.core.parallel.pipeline.schedules import schedule_style
from omnitron.core.transformer.moe.pattern import moe_layer_pattern


def stage_layers(settings, cfg, histogram_rows: int | None = None):
    """``{(pp_rank, chunk): [is MoE] of its layers}`` (the pipeline's layer ranges); with ``histogram_rows``
    (a routing histogram's row count) instead ``[histogram row of each layer]``: row ``j`` for the ``j``-th MoE
    layer when there is one row per MoE layer, None for dense layers and otherwise (the mean over the rows)."""
    pc, style = settings.parallel, schedule_style(settings.training.pipeline_schedule)
    ranges = pipeline_layer_ranges(cfg.num_layers, pc.pipeline_model_parallel_size,
                                   pc.virtual_pipeline_model_parallel_size, pc.decoder_first_pipeline_num_layers,
                                   pc.decoder_last_pipeline_num_layers, style=style)
    moe = moe_layer_pattern(cfg.moe_layer_freq, cfg.num_layers) if cfg.num_experts else [False] * cfg.num_layers
    if histogram_rows is not None:
        ordinal = [sum(moe[:i]) if m else None for i, m in enumerate(moe)]
        moe = ordinal if histogram_rows == sum(moe) else [None] * len(moe)
    return {k: moe[start:start + n] for k, (start, n) in ranges.items()}
