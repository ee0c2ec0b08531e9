"""Writing and reading checkpoint directories atomically.

Every rank writes its shard into ``iter_N.tmp/`` and fsyncs it; after a barrier rank 0 writes
``metadata.json``, renames the directory to ``iter_N`` and only then replaces ``latest`` (by
writing ``latest.tmp`` and renaming). A run killed at any point therefore leaves ``latest``
naming a complete checkpoint; re-saving an iteration swaps directories the way
:mod:`~omnitron.core.checkpoint.integrity` describes, so that holds then too. Shards are
``torch.save`` files of tensors and plain values, read back with ``weights_only=True`` (no
arbitrary unpickling), after their SHA-256 is checked against the one ``metadata.json`` records.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
from typing import Callable, Iterable

import torch

from omnitron.core.checkpoint import integrity

log = logging.getLogger("omnitron.checkpoint")
FORMAT_VERSION = 1
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")
_META = "metadata.json"
_META_KEYS = ("iteration", "world_size", "shards", "model", "layout")

# model fields that fix every tensor's shape: a checkpoint only loads into the same values
MODEL_SHAPE_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                    "kv_channels", "vocab_size", "make_vocab_size_divisible_by", "normalization", "swiglu",
                    "position_embedding_type", "untie_embeddings_and_output_weights", "add_bias_linear",
                    "qk_layernorm", "max_position_embeddings", "num_experts", "moe_ffn_hidden_size")
LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
               "context_parallel_size", "data_parallel_size", "decoder_first_pipeline_num_layers",
               "decoder_last_pipeline_num_layers", "expert_model_parallel_size", "expert_tensor_parallel_size",
               "pipeline_chunk_placement", "account_for_embedding_in_pipeline_split",
               "account_for_loss_in_pipeline_split")
_FLAGS = {"data_parallel_size": "the number of processes / data-parallel size",
          "pipeline_chunk_placement": "pipeline chunk placement (--pipeline-schedule)"}
# layout keys added after format 1 was fixed: an older checkpoint's missing key means this value
_LAYOUT_DEFAULTS = {"expert_model_parallel_size": 1, "expert_tensor_parallel_size": 1,
                    "pipeline_chunk_placement": "loop", "account_for_embedding_in_pipeline_split": False,
                    "account_for_loss_in_pipeline_split": False}


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or incompatible; the message says which and what to do."""


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


_fsync_dir = integrity.fsync_dir


def _write_file(path: str, write: Callable) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


class DiskFullError(CheckpointError):
    """A save ran out of disk space; its partial ``iter_N.tmp`` was removed (the message says so)."""


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_TEXT = ("no space left on device", "disk quota exceeded")
_SHORT_WRITE_TEXT = ("unexpected pos", "file write failed")  # torch's zip writer after a short write
LOW_SPACE_BYTES = 256 << 20
"""Free space under which a short write (torch's "unexpected pos") counts as a full disk."""


def _causes(err: BaseException):
    """``err``, its causes and contexts, and the per-rank failures a DCP ``CheckpointException`` carries."""
    todo, seen = [err], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)
        wrapped = [f[0] if isinstance(f, tuple) else f for f in failures.values()] \
            if isinstance(failures, dict) else []
        todo += [e.__cause__, e.__context__, *wrapped]


def disk_full(err: BaseException, directory: str) -> bool:
    """Whether ``err`` (raised while writing under ``directory``) means the disk is full: ENOSPC / EDQUOT
    anywhere in its chain, or a short write while ``directory``'s filesystem has under LOW_SPACE_BYTES free."""
    texts = []
    for e in _causes(err):
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            return True
        texts.append(str(e).lower())
    text = " ".join(texts)
    if any(t in text for t in _NO_SPACE_TEXT):
        return True
    return any(t in text for t in _SHORT_WRITE_TEXT) and _free_bytes(directory) < LOW_SPACE_BYTES


def _free_bytes(directory: str) -> int:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return 0


@contextlib.contextmanager
def removed_if_disk_full(save_dir: str, final: str):
    """Around a save of ``final`` (``iter_N``): when the disk fills up, remove the partial ``iter_N.tmp`` (and
    ``latest.tmp``), which would otherwise keep the space, and raise :class:`DiskFullError` in one line."""
    try:
        yield
    except BaseException as err:
        if isinstance(err, DiskFullError) or not disk_full(err, save_dir):
            raise
        shutil.rmtree(final + ".tmp", ignore_errors=True)
        with contextlib.suppress(OSError):
            os.remove(os.path.join(save_dir, "latest.tmp"))
        name = os.path.basename(final)
        raise DiskFullError(f"{save_dir}: the disk is full ({_free_bytes(save_dir) / 2**20:.0f} MiB free) while "
                            f"saving {name}; the partial {name}.tmp was removed and 'latest' still names the previous "
                            f"checkpoint; free space (or keep fewer with --keep-last-n) and resume with "
                            f"--load") from None


def save_checkpoint(save_dir: str, iteration: int, shard: dict, metadata: dict, *, rank: int, world_size: int,
                    barrier: Callable[[], None], keep_last_n: int | None = None) -> str:
    """Collective: every rank calls with its own ``shard``; returns the committed directory."""
    final = os.path.join(save_dir, iter_dir_name(iteration))
    if rank == 0:
        _begin(save_dir, final)
    barrier()
    with removed_if_disk_full(save_dir, final):
        _write_shard(final + ".tmp", rank, shard)
        barrier()
        if rank == 0:
            _commit(save_dir, iteration, metadata, world_size, keep_last_n)
    barrier()
    return final


def write_checkpoint(save_dir: str, iteration: int, shards: Iterable[tuple[int, dict]], metadata: dict, *,
                     world_size: int) -> str:
    """One process writes every rank's shard (offline conversion), then commits like
    :func:`save_checkpoint`. ``shards`` yields ``(rank, shard)``, so only one shard need be in memory."""
    final = os.path.join(save_dir, iter_dir_name(iteration))
    _begin(save_dir, final)
    written = set()
    with removed_if_disk_full(save_dir, final):
        for rank, shard in shards:
            _write_shard(final + ".tmp", rank, shard)
            written.add(rank)
        if written != set(range(world_size)):
            raise CheckpointError(f"{save_dir}: wrote shards for ranks {sorted(written)}, expected 0..{world_size - 1}")
        _commit(save_dir, iteration, metadata, world_size, None)
    return final


def _write_shard(tmp_dir: str, rank: int, shard: dict) -> None:
    """``rank_N.pt`` and its digest file (folded into metadata.json by the commit)."""
    path = os.path.join(tmp_dir, shard_name(rank))
    _write_file(path, lambda f: torch.save(shard, f))
    integrity.write_digest(path)


def _begin(save_dir: str, final: str) -> None:
    """An empty ``iter_N.tmp`` (a stale one, left by a run killed while saving, is removed), after
    finishing any re-save that died between its renames."""
    os.makedirs(save_dir, exist_ok=True)
    for path in integrity.repair(save_dir, _META):
        log.warning("%s: finished a re-save that was interrupted between its renames", path)
    if os.path.exists(final + ".tmp"):
        shutil.rmtree(final + ".tmp")
    os.makedirs(final + ".tmp")


def _commit(save_dir: str, iteration: int, metadata: dict, world_size: int, keep_last_n: int | None,
            extra: list[str] = ()) -> None:
    """Write metadata.json into ``iter_N.tmp``, rename it to ``iter_N``, then move ``latest``.
    ``extra``: files besides the rank shards whose writers left digests (``torch_dist``'s DCP files)."""
    final = os.path.join(save_dir, iter_dir_name(iteration))
    tmp = final + ".tmp"
    names = [shard_name(r) for r in range(world_size)]
    try:
        checksums = integrity.collect_digests(tmp, names + list(extra))
    except integrity.IntegrityError as err:
        raise CheckpointError(str(err)) from None
    meta = dict(metadata, format_version=FORMAT_VERSION, iteration=iteration, world_size=world_size,
                shards=names, checksums=checksums)
    _write_file(os.path.join(tmp, _META), lambda f: f.write(json.dumps(meta, indent=1).encode()))
    _fsync_dir(tmp)
    integrity.commit_dir(tmp, final)
    pointer = os.path.join(save_dir, "latest.tmp")
    _write_file(pointer, lambda f: f.write(iter_dir_name(iteration).encode()))
    os.replace(pointer, os.path.join(save_dir, "latest"))
    _fsync_dir(save_dir)
    if keep_last_n:
        _prune(save_dir, keep_last_n, keep=iter_dir_name(iteration))


def list_checkpoints(save_dir: str) -> list[int]:
    """Iterations of complete checkpoint directories, ascending (a re-save caught between its
    renames counts: :func:`integrity.resolve` finds its complete copy)."""
    if not os.path.isdir(save_dir):
        return []
    its = {int(m.group(1)) for d in os.listdir(save_dir) if (m := _ITER_DIR.match(d.removesuffix(".replaced")))}
    return sorted(it for it in its if integrity.resolve(os.path.join(save_dir, iter_dir_name(it)), _META))


def _prune(save_dir: str, keep_last_n: int, keep: str) -> None:
    for it in list_checkpoints(save_dir)[:-keep_last_n]:
        if iter_dir_name(it) != keep:
            shutil.rmtree(os.path.join(save_dir, iter_dir_name(it)), ignore_errors=True)


def find_latest(load_dir: str, *, quiet: bool = False) -> str | None:
    """The complete directory ``latest`` names (None when ``load_dir`` holds no checkpoint yet).

    Without ``latest`` (never written, or deleted) the newest complete ``iter_*`` directory is
    used and a warning says so (unless ``quiet``); committed directories that are all incomplete
    raise CheckpointError saying which file is missing."""
    pointer = os.path.join(load_dir, "latest")
    if not os.path.exists(pointer):
        return _newest_complete(load_dir, quiet)
    with open(pointer, "rb") as f:
        name = f.read(64).decode("utf-8", "replace").strip()
    if not _ITER_DIR.match(name):
        raise CheckpointError(f"--load {load_dir}: 'latest' holds {name!r}, not an iter_NNNNNNN directory name; "
                              f"write the name of a complete iter_* directory into it, or delete it")
    path = integrity.resolve(os.path.join(load_dir, name), _META)
    if path is None:
        raise CheckpointError(f"--load {load_dir}: 'latest' names {name}, which is missing or incomplete; "
                              f"point 'latest' at a complete iter_* directory or remove it")
    return path


def _newest_complete(load_dir: str, quiet: bool) -> str | None:
    its = list_checkpoints(load_dir)
    dirs = sorted(d for d in os.listdir(load_dir) if _ITER_DIR.match(d)) if os.path.isdir(load_dir) else []
    if its:
        path = integrity.resolve(os.path.join(load_dir, iter_dir_name(its[-1])), _META)
        newer = [d for d in dirs if int(d[5:]) > its[-1]]
        if not quiet:
            log.warning("--load %s: no 'latest' pointer; loading the newest complete checkpoint, %s%s", load_dir,
                        os.path.basename(path), f" (skipping {', '.join(newer)}: no {_META})" if newer else "")
        return path
    if dirs and os.path.exists(os.path.join(load_dir, "latest_checkpointed_iteration.txt")):  # Megatron's tracker
        raise CheckpointError(f"--load {load_dir} is a Megatron-LM checkpoint (latest_checkpointed_iteration.txt, "
                              f"no {_META}): convert it with `omnitron checkpoint import-megatron --load {load_dir} "
                              f"--save NEW_DIR` and give --load NEW_DIR")
    if dirs:
        raise CheckpointError(f"--load {load_dir}: no 'latest' pointer and no complete checkpoint "
                              f"({', '.join(dirs[-3:])} {'has' if len(dirs) == 1 else 'have'} no {_META}); restore "
                              f"{_META} or 'latest', "
                              f"or move the iter_* directories away to start from scratch")
    return None


def read_metadata(path: str) -> dict:
    """``path/metadata.json``; missing, unparsable or incomplete metadata raises CheckpointError naming it."""
    file = os.path.join(path, _META)
    try:
        with open(file, "rb") as f:
            meta = json.loads(f.read())
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing: the checkpoint is incomplete; load an earlier iteration, or "
                              f"re-save") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{file} is not valid JSON ({err}): the metadata is corrupt; load an earlier "
                              f"iteration, or re-save") from None
    missing = [k for k in _META_KEYS if k not in meta] if isinstance(meta, dict) else ["everything (not an object)"]
    if missing:
        raise CheckpointError(f"{file} lacks {', '.join(missing)}: the metadata is corrupt or not omnitron's; load "
                              f"an earlier iteration, or re-save")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format_version')} is not "
                              f"{FORMAT_VERSION}, which this omnitron reads")
    return meta


def check_compatible(meta: dict, model: dict, layout: dict, path: str, *, reshard: bool = False) -> list[str]:
    """Raise CheckpointError naming the first model-shape setting that differs from the checkpoint's.

    Returns the layout settings that differ (``"tensor_model_parallel_size 2 -> 1"``); a layout
    difference raises too unless ``reshard`` (the caller then reshards on load).
    """
    for key in MODEL_SHAPE_KEYS:
        saved, now = meta["model"].get(key), model.get(key)
        if saved != now:
            raise CheckpointError(f"--load {path}: the checkpoint has --{key.replace('_', '-')} {saved}, this run "
                                  f"{now}; use the checkpoint's model settings")
    changes = []
    for key in LAYOUT_KEYS:
        saved, now = meta["layout"].get(key, _LAYOUT_DEFAULTS.get(key)), layout.get(key, _LAYOUT_DEFAULTS.get(key))
        if saved != now:
            if not reshard:
                flag = _FLAGS.get(key, "--" + key.replace("_", "-"))
                raise CheckpointError(f"--load {path}: saved with {flag} {saved}, this run uses {now}; resume with "
                                      f"the same parallel layout, or convert it with `omnitron checkpoint convert`")
            changes.append(f"{key} {saved} -> {now}")
    return changes


def load_checkpoint(path: str, rank: int) -> tuple[dict, dict]:
    """(metadata, this rank's shard), the shard checksum-verified and read with ``weights_only=True``."""
    meta = read_metadata(path)
    return meta, read_shard(path, rank, meta)


def read_shard(path: str, rank: int, meta: dict | None = None) -> dict:
    """Shard ``rank`` of checkpoint directory ``path`` (``weights_only=True``), after checking its
    SHA-256 against ``meta`` (read from ``path`` when not given); a missing, corrupt or unreadable
    file raises CheckpointError naming it. Checkpoints written before checksums load unverified."""
    shard_path = os.path.join(path, shard_name(rank))
    if not os.path.exists(shard_path):
        raise CheckpointError(f"{path}: shard {shard_name(rank)} is missing; the checkpoint is incomplete "
                              f"(load an earlier iteration, or re-save)")
    checksums = (meta or read_metadata(path)).get("checksums")
    if checksums is not None and shard_name(rank) not in checksums:
        raise CheckpointError(f"{shard_path} has no checksum in {_META}: the metadata is corrupt; load an earlier "
                              f"iteration, or re-save")
    try:
        if checksums is not None:  # NOTE: hashing on a thread beside torch.load was no faster here (2 cores)
            integrity.verify(shard_path, checksums[shard_name(rank)])
    except integrity.IntegrityError as err:
        raise CheckpointError(f"{err}; load an earlier iteration (point 'latest' at it), or re-save") from None
    try:
        return torch.load(shard_path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated file, bad zip, refused pickle: all mean "cannot use this shard"
        raise CheckpointError(f"{shard_path} is unreadable ({torch_load_reason(err)}); the checkpoint is "
                              f"corrupt: load an earlier iteration, or re-save") from err


def torch_load_reason(err: Exception) -> str:
    """Why ``torch.load`` failed, in one line: a weights-only refusal's own reason, without torch's advice
    to load with ``weights_only=False`` (the unsafe thing); else the message, squashed."""
    text = str(err)
    refusal = re.search(r"WeightsUnpickler error: (.*?)(?:\.\s|$)", text, re.S)
    if refusal:
        return "weights-only refusal: " + " ".join(refusal.group(1).split())[:200]
    return f"{type(err).__name__}: " + " ".join(text.split())[:300]
