"""Which transformer layers each pipeline stage (and virtual chunk) builds.

Megatron semantics: the first and last pipeline ranks may get a set number of layers
(``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``); the other
ranks split the rest evenly; with interleaving each rank's layers are split evenly over its
``vp`` chunks, and virtual stage ``c * pp + r`` (chunk c of rank r) follows stage ``c * pp + r - 1``.
The embedding lives on virtual stage 0 and the output head on the last one. With ``style="v"``
(``--pipeline-schedule zb-v`` / ``dualpipe-v``) rank r's chunk 0 is stage r and its chunk 1 stage
``2 pp - 1 - r``: rank 0 holds both the embedding and the head.

``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split`` (``embedding`` /
``loss``) count the embedding / the loss as one layer each: the ``num_layers + embedding + loss`` slots split
evenly over every virtual stage, and the first (last) virtual stage builds one layer fewer; a chunk with one
slot then holds the embedding (the head) alone. With ``pp == 1`` there is nothing to balance and the one stage
builds every layer (Megatron's arithmetic gives the same).
"""
from __future__ import annotations

from itertools import accumulate

from omnitron.core.config.parallel import ConfigError, ParallelConfig
from omnitron.core.parallel.pipeline.schedules import virtual_stage

_ACCOUNT = "--account-for-embedding/loss-in-pipeline-split"


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


def _accounted(num_layers: int, pp: int, vp: int, embedding: bool, loss: bool) -> list[int]:
    """Layers of each virtual stage, in stage order, when the embedding / the loss count as a layer."""
    slots = num_layers + embedding + loss
    what = f"--num-layers {num_layers} + {int(embedding) + int(loss)} ({_ACCOUNT})"
    if slots % pp:
        raise ConfigError(f"{what} = {slots} must divide evenly over {pp} pipeline stages; change --num-layers "
                          f"or --pipeline-model-parallel-size")
    if slots // pp % vp:
        raise ConfigError(f"{what} gives {slots // pp} per pipeline rank, which do not split over {vp} virtual "
                          f"stages; change the virtual pipeline size")
    sizes = [slots // (pp * vp)] * (pp * vp)
    sizes[0] -= embedding
    sizes[-1] -= loss
    return sizes


def _check_v(vp: int, first: int | None, last: int | None) -> None:
    """The V placement holds two chunks per rank and sizes no first/last stage."""
    if first is not None or last is not None:
        raise ConfigError("--decoder-first/last-pipeline-num-layers do not apply to the V-shaped schedules (rank 0 "
                          "holds the first and the last stage); drop them or use another --pipeline-schedule")
    if vp != 2:
        raise ConfigError(f"the V-shaped schedules hold two chunks per rank, got {vp}; set "
                          f"--num-virtual-stages-per-pipeline-rank 2")


def _stage_sizes(num_layers: int, pp: int, vp: int, first: int | None, last: int | None, style: str,
                 embedding: bool, loss: bool) -> list[int]:
    """Layers of each virtual stage, in stage order (stage k feeds stage k + 1)."""
    if (embedding or loss) and (first is not None or last is not None):
        raise ConfigError(f"{_ACCOUNT} and --decoder-first/last-pipeline-num-layers both size the end stages; "
                          f"give one or the other")
    if style == "v":
        _check_v(vp, first, last)
    if embedding or loss:
        return _accounted(num_layers, pp, vp, embedding, loss)
    if style == "v" and num_layers % (2 * pp):
        raise ConfigError(f"--num-layers {num_layers} must divide evenly over 2 x {pp} virtual stages; change "
                          f"--num-layers or --pipeline-model-parallel-size")
    counts = [num_layers // pp] * pp if style == "v" else _per_rank(num_layers, pp, first, last)
    for r, n in enumerate(counts):
        if n % vp:
            raise ConfigError(f"pipeline rank {r} holds {n} layers, which do not split over {vp} virtual stages; "
                              f"change the virtual pipeline size or the layer counts")
    return [counts[k % pp] // vp for k in range(pp * vp)]


def pipeline_layer_ranges(num_layers: int, pp: int, vp: int | None = None, first: int | None = None,
                          last: int | None = None, style: str = "loop", *, embedding: bool = False,
                          loss: bool = False) -> dict[tuple[int, int], tuple[int, int]]:
    """``{(pp_rank, vp_rank): (layer_offset, num_layers)}`` for every stage chunk; ``embedding`` / ``loss``:
    the ``--account-for-...-in-pipeline-split`` flags.

    Raises :class:`ConfigError` naming the flag when the layers do not split.
    """
    vp = vp or 1
    if num_layers < 1:
        raise ConfigError(f"--num-layers must be >= 1, got {num_layers}")
    sizes = _stage_sizes(num_layers, pp, vp, first, last, style, embedding, loss)
    offsets = [0, *accumulate(sizes)]
    return {(r, c): (offsets[k], sizes[k]) for c in range(vp) for r in range(pp)
            for k in [virtual_stage(r, c, pp, style)]}


def config_layer_ranges(num_layers: int, pc: ParallelConfig, style: str = "loop") -> dict:
    """:func:`pipeline_layer_ranges` of a :class:`ParallelConfig`'s layout (every flag that sizes the stages)."""
    return pipeline_layer_ranges(num_layers, pc.pipeline_model_parallel_size, pc.virtual_pipeline_model_parallel_size,
                                 pc.decoder_first_pipeline_num_layers, pc.decoder_last_pipeline_num_layers, style,
                                 embedding=pc.account_for_embedding_in_pipeline_split,
                                 loss=pc.account_for_loss_in_pipeline_split)


def virtual_pipeline_size(num_layers: int, pp: int, per_chunk: int | None, per_rank: int | None,
                          first: int | None = None, last: int | None = None, embedding: bool = False,
                          loss: bool = False) -> int | None:
    """The virtual pipeline size of ``--num-layers-per-virtual-pipeline-stage`` (``per_chunk``, layers per chunk,
    the embedding / loss slots included) or ``--num-virtual-stages-per-pipeline-rank`` (``per_rank``); None when
    neither is given. With set first/last stage sizes Megatron takes the chunk count only (``per_rank``)."""
    if per_chunk and per_rank:
        raise ConfigError("--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank both "
                          "set the virtual pipeline size; give one of them")
    if per_rank is not None:
        if per_rank < 1:
            raise ConfigError(f"--num-virtual-stages-per-pipeline-rank must be >= 1, got {per_rank}")
        return per_rank
    if not per_chunk:
        return None
    if first is not None or last is not None:
        raise ConfigError("--num-layers-per-virtual-pipeline-stage with --decoder-first/last-pipeline-num-layers: "
                          "the stages differ in size; give the chunks per rank with "
                          "--num-virtual-stages-per-pipeline-rank instead")
    slots = num_layers + embedding + loss
    if per_chunk < 0 or slots % (pp * per_chunk):
        what = f"--num-layers {num_layers}" + (f" + {slots - num_layers} ({_ACCOUNT})" if slots > num_layers else "")
        raise ConfigError(f"{what} is not divisible by --pipeline-model-parallel-size {pp} x "
                          f"--num-layers-per-virtual-pipeline-stage {per_chunk}")
    return slots // (pp * per_chunk)
