"""Megatron-LM's legacy distributed-optimizer file, ``distrib_optim.pt`` (``--ckpt-format torch`` with
``--use-distributed-optimizer``), decoded to per-parameter Adam state.

One file per tensor x pipeline rank (``iter_N/mp_rank_TT[_PPP]/distrib_optim.pt``), written by data-parallel rank 0
(megatron-core's ``DistributedOptimizer.save_parameter_state`` / ``get_parameter_state_dp_zero``)::

    {"buckets_coalesced": True,
     k: {(param_dtype, grad_dtype): {"param": f32[n], "exp_avg": f32[n], "exp_avg_sq": f32[n], "numel_unpadded": n}}}

``k`` numbers the gradient buffers of the rank's model chunks in order (one dense buffer a chunk here). Each
tensor is the whole buffer gathered from every data-parallel rank's shards, bucket by bucket, each bucket cut to
its ``numel_unpadded`` elements (the padding at bucket ends dropped; the 64-element alignment gaps before
parameters kept). Where a parameter sits follows from megatron-core's buffer layout
(:func:`omnitron.core.parallel.data.buffers.layout`, the same as omnitron's) with the bucket size Megatron's run
used (:func:`bucket_sizes`), so the file is decoded without Megatron's code and without unpickling anything but
tensors, dtypes and containers (``torch.load(weights_only=True)``).
"""
from __future__ import annotations

import torch

from omnitron.core.checkpoint.megatron_base import MegatronConversionError

FILE = "distrib_optim.pt"
KEYS = ("param", "exp_avg", "exp_avg_sq")


def bucket_sizes(args: dict, chunks: int, pp_rank: int, num_parameters: int) -> list[int | None]:
    """The bucket size (None: one bucket) of each of a pipeline rank's ``chunks`` model chunks in the Megatron run
    of ``args`` (its saved argparse values): Megatron's rule, which omnitron's wrapper follows
    (:func:`omnitron.core.parallel.data.config.bucket_elements`), with ``--ddp-num-buckets`` dividing the rank's
    ``num_parameters``; buckets only with --overlap-grad-reduce, only in the first chunk of the first stage."""
    from omnitron.core.parallel.data.config import DataParallelConfig, bucket_elements

    overlap = bool(args.get("overlap_grad_reduce"))
    size = args.get("ddp_bucket_size")
    if args.get("ddp_num_buckets"):
        size = num_parameters // int(args["ddp_num_buckets"])
    dp_cp = data_parallel_size(args) * int(args.get("context_parallel_size") or 1)
    ddp = DataParallelConfig(overlap_grad_reduce=overlap, bucket_size=size or None)
    first = not args.get("overlap_param_gather_with_optimizer_step")
    return [bucket_elements(ddp, dp_cp, bucketing=first and c == 0 and pp_rank == 0) for c in range(chunks)]


def data_parallel_size(args: dict) -> int:
    """Megatron's data-parallel size: ``args.data_parallel_size``, else world / (tp x pp x cp)."""
    if args.get("data_parallel_size"):
        return int(args["data_parallel_size"])
    model = int(args.get("tensor_model_parallel_size") or 1) * int(args.get("pipeline_model_parallel_size") or 1)
    return int(args.get("world_size") or model) // (model * int(args.get("context_parallel_size") or 1))


def decode(state, chunks: list[list[tuple[str, int, bool]]], buckets: list[int | None], dp_cp: int,
           where: str) -> list[dict[str, dict[str, torch.Tensor]]]:
    """Per model chunk, per parameter name (local layer numbers: names repeat across chunks), its flat ``param`` /
    ``exp_avg`` / ``exp_avg_sq`` from one loaded ``distrib_optim.pt`` ``state``. ``chunks``: per model chunk its
    trainable parameters in registration order, each ``(name, numel, shared_embedding)`` (a tied embedding's copy
    with pipeline stages gets a bucket of its own); ``buckets``: each
    chunk's bucket size (:func:`bucket_sizes`); ``dp_cp``: the replicas the buffer was sharded over; ``where``
    names the file in errors. Raises :class:`MegatronConversionError` in one line where the file's layout is not
    this model's (naming the expected and the found sizes)."""
    from omnitron.core.parallel.data.buffers import layout

    if isinstance(state, list):
        raise MegatronConversionError(f"{where}: a chained optimizer's states ({len(state)}: MoE expert or "
                                      f"per-dtype optimizers); only one dense optimizer is read")
    if not isinstance(state, dict) or state.get("buckets_coalesced") is not True:
        raise MegatronConversionError(f"{where}: not a coalesced distrib_optim.pt (buckets_coalesced missing: an "
                                      f"older per-bucket format); re-save it with a current Megatron-LM")
    found = sorted(k for k in state if k != "buckets_coalesced")
    if found != list(range(len(chunks))):
        raise MegatronConversionError(f"{where}: holds buffers {found}, expected one per model chunk "
                                      f"{list(range(len(chunks)))}; the file belongs to another model or layout")
    out: list[dict[str, dict[str, torch.Tensor]]] = []
    for k, (params, bucket) in enumerate(zip(chunks, buckets)):
        if len(state[k]) != 1:
            raise MegatronConversionError(f"{where}: buffer {k} has {len(state[k])} dtype groups, expected 1")
        (world,) = state[k].values()
        back = params[::-1]  # Megatron lays a buffer out in backward order
        ranges, bounds = layout([n for _, n, _ in back], bucket, dp_cp, sharded=True,
                                isolate=[s for _, _, s in back])
        want = sum(u for _, _, u in bounds)
        for key in ("numel_unpadded",) + KEYS:
            got = world.get(key) if isinstance(world, dict) else None
            size = got if key == "numel_unpadded" else getattr(got, "shape", None)
            if size not in (want, (want,)):
                raise MegatronConversionError(
                    f"{where}: buffer {k} {key} holds {size} elements, this model's layout {want} (chunk {k}: "
                    f"{len(params)} parameters, {sum(n for _, n, _ in params)} elements, bucket size {bucket}, "
                    f"dp x cp {dp_cp}); give import-megatron the checkpoint's own model")
        compact, start, mine = [], 0, {}
        for _, _, u in bounds:  # each bucket's first element in the file
            compact.append(start)
            start += u
        for (name, n, _), (s0, _, b) in zip(back, ranges):
            at = compact[b] + s0 - bounds[b][0]
            mine[name] = {key: world[key][at:at + n].clone() for key in KEYS}
        out.append(mine)
    return out


def read(path: str, chunks, buckets, dp_cp: int) -> list[dict[str, dict[str, torch.Tensor]]]:
    """:func:`decode` of the file at ``path``, read by :func:`~omnitron.core.checkpoint.safe_load.load_untrusted`
    (``torch.load(weights_only=True)`` after the pickle's names are checked: tensors, dtypes and containers)."""
    from omnitron.core.checkpoint.io import CheckpointError
    from omnitron.core.checkpoint.safe_load import load_untrusted

    try:
        state = load_untrusted(path, what="a Megatron distrib_optim.pt", fix="import only checkpoints from a "
                               "trusted Megatron run")
    except CheckpointError as err:
        raise MegatronConversionError(str(err)) from None
    return decode(state, chunks, buckets, dp_cp, path)


def stage_params(sd: dict, pp: int, tied: bool) -> list[tuple[str, int, bool]]:
    """A model chunk's trainable parameters ``(name, numel, shared_embedding)`` in registration order, from its
    saved state dict ``sd`` (Megatron's state dict lists them in that order; TE metadata and RoPE frequencies are
    not parameters). megatron-core flags the tied embedding's two copies when pipelined (``pp`` > 1, ``tied``):
    the word embedding of a chunk without the output layer, the output layer of a chunk without the embedding."""
    from omnitron.core.checkpoint.megatron_base import _NOT_WEIGHTS

    names = [n for n, t in sd.items() if torch.is_tensor(t) and not n.endswith(_NOT_WEIGHTS)]
    emb, out = "embedding.word_embeddings.weight", "output_layer.weight"
    shared = set()
    if pp > 1 and tied and (emb in names) != (out in names):
        shared = {emb, out}
    return [(n, sd[n].numel(), n in shared) for n in names]


def read_rank_moments(iter_dir: str, args: dict, shards: dict, rank_dir) -> dict | None:
    """``{key: {(tp_rank, pp_rank): [per chunk {name: tensor in the parameter's shape}]}}`` for ``key`` in
    ``exp_avg`` / ``exp_avg_sq`` / ``param`` (fp32 main parameters), from every rank's ``distrib_optim.pt`` of the
    Megatron iteration directory ``iter_dir`` (``args``, ``shards``: :func:`~omnitron.core.checkpoint.megatron.
    read_shards`'; ``rank_dir(tp_rank, pp_rank, pp)``: a rank's directory name, its ``rank_dir``); None when no
    rank has one (no distributed optimizer, or saved without its state)."""
    import os

    pp = int(args.get("pipeline_model_parallel_size") or 1)
    paths = {tp: os.path.join(iter_dir, rank_dir(*tp, pp), FILE) for tp in shards}
    have = [tp for tp, p in paths.items() if os.path.isfile(p)]
    if not have:
        return None
    if len(have) != len(paths):
        gone = next(p for tp, p in paths.items() if tp not in have)
        raise MegatronConversionError(f"{gone} is missing while other ranks have theirs; copy every mp_rank_* "
                                      f"directory's distrib_optim.pt, or remove them all to import weights only")
    if int(args.get("num_distributed_optimizer_instances") or 1) != 1:
        raise MegatronConversionError(f"{iter_dir}: --num-distributed-optimizer-instances "
                                      f"{args['num_distributed_optimizer_instances']}: only one instance is read")
    tied = not args.get("untie_embeddings_and_output_weights")
    dp_cp = data_parallel_size(args) * int(args.get("context_parallel_size") or 1)
    out: dict = {key: {} for key in KEYS}
    for (t, p), chunks in shards.items():
        params = [stage_params(sd, pp, tied) for sd in chunks]
        buckets = bucket_sizes(args, len(chunks), p, sum(n for c in params for _, n, _ in c))
        flat = read(paths[(t, p)], params, buckets, dp_cp)
        for key in KEYS:
            out[key][(t, p)] = [{n: f[n][key].view(sd[n].shape) for n, _, _ in c}
                                for c, f, sd in zip(params, flat, chunks)]
    return out
