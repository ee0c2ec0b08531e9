"""``--ckpt-format torch_dist``: training checkpoints through ``torch.distributed.checkpoint`` (DCP).

Directory (committed like every omnitron checkpoint: written as ``iter_N.tmp``, SHA-256 per file,
``metadata.json`` last, renamed, then ``latest`` moved; :mod:`omnitron.core.checkpoint.io`)::

    iter_N/__R_0.distcp   rank R's pieces of the global tensors (DCP's files, one per writing rank)
    iter_N/.metadata      DCP's global index (which chunk of which tensor lives where)
    iter_N/rank_R.pt      rank R's own state: RNG streams, tensor-parallel trackers, FP8 histories
    iter_N/metadata.json  iteration, samples, config, layout, optimizer step + loss scaler, scheduler,
                          checksums of every file above

Keys are layout-independent: ``model/<global name>`` (:func:`~.dist_layout.global_name`),
``optim/<kind>/<global name>`` (kind: ``exp_avg``, ``exp_avg_sq``, ``momentum``, ``master`` for
low-precision parameters), each a global tensor (:mod:`~omnitron.core.checkpoint.dist_layout`). Who
writes what (:func:`_share`): weights and the plain optimizer's state, which the data x context parallel
ranks of a model-parallel position hold as copies, once between them, each rank a ``1 / (dp x cp)`` part
of every tensor (:func:`_spread`: the largest writer about the mean; a parameter replicated over tp by tp
rank 0's replicas);
the distributed optimizer's state by every rank, its own flat-buffer slices only, mapped to boxes of the
global tensors -- nothing is gathered (DCP's planning exchanges only the small plans), and nothing is
copied: DCP writes straight from the live buffers (:func:`~.dist_planner.exact_storage`). Under FSDP2
(``--use-torch-fsdp2``) every rank writes its own row shards of the weights and of the optimizer state, the
same way (disjoint over dp x cp; nothing gathered).
The last pipeline stage's copy of a tied embedding is not written (it equals the first stage's) and
is read from the embedding's key.

Loading under any layout (tp, pp, vpp, dp, distributed optimizer on or off): every rank asks DCP for
exactly its pieces, which DCP reads from whatever saved chunks overlap them. RNG streams and FP8
histories are per rank: they load under the same layout only (the caller logs when they do not).
Offline readers (``checkpoint convert|inspect|export``, the HF and Megatron exporters) get full
tensors through :func:`read_full`: one process, no process group. ``--async-save``: the same
:func:`begin` / :func:`write` / :func:`commit`, the write on a thread over a host snapshot
(:mod:`~omnitron.core.checkpoint.dist_async`).
MoE experts are global tensors of their own (named by global expert index), spread over the edp ranks
(each ep rank holds its experts; the distributed optimizer's expert slices, disjoint over edp, by every
edp rank); replicated-KV attention writes its parts of the canonical ``linear_qkv`` (``linear_kv`` by
tp rank 0), so any number of query groups per tp rank reads them.
"""
from __future__ import annotations

import contextlib
import glob
import os
import warnings

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_meta
from torch.distributed.tensor import DTensor

from omnitron.core.checkpoint import integrity, io
from omnitron.core.checkpoint.dist_layout import (global_name, global_shape, row_pieces, shard_pieces, slice_pieces,
                                                  tp_writer)
from omnitron.core.checkpoint.dist_planner import Pieces, PieceLoadPlanner, PieceSavePlanner, VerifiedReader
from omnitron.core.checkpoint.io import CheckpointError
from omnitron.core.optim.optimizer import keeps_master
from omnitron.core.parallel.data.fsdp import local_shard, shard_offset
from omnitron.core.parallel.tensor.mappings import local_rank

FORMAT = "torch_dist"


@contextlib.contextmanager
def _one_line(what: str, path: str):
    """DCP reports a failure on any rank to every rank as a multi-line ``CheckpointException`` (a
    BaseException): raise the first failure as one CheckpointError line instead (on every rank alike)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as err:
        rank, (exc, _) = sorted(err.failures.items())[0]
        if isinstance(exc, CheckpointError):
            raise CheckpointError(str(exc)) from None
        why = " ".join(str(exc).split())[:300] + io.size_limit_hint(exc)
        todo = ("nothing was committed: 'latest' still names the previous checkpoint; fix the cause and resume "
                "with --load" if what == "save" else "load an earlier iteration, or re-save")
        raise CheckpointError(f"{path}: torch_dist {what} failed on rank {rank} ({type(exc).__name__}: {why}); "
                              f"{todo}") from None


def _split(c, p) -> tuple[int, int]:
    """``(size, rank)`` of the group ``p`` is split over: etp for MoE experts, tp otherwise."""
    g = c.groups.etp if getattr(p, "expert", False) else c.groups.tp
    return g.size, local_rank(g)


def _share(c, p, *, replicas: bool) -> tuple[int, int] | None:
    """``(index, count)``: this rank writes part ``index`` of ``count`` of ``p``'s pieces on save (:func:`_spread`),
    None: nothing (exactly one writer per byte). ``replicas``: the data-parallel ranks hold copies (weights, the
    plain optimizer's state), so the ranks of dp x cp (of edp for experts) each write a ``1 / count`` part; the
    distributed optimizer's slices and FSDP2's shards are disjoint over those groups and written whole."""
    if getattr(p, "shared_embedding", False):
        return None  # the last stage's tied copy equals the first stage's embedding
    if not tp_writer(p, _split(c, p)[1]):
        return None
    if not replicas:
        return 0, 1
    replicated_over = c.groups.edp if getattr(p, "expert", False) else c.groups.dp_cp
    return local_rank(replicated_over), replicated_over.size


def _spread(pieces: list, index: int, count: int) -> list:
    """Part ``index`` of ``count`` of each piece: its first dimension longer than 1 cut into near-equal spans
    (a narrowing there keeps a contiguous view contiguous, so DCP still writes it without a copy). Replicas
    then write a replicated tensor once between them, each about ``1 / count`` of it, instead of rank 0
    writing all of it (629 MiB against 210 MiB at dp4 in BENCHMARKS.md)."""
    if count == 1:
        return pieces
    out = []
    for off, view in pieces:
        if view.dim() == 0:
            out += [(off, view)] if index == 0 else []
            continue
        d = next((i for i, n in enumerate(view.shape) if n > 1), 0)
        lo, hi = view.shape[d] * index // count, view.shape[d] * (index + 1) // count
        if hi > lo:
            out.append((off[:d] + (off[d] + lo,) + off[d + 1:], view.narrow(d, lo, hi - lo)))
    return out


def _add(table: Pieces, key: str, shape, pieces) -> None:
    if pieces:
        table.setdefault(key, (tuple(shape), []))[1].extend(pieces)


def model_pieces(c, *, save: bool) -> Pieces:
    """``model/<name>`` pieces of this rank's weights (on save: its part of those it writes, :func:`_share`)."""
    table: Pieces = {}
    for m in c.modules:
        for name, p in m.named_parameters():
            fsdp = isinstance(p, DTensor)
            share = _share(c, p, replicas=not fsdp) if save else (0, 1)
            if share is None:
                continue
            split = _split(c, p)
            pieces = row_pieces(p, split, local_shard(p.detach()), shard_offset(p)) if fsdp else \
                shard_pieces(p, split, p.detach())
            _add(table, "model/" + global_name(name, p), global_shape(p, split[0]), _spread(pieces, *share))
    return table


def optimizer_pieces(c, *, save: bool, state: dict | None = None, masters: list | None = None) -> Pieces:
    """``optim/<kind>/<name>`` pieces of this rank's optimizer state: the distributed optimizer's own
    slices, or (plain optimizer) the whole local shards (on save: its part of those it writes, :func:`_share`).
    ``state``: the tensors by kind (default: the optimizer's ``saved_state()``, fp16 moments unscaled in fp32);
    ``masters``: the fp32 masters (default: ``saved_masters()``, remainders joined into fp32)."""
    opt, table = c.optimizer, {}
    state = opt.saved_state() if state is None else state
    if masters is None and any(keeps_master(p.dtype) for p in opt.params):
        masters = opt.saved_masters()
    sliced = hasattr(opt, "slices")
    owners = [s.param for s in opt.slices] if sliced else range(len(opt.params))
    for j, i in enumerate(owners):
        p, name = opt.params[i], opt.names[i].split(".", 1)[1]  # the optimizer names chunk<c>.<name>
        fsdp = isinstance(p, DTensor)  # FSDP2: the state is shaped like the parameter's local shard
        share = _share(c, p, replicas=not (sliced or fsdp)) if save else (0, 1)
        if share is None:
            continue
        name, split = global_name(name, p), _split(c, p)
        kinds = dict(state)
        if keeps_master(p.dtype):  # fp32 and float64 weights are their own masters
            kinds["master"] = masters
        for kind, values in kinds.items():
            if not opt.keeps(kind, i):  # Muon's matrices keep no exp_avg_sq
                continue
            t = values[j]
            if fsdp:
                pieces = row_pieces(p, split, t, shard_offset(p))
            else:
                pieces = slice_pieces(p, split, t, opt.slices[j].lo) if sliced else shard_pieces(p, split, t)
            _add(table, f"optim/{kind}/{name}", global_shape(p, split[0]), _spread(pieces, *share))
    return table


def rank_state(c, get_rng_state) -> dict:
    """What only this rank has: RNG streams, tracker states, FP8 histories, the optimizer's per-rank state
    (1-bit Adam's error feedback), the routers' expert biases (``rank_R.pt``)."""
    out = {"rng": get_rng_state(c.backend), "trackers": [m.rng_tracker.get_states() for m in c.modules]}
    optimizer = c.optimizer.rank_state_dict()
    if optimizer is not None:
        out["optimizer_rank"] = optimizer
    fp8 = c.extra.get("fp8_state")
    if fp8 is not None:
        out["fp8"] = fp8()
    from omnitron.core.transformer.moe.router import expert_bias_state

    bias = expert_bias_state(c.modules)  # buffers, not parameters: kept with this rank's state
    if any(bias):
        out["expert_bias"] = bias
    return out


def optimizer_meta(c) -> dict:
    """The optimizer's non-tensor state (the same on every rank): step, name, loss scaler."""
    out = {"step": c.optimizer.step_count, "optimizer": c.optimizer.config.optimizer}
    if c.optimizer.loss_scaler is not None:
        out["loss_scaler"] = c.optimizer.loss_scaler.state_dict()
    return out


def save(c, save_dir: str, iteration: int, meta: dict, local: dict, *, barrier, keep_last_n=None,
         retain_interval=None) -> str:
    """Collective over the world: DCP writes every rank's pieces, each rank its ``rank_R.pt``; rank 0
    commits (see the module docstring). Returns the committed directory."""
    final = begin(c, save_dir, iteration, barrier)
    with io.removed_if_write_fails(save_dir, final):
        write(final + ".tmp", c.groups.rank, {**model_pieces(c, save=True), **optimizer_pieces(c, save=True)}, local)
        commit(c, save_dir, iteration, meta, barrier=barrier, keep_last_n=keep_last_n, retain_interval=retain_interval)
    return final


class _RecordingWriter(FileSystemWriter):
    """A :class:`FileSystemWriter` that keeps this rank's written chunks (``written``: DCP ``_StorageInfo`` of
    file, offset, length) from its own ``write_data`` results: the ``Metadata`` that ``dcp.save`` returns
    carries them on some torch versions only (its ``storage_data`` is None on 2.9)."""

    written: list = []
    shapes: dict = {}
    """``{(file, offset, length): (saved chunk sizes, bytes per element)}`` of the tensors written (the row
    layout of each chunk's block digests: :func:`~.dist_slices.chunk_layout`)."""

    def write_data(self, plan, planner):
        tensors = {item.index: item.tensor_data for item in plan.items if item.tensor_data is not None}

        def keep(fut):
            results = fut.value()
            self.written = [r.storage_data for r in results]
            self.shapes = {(r.storage_data.relative_path, r.storage_data.offset, r.storage_data.length):
                           (tuple(tensors[r.index].chunk.sizes), tensors[r.index].properties.dtype.itemsize)
                           for r in results if r.index in tensors}
            return results

        return super().write_data(plan, planner).then(keep)


def _row_layouts(path: str, name: str, ranges, shapes: dict) -> dict:
    """``{(offset, length): (start, piece, end)}``: each tensor chunk's bytes cut at row-aligned pieces for its block
    digests (:func:`~.dist_slices.chunk_layout`), so a reader of a column slice reads only its own bytes."""
    from omnitron.core.checkpoint.dist_slices import chunk_layout

    out = {}
    for off, n in ranges:
        if (name, off, n) in shapes:
            layout = chunk_layout(path, off, n, *shapes[(name, off, n)], integrity.BLOCK)
            if layout is not None:
                out[(off, n)] = layout
    return out


def begin(c, save_dir: str, iteration: int, barrier) -> str:
    """Collective: rank 0 makes an empty ``iter_N.tmp`` (:func:`io._begin`); returns ``iter_N``'s path."""
    final = os.path.join(save_dir, io.iter_dir_name(iteration))
    if c.groups.rank == 0:
        io._begin(save_dir, final)
    barrier()
    return final


def write(tmp: str, rank: int, pieces: Pieces, local: dict, group=None, *, collective: bool = True) -> None:
    """Collective over ``group`` (default: the world; none without a process group, or when not
    ``collective``: one process writing alone): DCP writes ``pieces`` into ``tmp``, this rank's files get
    their digests, then its ``rank_R.pt``. Touches no live tensor beyond ``pieces`` (so it can run on a
    thread, over a snapshot)."""
    import torch.distributed.checkpoint as dcp

    writer = _RecordingWriter(tmp, single_file_per_rank=True, sync_files=True, thread_count=1)
    with _one_line("save", tmp), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: intended
        dcp.save(pieces, storage_writer=writer, planner=PieceSavePlanner(), process_group=group,
                 no_dist=not collective)
    for f in glob.glob(os.path.join(glob.escape(tmp), f"__{rank}_*.distcp")):  # digests of the file and its chunks
        name = os.path.basename(f)
        ranges = [(i.offset, i.length) for i in writer.written if i.relative_path == name]
        integrity.write_chunk_index(f, ranges, _row_layouts(f, name, ranges, writer.shapes))
    if rank == 0:
        integrity.write_digest(os.path.join(tmp, ".metadata"))
    io._write_shard(tmp, rank, local)


def commit(c, save_dir: str, iteration: int, meta: dict, *, barrier, keep_last_n=None, retain_interval=None) -> None:
    """Collective: once every rank's :func:`write` is done, rank 0 commits ``iter_N`` (checksums into
    metadata.json, rename, then ``latest``)."""
    barrier()
    if c.groups.rank == 0:
        _commit_files(save_dir, iteration, meta, c.groups.world_size, keep_last_n, retain_interval)
    barrier()


def _commit_files(save_dir: str, iteration: int, meta: dict, world_size: int, keep_last_n,
                  retain_interval=None) -> None:
    """:func:`io._commit` of ``iter_N.tmp`` with DCP's files (``.metadata`` and every ``__R_0.distcp``)."""
    tmp = os.path.join(save_dir, io.iter_dir_name(iteration) + ".tmp")
    files = sorted(os.path.basename(f) for f in glob.glob(os.path.join(glob.escape(tmp), "__*.distcp")))
    io._commit(save_dir, iteration, dict(meta, ckpt_format=FORMAT, dcp_files=files), world_size, keep_last_n,
               extra=[".metadata", *files, *(f + integrity.CHUNK_INDEX for f in files)],
               retain_interval=retain_interval)


def write_full(save_dir: str, full, chunks, meta: dict, world_size: int) -> str:
    """Offline, one process: :class:`~omnitron.core.checkpoint.reshard.FullState` ``full`` as a torch_dist
    checkpoint of ``world_size`` ranks (``meta``: its layout and config) under ``save_dir``; returns the
    ``iter_N`` directory. Every global tensor is written whole, in one DCP file (a load under any layout
    reads its slices from it); ``chunks``: skeletons holding every parameter (tp1 pp1), whose attributes
    give each global tensor's form. The ranks' files hold no RNG state (a resume draws fresh streams); each holds
    every router's expert bias (per-rank state in a trained checkpoint: the same on every rank of a stage)."""
    pieces: Pieces = {}
    for m in chunks:
        for name, p in m.named_parameters():
            name = global_name(name, p)
            kinds = [("model/" + name, full.model)] + [(f"optim/{k}/{name}", d) for k, d in full.optimizer.items()]
            for key, tensors in kinds:
                if name in tensors and key not in pieces:
                    pieces[key] = _whole(p, tensors[name], key)
    iteration = int(full.meta["iteration"])
    io.refuse_overwrite(save_dir, iteration)
    final = os.path.join(save_dir, io.iter_dir_name(iteration))
    io._begin(save_dir, final)
    # the routers' expert biases (buffers): every rank file holds them all (E floats per layer), by global name
    biases = {n: t for n, t in full.model.items() if n.endswith(".mlp.router.expert_bias")}
    local = {"expert_bias": [biases]} if biases else {}
    with io.removed_if_write_fails(save_dir, final):
        write(final + ".tmp", 0, pieces, local, collective=False)
        for r in range(1, world_size):
            io._write_shard(final + ".tmp", r, local)
        meta = dict(meta, optimizer=full.optimizer_meta, scheduler=full.scheduler)
        _commit_files(save_dir, iteration, meta, world_size, None)
    return final


def _whole(p: torch.Tensor, t: torch.Tensor, key: str):
    """The one-piece entry of full tensor ``t`` of parameter ``p`` (a tp1 skeleton's) as its global tensor:
    a partition stride's blocks stacked on a leading axis (the inverse of :func:`_unstride`)."""
    g = torch.stack(t.chunk(p.partition_stride, dim=p.partition_dim)) if len(global_shape(p, 1)) > t.dim() else t
    if tuple(g.shape) != global_shape(p, 1):
        raise CheckpointError(f"{key}: the full tensor is {tuple(t.shape)}, the model's global tensor "
                              f"{global_shape(p, 1)}; the checkpoint does not match its own model config")
    return tuple(g.shape), [((0,) * g.dim(), g.contiguous())]


def load(c, path: str, meta: dict, *, with_optimizer: bool) -> None:
    """Collective over the world: read this rank's weights (and optimizer pieces) from checkpoint
    ``path`` (any layout) into the live tensors. Counters, scheduler and RNG are the caller's."""
    pieces = model_pieces(c, save=False)
    reader = VerifiedReader(path, meta.get("checksums") or {})
    if with_optimizer:
        saved = meta.get("optimizer", {}).get("optimizer")
        if saved != c.optimizer.config.optimizer:
            raise CheckpointError(f"--load {path}: checkpoint optimizer {saved!r} differs from --optimizer "
                                  f"{c.optimizer.config.optimizer!r}; pass the same --optimizer or use --no-load-optim")
        staged = c.optimizer.saved_state()  # fp16 moments are read unscaled, then scaled (TE's set_scaled_state)
        masters = c.optimizer.saved_masters()  # remainders: read in fp32, then split (TE's set_scaled_state)
        pieces.update(optimizer_pieces(c, save=False, state=staged, masters=masters))
        pieces = fp32_sources(pieces, reader.read_metadata().state_dict_metadata)
    read(pieces, path, meta.get("checksums") or {}, reader=reader)
    if with_optimizer:
        c.optimizer.load_saved_state(staged)
        c.optimizer.load_saved_masters(masters)


def fp32_sources(pieces: Pieces, saved: dict) -> Pieces:
    """``pieces`` with each weight read from the checkpoint's fp32 copy of it wherever the two runs keep that copy
    under different keys, or keep their weights in different dtypes: a low-precision run (bf16 / fp16 weights beside
    fp32 masters, ``optim/master/X``) and one whose weights are the fp32 masters (an fp32 run, FSDP2's sharded
    parameters; ``model/X`` only), or a --bf16 run and an --fp16 one (each weight is its master rounded once into
    this run's dtype, not the other run's rounded weight rounded again). So a resume across ``--bf16`` / ``--fp16``
    / fp32, or between FSDP2 and the (distributed) optimizer, reads the masters bit for bit instead of refusing (no
    ``optim/master/X`` saved) or rounding them to the saved bf16 weights. Only with the optimizer state:
    ``--no-load-optim`` / ``--finetune`` take the weights as saved."""
    out: Pieces = {}
    for key, (shape, views) in pieces.items():
        kind, _, name = key.partition("/")
        master = "optim/master/" + name
        if kind == "model" and master in saved and all(_from_master(v.dtype, saved.get(key)) for _, v in views):
            key = master  # the checkpoint's master, not its rounded weight
        elif key.startswith("optim/master/") and key not in saved:
            key = "model/" + key.removeprefix("optim/master/")  # the checkpoint's weights were its masters
        out.setdefault(key, (shape, []))[1].extend(views)
    return out


def _from_master(dtype: torch.dtype, weight) -> bool:
    """Whether a ``dtype`` weight is read from the checkpoint's master rather than its saved ``weight`` (DCP's
    metadata): an fp32 / float64 weight (its own master), or one of another dtype than the saved weight."""
    return not keeps_master(dtype) or not isinstance(weight, dcp_meta.TensorStorageMetadata) or \
        weight.properties.dtype != dtype


def read(pieces: Pieces, path: str, checksums: dict[str, str], *, collective: bool = True,
         reader: VerifiedReader | None = None) -> VerifiedReader:
    """Fill every piece of ``pieces`` from checkpoint directory ``path``, each file verified against
    ``checksums`` first (``reader``: another program's checkpoint, a
    :class:`~omnitron.core.checkpoint.dist_planner.ForeignReader`). Collective over the world when a process
    group exists, unless not ``collective`` (one process reading alone: DCP then plans locally, whatever the
    process group). Returns the reader (its ``read_bytes``: the tensor bytes this rank read)."""
    import torch.distributed.checkpoint as dcp

    reader = reader or VerifiedReader(path, checksums)
    reader.read_metadata()  # a missing, flipped or foreign .metadata: one CheckpointError, before DCP
    with torch.no_grad(), _one_line("load", path), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: intended
        dcp.load(pieces, storage_reader=reader, planner=PieceLoadPlanner(path), no_dist=not collective)
    return reader


def read_full(path: str, meta: dict, chunks, tp: int, *, keep, with_optimizer: bool) -> tuple[dict, dict]:
    """``(model, {kind: optimizer})`` full tensors (unpadded, by global name, as
    :class:`~omnitron.core.checkpoint.reshard.FullState` holds them) of the parameters of ``chunks``
    (skeletons of the saved layout, tensor-parallel size ``tp``) whose name passes ``keep``. One process,
    no communication: each global tensor is read whole in one DCP load, from whatever chunks hold it.
    Experts come whole and replicated-KV attention as the canonical ``linear_qkv`` (as
    :func:`~omnitron.core.checkpoint.reshard.read_full_state` fuses the other format's)."""
    checksums = meta.get("checksums") or {}
    saved = VerifiedReader(path, checksums).read_metadata().state_dict_metadata
    kinds = sorted({k.split("/")[1] for k in saved if k.startswith("optim/")}) if with_optimizer else []
    pieces, params = {}, {}
    for m in chunks:
        for name, p in m.named_parameters():
            if getattr(p, "shared_embedding", False) or not keep(name):
                continue  # the last stage's tied copy is not written (it equals the embedding)
            name = global_name(name, p)  # replicated KV: linear_q and linear_kv both read linear_qkv
            keys = ["model/" + name] + [f"optim/{k}/{name}" for k in kinds if f"optim/{k}/{name}" in saved]
            for key in (k for k in keys if k not in pieces):
                md = saved.get(key)
                dtype = md.properties.dtype if isinstance(md, dcp_meta.TensorStorageMetadata) else p.dtype
                t = torch.empty(global_shape(p, tp), dtype=dtype)
                pieces[key] = (tuple(t.shape), [((0,) * t.dim(), t)])
                params[key] = p
    read(pieces, path, checksums, collective=False)  # a missing or misshapen key is a CheckpointError
    model, optim = {}, {}
    for key, (_, [(_, t)]) in pieces.items():
        what, _, name = key.partition("/")
        if what == "optim":
            kind, _, name = name.partition("/")
        full = _unstride(params[key], t)
        (model if what == "model" else optim.setdefault(kind, {}))[name] = full
    return model, optim


def _unstride(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The full tensor of ``p`` from its global tensor ``t``: a partition stride's leading block axis
    concatenated back along the partition dimension (:mod:`~omnitron.core.checkpoint.dist_layout`)."""
    if t.dim() == p.dim():
        return t
    return torch.cat(list(t.unbind(0)), dim=p.partition_dim)
