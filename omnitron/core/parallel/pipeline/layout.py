"""Which transformer layers each pipeline stage (and virtual chunk) builds.

Megatron semantics: the first and last pipeline ranks may get a set number of layers
(``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``); the other
ranks split the rest evenly; with interleaving each rank's layers are split evenly over its
``vp`` chunks, and virtual stage ``c * pp + r`` (chunk c of rank r) follows stage ``c * pp + r - 1``.
The embedding lives on virtual stage 0 and the output head on the last one. With ``style="v"``
(``--pipeline-schedule zb-v`` / ``dualpipe-v``) rank r's chunk 0 is stage r and its chunk 1 stage
``2 pp - 1 - r``: rank 0 holds both the embedding and the head.
"""
from __future__ import annotations

from omnitron.core.config.parallel import ConfigError
from omnitron.core.parallel.pipeline.schedules import virtual_stage


def _per_rank(num_layers: int, pp: int, first: int | None, last: int | None) -> list[int]:
    """Layers held by each pipeline rank, all chunks together."""
    if pp == 1:
        if first is not None or last is not None:
            raise ConfigError("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1")
        return [num_layers]
    for flag, v in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        if v is not None and v < 0:
            raise ConfigError(f"{flag} must be >= 0, got {v}")
    fixed = (first or 0) + (last or 0)
    if fixed > num_layers:
        raise ConfigError(f"--decoder-first-pipeline-num-layers ({first}) + --decoder-last-pipeline-num-layers "
                          f"({last}) exceed --num-layers ({num_layers})")
    middle_ranks = pp - (first is not None) - (last is not None)
    rest = num_layers - fixed
    if middle_ranks == 0:
        if rest:
            raise ConfigError(f"with pp={pp} the first ({first}) and last ({last}) stages must hold all "
                              f"{num_layers} layers; fix --decoder-first/last-pipeline-num-layers")
        return [first, last]
    if rest % middle_ranks:
        what = "--num-layers" if first is None and last is None else "the layers left after the first/last stages"
        raise ConfigError(f"{what} ({rest}) must divide evenly over {middle_ranks} pipeline stages; change "
                          f"--num-layers, --pipeline-model-parallel-size or --decoder-first/last-pipeline-num-layers")
    counts = [rest // middle_ranks] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def pipeline_layer_ranges(num_layers: int, pp: int, vp: int | None = None, first: int | None = None,
                          last: int | None = None, style: str = "loop") -> dict[tuple[int, int], tuple[int, int]]:
    """``{(pp_rank, vp_rank): (layer_offset, num_layers)}`` for every stage chunk.

    Raises :class:`ConfigError` naming the flag when the layers do not split.
    """
    vp = vp or 1
    if num_layers < 1:
        raise ConfigError(f"--num-layers must be >= 1, got {num_layers}")
    if style == "v":
        return _v_ranges(num_layers, pp, vp, first, last)
    counts = _per_rank(num_layers, pp, first, last)
    for r, n in enumerate(counts):
        if n % vp:
            raise ConfigError(f"pipeline rank {r} holds {n} layers, which do not split over {vp} virtual stages; "
                              f"change --num-layers-per-virtual-pipeline-stage or the layer counts")
    out, offset = {}, 0
    for c in range(vp):
        for r in range(pp):
            n = counts[r] // vp
            out[(r, c)] = (offset, n)
            offset += n
    return out


def _v_ranges(num_layers: int, pp: int, vp: int, first: int | None, last: int | None) -> dict:
    """The V placement: 2 pp equal chunks, stage k on rank k (k < pp) or 2 pp - 1 - k."""
    if first is not None or last is not None:
        raise ConfigError("--decoder-first/last-pipeline-num-layers do not apply to the V-shaped schedules (rank 0 "
                          "holds the first and the last stage); drop them or use another --pipeline-schedule")
    if vp != 2:
        raise ConfigError(f"the V-shaped schedules hold two chunks per rank, got {vp}; set "
                          f"--num-layers-per-virtual-pipeline-stage to --num-layers / (2 x pipeline size)")
    if num_layers % (2 * pp):
        raise ConfigError(f"--num-layers {num_layers} must divide evenly over 2 x {pp} virtual stages; change "
                          f"--num-layers or --pipeline-model-parallel-size")
    n = num_layers // (2 * pp)
    return {(r, c): (virtual_stage(r, c, pp, "v") * n, n) for c in range(2) for r in range(pp)}
