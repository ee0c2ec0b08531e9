"""Writing and reading checkpoint directories atomically.

Every rank writes its shard into ``iter_N.tmp/`` and fsyncs it; after a barrier rank 0 writes
``metadata.json``, renames the directory to ``iter_N`` and only then replaces ``latest`` (by
writing ``latest.tmp`` and renaming). A run killed at any point therefore leaves ``latest``
naming a complete checkpoint. Shards are ``torch.save`` files of tensors and plain values,
read back with ``weights_only=True`` (no arbitrary unpickling).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Callable, Iterable

import torch

FORMAT_VERSION = 1
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")

# model fields that fix every tensor's shape: a checkpoint only loads into the same values
MODEL_SHAPE_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                    "kv_channels", "vocab_size", "make_vocab_size_divisible_by", "normalization", "swiglu",
                    "position_embedding_type", "untie_embeddings_and_output_weights", "add_bias_linear",
                    "qk_layernorm", "max_position_embeddings", "num_experts", "moe_ffn_hidden_size")
LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
               "context_parallel_size", "data_parallel_size", "decoder_first_pipeline_num_layers",
               "decoder_last_pipeline_num_layers", "expert_model_parallel_size", "expert_tensor_parallel_size")
_FLAGS = {"data_parallel_size": "the number of processes / data-parallel size"}
# layout keys added after format 1 was fixed: an older checkpoint's missing key means this value
_LAYOUT_DEFAULTS = {"expert_model_parallel_size": 1, "expert_tensor_parallel_size": 1}


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or incompatible; the message says which and what to do."""


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: str, write: Callable) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(save_dir: str, iteration: int, shard: dict, metadata: dict, *, rank: int, world_size: int,
                    barrier: Callable[[], None], keep_last_n: int | None = None) -> str:
    """Collective: every rank calls with its own ``shard``; returns the committed directory."""
    final = os.path.join(save_dir, iter_dir_name(iteration))
    if rank == 0:
        _begin(save_dir, final)
    barrier()
    _write_file(os.path.join(final + ".tmp", shard_name(rank)), lambda f: torch.save(shard, f))
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
    for rank, shard in shards:
        _write_file(os.path.join(final + ".tmp", shard_name(rank)), lambda f, s=shard: torch.save(s, f))
        written.add(rank)
    if written != set(range(world_size)):
        raise CheckpointError(f"{save_dir}: wrote shards for ranks {sorted(written)}, expected 0..{world_size - 1}")
    _commit(save_dir, iteration, metadata, world_size, None)
    return final


def _begin(save_dir: str, final: str) -> None:
    """An empty ``iter_N.tmp`` (a stale one, left by a run killed while saving, is removed)."""
    os.makedirs(save_dir, exist_ok=True)
    if os.path.exists(final + ".tmp"):
        shutil.rmtree(final + ".tmp")
    os.makedirs(final + ".tmp")


def _commit(save_dir: str, iteration: int, metadata: dict, world_size: int, keep_last_n: int | None) -> None:
    """Write metadata.json into ``iter_N.tmp``, rename it to ``iter_N``, then move ``latest``."""
    final = os.path.join(save_dir, iter_dir_name(iteration))
    tmp = final + ".tmp"
    meta = dict(metadata, format_version=FORMAT_VERSION, iteration=iteration, world_size=world_size,
                shards=[shard_name(r) for r in range(world_size)])
    _write_file(os.path.join(tmp, "metadata.json"), lambda f: f.write(json.dumps(meta, indent=1).encode()))
    _fsync_dir(tmp)
    replaced = None
    if os.path.exists(final):
        replaced = final + ".replaced"
        os.rename(final, replaced)
    os.rename(tmp, final)
    _fsync_dir(save_dir)
    pointer = os.path.join(save_dir, "latest.tmp")
    _write_file(pointer, lambda f: f.write(iter_dir_name(iteration).encode()))
    os.replace(pointer, os.path.join(save_dir, "latest"))
    _fsync_dir(save_dir)
    if replaced:
        shutil.rmtree(replaced, ignore_errors=True)
    if keep_last_n:
        _prune(save_dir, keep_last_n, keep=iter_dir_name(iteration))


def list_checkpoints(save_dir: str) -> list[int]:
    """Iterations of complete checkpoint directories, ascending."""
    if not os.path.isdir(save_dir):
        return []
    its = [int(m.group(1)) for d in os.listdir(save_dir) if (m := _ITER_DIR.match(d))
           and os.path.exists(os.path.join(save_dir, d, "metadata.json"))]
    return sorted(its)


def _prune(save_dir: str, keep_last_n: int, keep: str) -> None:
    for it in list_checkpoints(save_dir)[:-keep_last_n]:
        if iter_dir_name(it) != keep:
            shutil.rmtree(os.path.join(save_dir, iter_dir_name(it)), ignore_errors=True)


def find_latest(load_dir: str) -> str | None:
    """The directory ``latest`` names (None when ``load_dir`` holds no checkpoint yet)."""
    pointer = os.path.join(load_dir, "latest")
    if not os.path.exists(pointer):
        if list_checkpoints(load_dir):
            # pointer lost (never written or deleted): fall back to the newest complete directory
            return os.path.join(load_dir, iter_dir_name(list_checkpoints(load_dir)[-1]))
        return None
    with open(pointer) as f:
        name = f.read().strip()
    path = os.path.join(load_dir, name)
    if not os.path.exists(os.path.join(path, "metadata.json")):
        raise CheckpointError(f"--load {load_dir}: 'latest' names {name}, which is missing or incomplete; "
                              f"point 'latest' at a complete iter_* directory or remove it")
    return path


def read_metadata(path: str) -> dict:
    with open(os.path.join(path, "metadata.json")) as f:
        meta = json.load(f)
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
    """(metadata, this rank's shard), the shard read with ``weights_only=True``."""
    return read_metadata(path), read_shard(path, rank)


def read_shard(path: str, rank: int) -> dict:
    """Shard ``rank`` of checkpoint directory ``path`` (``weights_only=True``); a missing or unreadable
    file raises CheckpointError naming it."""
    shard_path = os.path.join(path, shard_name(rank))
    if not os.path.exists(shard_path):
        raise CheckpointError(f"{path}: shard {shard_name(rank)} is missing; the checkpoint is incomplete "
                              f"(load an earlier iteration, or re-save)")
    try:
        return torch.load(shard_path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated file, bad zip, refused pickle: all mean "cannot use this shard"
        raise CheckpointError(f"{shard_path} is unreadable ({type(err).__name__}: {err}); the checkpoint is "
                              f"corrupt: load an earlier iteration, or re-save") from err
