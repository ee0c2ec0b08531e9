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
import pickle
import pickletools
import re
import shutil
import warnings
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
                    "qk_layernorm", "max_position_embeddings", "num_experts", "moe_ffn_hidden_size", "add_qkv_bias")
# model keys added after format 1 was fixed (or a family without the field): a missing key means this value
_MODEL_DEFAULTS = {"add_qkv_bias": False}
# values that hold the same tensors: RoPE with or without YaRN's scaling (the settings check compares those)
_SAME_SHAPES = {("position_embedding_type", "yarn"): "rope"}
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


LOAD_EARLIER = "load an earlier iteration (--ckpt-step N, or point 'latest' at it), or re-save"
"""What to do about a damaged checkpoint, ending the line that names the damage."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or incompatible; the message says which and what to do."""


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


_fsync_dir = integrity.fsync_dir


def bare_file_name(name) -> bool:
    """Whether ``name``, read from a file, names a file directly inside the directory it is joined to: a string
    with no separator, not ``.`` or ``..`` and not absolute (else a crafted index could point a reader anywhere)."""
    return (isinstance(name, str) and name not in ("", ".", "..") and os.path.basename(name) == name
            and "\\" not in name and "\0" not in name and not os.path.isabs(name))


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


def size_limit_hint(err: BaseException) -> str:
    """``" (errno EFBIG: ...)"`` when ``err`` is a short write (torch's zip writer hides the errno: "unexpected pos")
    and this process has a file-size limit (RLIMIT_FSIZE, ``ulimit -f``, a scheduler's): the likely cause, which
    the message would not name otherwise; else ''."""
    text = " ".join(str(e).lower() for e in _causes(err))
    if not (any(t in text for t in _SHORT_WRITE_TEXT) or "file too large" in text):
        return ""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError):
        return ""
    if limit == resource.RLIM_INFINITY:
        return ""
    return (f" (errno EFBIG: a file reached this process's file-size limit, RLIMIT_FSIZE / ulimit -f, of "
            f"{limit} bytes)")


def _free_bytes(directory: str) -> int:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return 0


def _write_failed(err: BaseException) -> bool:
    """An OSError anywhere in ``err``'s chain, or torch's zip writer's short write (which hides its errno)."""
    causes = list(_causes(err))
    return any(isinstance(e, OSError) for e in causes) or any(
        t in str(e).lower() for e in causes for t in _SHORT_WRITE_TEXT)


@contextlib.contextmanager
def removed_if_write_fails(save_dir: str, final: str):
    """Around a save of ``final`` (``iter_N``): when writing fails, remove the partial ``iter_N.tmp`` (and
    ``latest.tmp``), which would otherwise keep the space, and raise in one line naming the cause and its errno
    (:class:`DiskFullError` for a full disk; a file-size limit named, :func:`size_limit_hint`)."""
    try:
        yield
    except BaseException as err:
        if isinstance(err, Exception) and not os.path.isdir(final + ".tmp") and not os.path.isdir(final):
            raise _vanished(save_dir, os.path.basename(final)) from None
        full = not isinstance(err, DiskFullError) and disk_full(err, save_dir)
        if not full and (isinstance(err, DiskFullError) or not _write_failed(err)):
            raise
        shutil.rmtree(final + ".tmp", ignore_errors=True)
        with contextlib.suppress(OSError):
            os.remove(os.path.join(save_dir, "latest.tmp"))
        name = os.path.basename(final)
        if not full and isinstance(err, CheckpointError):  # one line already (torch_dist's, naming the rank)
            raise
        if not full:
            why = " ".join(str(err).split())[:300] + size_limit_hint(err)
            raise CheckpointError(f"{save_dir}: saving {name} failed ({type(err).__name__}: {why}); the partial "
                                  f"{name}.tmp was removed and 'latest' still names the previous checkpoint; fix the "
                                  f"cause and resume with --load") from None
        raise DiskFullError(f"{save_dir}: the disk is full ({_free_bytes(save_dir) / 2**20:.0f} MiB free) while "
                            f"saving {name}; the partial {name}.tmp was removed and 'latest' still names the previous "
                            f"checkpoint; free space (or keep fewer with --keep-last-n) and resume with "
                            f"--load") from None


class SaveDirGone(CheckpointError):
    """--save (or the save's ``iter_N.tmp``) was deleted by something outside the job while a save wrote into it."""


def _vanished(save_dir: str, name: str) -> SaveDirGone:
    """The one line for a save whose directory was deleted under it: what is lost, what is left (the checkpoint
    to resume from, where ``save_dir`` still holds one), what to do."""
    lost = "by something outside this job: that save is lost"
    if not os.path.isdir(save_dir):
        return SaveDirGone(f"--save {save_dir} was deleted while saving {name}, {lost}, and with it every "
                           f"checkpoint the directory held; the run stops here. Keep --save in place while a job "
                           f"runs; resume with --load from a copy kept elsewhere, or start afresh")
    try:
        left = find_latest(save_dir, quiet=True)
    except CheckpointError:  # 'latest' damaged too: the newest complete one
        its = list_checkpoints(save_dir)
        left = os.path.join(save_dir, iter_dir_name(its[-1])) if its else None
    what = f"{name}.tmp under --save {save_dir} was deleted while saving {name}, {lost}; the run stops here."
    if left is None:
        return SaveDirGone(f"{what} --save holds no complete checkpoint: keep --save in place while a job runs, and "
                           f"start again (from the checkpoint this run was loaded from, if any)")
    previous = os.path.basename(left).split(".")[0]  # iter_N (of iter_N.replaced while a re-save was caught)
    return SaveDirGone(f"{what} The previous checkpoint, {previous}, is intact: resume from it with "
                       f"--load {save_dir} (and keep --save in place while a job runs)")


def save_checkpoint(save_dir: str, iteration: int, shard: dict, metadata: dict, *, rank: int, world_size: int,
                    barrier: Callable[[], None], keep_last_n: int | None = None,
                    retain_interval: int | None = None) -> str:
    """Collective: every rank calls with its own ``shard``; returns the committed directory. ``keep_last_n`` and
    ``retain_interval``: which older checkpoints the commit deletes (:func:`_commit`)."""
    final = os.path.join(save_dir, iter_dir_name(iteration))
    if rank == 0:
        _begin(save_dir, final)
    barrier()
    with removed_if_write_fails(save_dir, final):
        _write_shard(final + ".tmp", rank, shard)
        barrier()
        if rank == 0:
            _commit(save_dir, iteration, metadata, world_size, keep_last_n, retain_interval=retain_interval)
    barrier()
    return final


def write_checkpoint(save_dir: str, iteration: int, shards: Iterable[tuple[int, dict]], metadata: dict, *,
                     world_size: int) -> str:
    """One process writes every rank's shard (offline conversion), then commits like
    :func:`save_checkpoint`. ``shards`` yields ``(rank, shard)``, so only one shard need be in memory.
    Never replaces a checkpoint (:func:`refuse_overwrite`)."""
    refuse_overwrite(save_dir, iteration)
    final = os.path.join(save_dir, iter_dir_name(iteration))
    _begin(save_dir, final)
    written = set()
    with removed_if_write_fails(save_dir, final):
        for rank, shard in shards:
            _write_shard(final + ".tmp", rank, shard)
            written.add(rank)
        if written != set(range(world_size)):
            raise CheckpointError(f"{save_dir}: wrote shards for ranks {sorted(written)}, expected 0..{world_size - 1}")
        _commit(save_dir, iteration, metadata, world_size, None)
    return final


def refuse_overwrite(save_dir: str, iteration: int, *, load: Iterable[str] = (), flag: str = "--save") -> None:
    """An offline writer (``checkpoint convert``, ``import-hf``, ``import-megatron``, ``export-megatron``) never
    replaces a checkpoint: raise CheckpointError in one line when ``save_dir`` is (or resolves to) one of the
    ``load`` directories it reads (the ``--load`` argument, the ``iter_N`` it resolved to), or already holds the
    ``iter_N`` of ``iteration``. Called before anything is read or written. (A training run re-saving an
    iteration is another matter: :func:`save_checkpoint` swaps the new copy in whole.)"""
    real = os.path.realpath(save_dir)
    for src in load:
        dirs = {os.path.realpath(src)}
        if _ITER_DIR.match(os.path.basename(os.path.normpath(src))):  # an iter_N: its --save directory too
            dirs.add(os.path.realpath(os.path.dirname(os.path.abspath(src))))
        if real in dirs:
            raise CheckpointError(f"{flag} {save_dir} is the directory --load reads ({src}): writing there would "
                                  f"replace its checkpoints and 'latest'; give {flag} an empty directory")
    name = iter_dir_name(iteration)
    final = os.path.join(save_dir, name)
    if os.path.lexists(final) or os.path.lexists(final + ".replaced"):
        raise CheckpointError(f"{flag} {save_dir} already holds {name}, which this would overwrite (and point "
                              f"'latest' at); give {flag} an empty directory, or remove {final} first")


def _write_shard(tmp_dir: str, rank: int, shard: dict) -> None:
    """``rank_N.pt`` and its digest file (folded into metadata.json by the commit)."""
    path = os.path.join(tmp_dir, shard_name(rank))
    _write_file(path, lambda f: torch.save(shard, f))
    integrity.write_digest(path)


def _begin(save_dir: str, final: str) -> None:
    """An empty ``iter_N.tmp`` (a stale one, left by a run killed while saving, is removed), after
    finishing any re-save that died between its renames and removing the partial writes of other iterations."""
    os.makedirs(save_dir, exist_ok=True)
    for path in integrity.repair(save_dir, _META):
        log.warning("%s: finished a re-save that was interrupted between its renames", path)
    _remove_partial_saves(save_dir)
    if os.path.exists(final + ".tmp"):
        shutil.rmtree(final + ".tmp")
    os.makedirs(final + ".tmp")


def _remove_partial_saves(save_dir: str) -> None:
    """Remove every ``iter_M.tmp`` without metadata.json: the partial write of a save that was killed (SIGKILL
    after a scheduler's grace time, a node lost), which no load uses and no later save of another iteration
    removed, so each kept a checkpoint's worth of disk for good. Called as a save begins, when no other save
    of this job is writing (``--async-save`` waits for the one in flight first; the job holds --save's lock).
    A complete ``iter_M.tmp`` (killed between its metadata and its rename) is a checkpoint: it stays."""
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name)
        if _ITER_DIR.match(name.removesuffix(".tmp")) and name.endswith(".tmp") and os.path.isdir(path) and \
                not os.path.isfile(os.path.join(path, _META)):
            size = sum(e.stat().st_size for e in os.scandir(path) if e.is_file(follow_symlinks=False))
            shutil.rmtree(path, ignore_errors=True)
            log.warning("%s: removed %s (%.0f MiB), the partial write of a save that did not finish", save_dir,
                        name, size / 2**20)


def _commit(save_dir: str, iteration: int, metadata: dict, world_size: int, keep_last_n: int | None,
            extra: list[str] = (), retain_interval: int | None = None) -> None:
    """Write metadata.json into ``iter_N.tmp``, rename it to ``iter_N``, then move ``latest``; then delete what
    --keep-last-n and --save-retain-interval (:func:`_retire`) leave out.
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
    previous = _pointed(save_dir)
    pointer = os.path.join(save_dir, "latest.tmp")
    _write_file(pointer, lambda f: f.write(iter_dir_name(iteration).encode()))
    os.replace(pointer, os.path.join(save_dir, "latest"))
    _fsync_dir(save_dir)
    if keep_last_n:
        _prune(save_dir, keep_last_n, keep=iter_dir_name(iteration))
    if retain_interval and previous is not None:
        _retire(save_dir, previous, iteration, retain_interval)


def _pointed(save_dir: str) -> int | None:
    """The iteration ``latest`` names (None: no pointer, or not an iter_N name)."""
    try:
        with open(os.path.join(save_dir, "latest"), "rb") as f:
            found = _ITER_DIR.match(f.read(64).decode("utf-8", "replace").strip())
    except OSError:
        return None
    return int(found.group(1)) if found else None


def _retire(save_dir: str, previous: int, iteration: int, retain_interval: int) -> None:
    """--save-retain-interval, as Megatron's: once ``iteration`` is committed, the checkpoint ``latest`` named
    before (``previous``) is deleted unless it is a multiple of ``retain_interval`` (or this same iteration, or
    a symbolic link): a run keeps every multiple and its newest checkpoint."""
    path = os.path.join(save_dir, iter_dir_name(previous))
    if previous in (0, iteration) or previous % retain_interval == 0 or os.path.islink(path):
        return
    shutil.rmtree(path, ignore_errors=True)
    log.info("--save-retain-interval %d: deleted %s (kept: multiples of %d and the newest)", retain_interval,
             path, retain_interval)


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


def find_latest(load_dir: str, *, quiet: bool = False, step: int | None = None) -> str | None:
    """The complete directory ``latest`` names (None when ``load_dir`` holds no checkpoint yet); with ``step``
    (--ckpt-step, Megatron's: a checkpoint other than the newest, e.g. when the newest is damaged) that
    iteration's, whatever ``latest`` says.

    Without ``latest`` (never written, or deleted) the newest complete ``iter_*`` directory is
    used and a warning says so (unless ``quiet``); committed directories that are all incomplete
    raise CheckpointError saying which file is missing."""
    if step is not None:
        return _at_step(load_dir, step)
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
        raise CheckpointError(f"--load {load_dir}: 'latest' names {name}, which is missing or incomplete; load "
                              f"another with --ckpt-step ITERATION{_complete_ones(load_dir)}, point 'latest' at a "
                              f"complete iter_* directory or remove it")
    return path


def _complete_ones(load_dir: str) -> str:
    """`` (complete: 2, 4)``: the iterations of ``load_dir``'s complete checkpoints, for a message ('' if none)."""
    its = list_checkpoints(load_dir)
    return f" (complete: {', '.join(map(str, its[-4:]))})" if its else ""


def _at_step(load_dir: str, step: int) -> str:
    """The complete checkpoint directory of iteration ``step`` under ``load_dir`` (--ckpt-step)."""
    path = integrity.resolve(os.path.join(load_dir, iter_dir_name(step)), _META)
    if path is None:
        others = _complete_ones(load_dir) or " (it holds none)"
        raise CheckpointError(f"--ckpt-step {step}: --load {load_dir} has no complete {iter_dir_name(step)}"
                              f"{others}; give the iteration of a complete checkpoint")
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
        raise _megatron_checkpoint(load_dir, f"latest_checkpointed_iteration.txt, no {_META}")
    if dirs:
        raise CheckpointError(f"--load {load_dir}: no 'latest' pointer and no complete checkpoint "
                              f"({', '.join(dirs[-3:])} {'has' if len(dirs) == 1 else 'have'} no {_META}); restore "
                              f"{_META} or 'latest', "
                              f"or move the iter_* directories away to start from scratch")
    return None


def _megatron_checkpoint(load_dir: str, sign: str) -> CheckpointError:
    """The one-line error for a Megatron-LM checkpoint given where omnitron's own is read (``sign``: what gave
    it away): the command that converts it, and what the conversion carries (weights, not the optimizer)."""
    return CheckpointError(f"--load {load_dir} is a Megatron-LM checkpoint ({sign}): convert it with `omnitron "
                           f"checkpoint import-megatron --load {load_dir} --save NEW_DIR` and give --load NEW_DIR "
                           f"(weights only: Megatron's optimizer and RNG state are not carried; training starts "
                           f"as --finetune)")


def read_metadata(path: str) -> dict:
    """``path/metadata.json``; missing, unparsable or incomplete metadata, or a field of the wrong type
    (:data:`_META_TYPES`), raises CheckpointError naming the file (and the field)."""
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
    if isinstance(meta, dict) and "sharded_backend" in meta:  # Megatron-Core's dist_checkpointing config
        raise _megatron_checkpoint(os.path.dirname(os.path.abspath(path)),
                                   f"--ckpt-format {meta['sharded_backend']}: {_META} names a sharded backend")
    missing = [k for k in _META_KEYS if k not in meta] if isinstance(meta, dict) else ["everything (not an object)"]
    if missing:
        raise CheckpointError(f"{file} lacks {', '.join(missing)}: the metadata is corrupt or not omnitron's; load "
                              f"an earlier iteration, or re-save")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format_version')} is not "
                              f"{FORMAT_VERSION}, which this omnitron reads")
    for key, (ok, what) in _META_TYPES.items():
        if key in meta and not ok(meta[key]):
            shown = json.dumps(meta[key])
            raise CheckpointError(f"{file}: '{key}' is {shown if len(shown) <= 40 else shown[:37] + '...'}, not "
                                  f"{what}: the metadata is corrupt or not omnitron's; load an earlier iteration, "
                                  f"or re-save")
    return meta


def _count(v, least: int = 0) -> bool:
    return type(v) is int and v >= least


def _strings(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


# the types of the metadata fields omnitron reads (those it writes; a field may be absent where _META_KEYS allows)
_META_TYPES = {
    "iteration": (_count, "an integer >= 0"),
    "world_size": (lambda v: _count(v, 1), "an integer >= 1"),
    "consumed_samples": (_count, "an integer >= 0"),
    "shards": (_strings, "a list of file names"),
    "dcp_files": (_strings, "a list of file names"),
    "model": (lambda v: isinstance(v, dict), "an object of model settings"),
    "layout": (lambda v: isinstance(v, dict), "an object of parallel-layout settings"),
    "config": (lambda v: isinstance(v, dict), "an object of run settings"),
    "optimizer": (lambda v: isinstance(v, dict), "an object"),
    "scheduler": (lambda v: isinstance(v, dict), "an object"),
    "resharded_from": (lambda v: v is None or isinstance(v, dict), "an object of parallel-layout settings"),
    "imported_from": (lambda v: isinstance(v, dict), "an object"),
    "checksums": (lambda v: v is None or (isinstance(v, dict) and all(isinstance(x, str) for x in v.values())),
                  "an object of file name -> digest strings"),
    "ckpt_format": (lambda v: v in ("torch", "torch_dist"), '"torch" or "torch_dist"'),
}


def saved_expert_tp(meta: dict) -> int:
    """The experts' tensor-parallel split the shards of checkpoint ``meta`` hold: the one its writer recorded in
    the layout (training: --expert-tensor-parallel-size, unset meaning tp; import-hf, import-megatron and convert
    write whole experts: 1). Only a checkpoint older than that record falls back to its run's flat setting (unset:
    tp, training's default); one with no such setting (an import's or conversion's) and a dense model's hold 1."""
    recorded = meta["layout"].get("expert_tensor_parallel_size")
    if recorded is not None:
        return int(recorded)
    flat = meta.get("config", {})
    if not meta["model"].get("num_experts") or "expert_tensor_parallel_size" not in flat:
        return 1
    return int(flat["expert_tensor_parallel_size"] or meta["layout"].get("tensor_model_parallel_size") or 1)


def check_compatible(meta: dict, model: dict, layout: dict, path: str, *, reshard: bool = False) -> list[str]:
    """Raise CheckpointError naming the first model-shape setting that differs from the checkpoint's.

    Returns the layout settings that differ (``"tensor_model_parallel_size 2 -> 1"``); a layout
    difference raises too unless ``reshard`` (the caller then reshards on load).
    """
    for key in MODEL_SHAPE_KEYS:
        saved, now = meta["model"].get(key, _MODEL_DEFAULTS.get(key)), model.get(key, _MODEL_DEFAULTS.get(key))
        if _SAME_SHAPES.get((key, saved), saved) != _SAME_SHAPES.get((key, now), now):
            raise CheckpointError(f"--load {path}: the checkpoint has --{key.replace('_', '-')} {saved}, this run "
                                  f"{now}; use the checkpoint's model settings")
    changes = []
    for key in LAYOUT_KEYS:
        saved, now = meta["layout"].get(key, _LAYOUT_DEFAULTS.get(key)), layout.get(key, _LAYOUT_DEFAULTS.get(key))
        if key == "expert_tensor_parallel_size":  # what the shards hold, older metadata included (None: 1)
            saved, now = saved_expert_tp(meta), now or 1
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
        raise CheckpointError(f"{err}; {LOAD_EARLIER}") from None
    with open(shard_path, "rb") as f:
        problem = zip_record_problem(f)
    if problem:
        raise CheckpointError(f"{shard_path}: refused: {problem}; it is not a shard omnitron wrote (replaced, tampered "
                              f"with or damaged): load an earlier iteration, or re-save")
    try:
        with quiet_torch_load():
            return torch.load(shard_path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated file, bad zip, refused pickle: all mean "cannot use this shard"
        why = torch_load_reason(err)
        if why.startswith(REFUSAL):
            raise CheckpointError(f"{shard_path}: refused as unsafe by torch's weights-only loader "
                                  f"({why.removeprefix(REFUSAL)}); nothing in it was run; it is not a shard omnitron "
                                  f"wrote (replaced, tampered with or damaged): load an earlier iteration, or "
                                  f"re-save") from None
        raise CheckpointError(f"{shard_path} is unreadable ({why}); the checkpoint is corrupt: load an earlier "
                              f"iteration, or re-save") from err


REFUSAL = "weights-only refusal: "
"""The prefix of :func:`torch_load_reason` for a file torch's weights-only unpickler refused."""
# torch's own reasons (torch/_weights_only_unpickler.py, 2.4 to 2.15), their first sentence
_REFUSAL_REASONS = re.compile(
    r"Unsupported global: GLOBAL \S+|unsupported GLOBAL \S+ whose module \S+ is blocked|Unsupported operand \d+"
    r"|Trying to call reduce for unrecognized function [^\n]*?(?=\.?\s*$|\.?\n)|Can only [^\n]*?(?=\.?\n|\.?$)"
    r"|\S+ must be (?:imported|\S+) to load [^\n]*?(?=\.?\n|\.?$)|unsupported persistent id encountered"
    r"|String is too long", re.I)
# sentences of torch's wrapping to drop: advice to load unsafely or to allow-list, links, the headline
_ADVICE = re.compile(r"weights_only|weights only load failed|safe_globals|trust|torch\.load|file an issue|"
                     r"In PyTorch 2\.\d|can still be loaded|options|recommended steps|https?://|documentation",
                     re.I)


def zip_record_problem(f) -> str | None:
    """What makes the ``torch.save`` zip archive in seekable binary file ``f`` unsafe to hand to ``torch.load``
    (None: nothing; a file that is not a readable zip archive is left to the loader). ``torch.save`` stores every record
    uncompressed, but torch's reader also inflates compressed ones, allocating the size a record declares: a
    crafted file of a few megabytes would claim gigabytes. So a compressed record, or one whose declared size
    does not fit in the archive, is refused before loading."""
    import zipfile

    size = f.seek(0, os.SEEK_END)
    f.seek(0)
    if f.read(4) != b"PK\x03\x04":
        return None
    try:
        with zipfile.ZipFile(f) as archive:
            records = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return None  # damaged, not crafted: the loader names it unreadable
    for r in records:
        if r.compress_type != zipfile.ZIP_STORED:
            return (f"record {r.filename[:100]!r} is compressed (method {r.compress_type}), which torch.save never "
                    f"writes (a compressed record can expand far beyond the file)")
        if r.file_size != r.compress_size or r.header_offset + r.file_size > size:
            return f"record {r.filename[:100]!r} declares {r.file_size} bytes, more than the archive holds"
    return None


@contextlib.contextmanager
def quiet_torch_load():
    """Around ``torch.load(weights_only=True)`` of a file that may be foreign: torch's warning about a pickle
    protocol its weights-only loader does not expect (printed with a source line) is not for the user; the
    refusal that follows says what is wrong, in one line."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"(?s).*pickle protocol", category=UserWarning)
        yield


def torch_load_reason(err: Exception) -> str:
    """Why ``torch.load`` failed, in one line. A refusal by torch's weights-only unpickler (any
    ``pickle.UnpicklingError`` from ``torch.load(weights_only=True)``) is ``REFUSAL`` + the unpickler's own
    reason (the global, opcode or call it refused), never torch's advice to load with ``weights_only=False``
    or to allow-list the global (the unsafe things); else the type and the message, squashed."""
    text = str(err)
    if isinstance(err, pickle.UnpicklingError) or re.search(r"weights.only load failed", text, re.I):
        inner = err.__context__  # torch re-raises the unpickler's error ``from None``: its plain reason
        return REFUSAL + _refusal_reason(str(inner) if isinstance(inner, pickle.UnpicklingError) else text)
    text = " ".join(text.split())
    if "weights_only" in text:  # never pass on advice to load unsafely
        text = " ".join(s for s in re.split(r"(?<=\.)\s+", text) if not _ADVICE.search(s))
    return f"{type(err).__name__}: " + text[:300]


def _refusal_reason(text: str) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    found = _REFUSAL_REASONS.search(text)
    if found:
        why = found.group(0)
    else:  # wording of a torch not seen here: its sentences less the advice
        text = text.split("WeightsUnpickler error:")[-1]
        kept = [s for s in re.split(r"(?<=\.)\s+|\n+", text) if s.strip() and not _ADVICE.search(s)]
        why = " ".join(kept) or "it holds something other than tensors and plain values"
    why = " ".join(why.split()).rstrip(".")[:200]
    op = re.fullmatch(r"Unsupported operand (\d+)", why, re.I)
    if op and int(op.group(1)) < 256 and chr(int(op.group(1))) in pickletools.code2op:  # name the opcode
        why += f": pickle opcode {pickletools.code2op[chr(int(op.group(1)))].name}, which torch.save never writes"
    return why
