"""On-disk cache of numpy index arrays, keyed by a hash of everything that determines them.

One builder rank writes (arrays first, then the description as the completion marker, each
through a temporary name and an atomic rename); the other ranks wait at the caller's barrier
and memory-map what it wrote. A cache directory each node has on its own disk is built once per node
(:func:`build_in_turn`). A description that does not match its hash key is ignored.
The marker also records each array's dtype and shape: an array file that no longer reads back as written
(truncated, overwritten, copied in part) is rebuilt on the builder rank (a warning names it) and refused on
the others, never read as if it were the index.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from typing import Callable

import numpy as np

log = logging.getLogger(__name__)
ARRAYS_KEY = "_arrays"
"""The marker's record of each array's dtype and shape (beside the description, not part of the key)."""


def default_cache_dir() -> str:
    """``$OMNITRON_CACHE`` or ``~/.cache/omnitron``: index caches and the tokenized demo corpus."""
    return os.environ.get("OMNITRON_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "omnitron")


class IndexCacheMissing(RuntimeError):
    """A non-builder rank found no cache; the builder rank has not built it (or wrote elsewhere)."""


def build_in_turn(build_all: Callable[[bool], tuple], is_builder_rank: bool, barrier: Callable[[], None] | None,
                  is_node_builder: bool = False, cache_dir: str = "") -> tuple:
    """``build_all(allow_build)`` on every rank, in turn: the builder rank (global rank 0) builds; after a barrier,
    the first rank of each node (``is_node_builder``) loads that or, where its node's cache directory is a disk
    of its own, builds its node's copy; after a second barrier the other ranks load. Megatron builds on rank 0
    only (``build_on_rank``), so a node with its own cache finds nothing to load; concurrent node builds of a
    shared directory are safe (each file is renamed into place whole, the same bytes from the same key). A build
    that cannot write ``cache_dir`` (read-only, not this user's, full) stops in one line naming it."""
    result = _writing(build_all, cache_dir) if is_builder_rank else None
    if barrier is None:
        return result if result is not None else build_all(False)
    barrier()
    if result is None and is_node_builder:
        result = _writing(build_all, cache_dir)
    barrier()
    return result if result is not None else build_all(False)


def _writing(build_all: Callable[[bool], tuple], cache_dir: str) -> tuple:
    """``build_all(True)``; DataError naming ``--data-cache-path`` when writing the caches failed."""
    import errno

    try:
        return build_all(True)
    except OSError as err:
        if err.errno not in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT):
            raise
        from .errors import DataError

        raise DataError(f"--data-cache-path {cache_dir}: the index caches cannot be written there "
                        f"({os.strerror(err.errno)}: {err.filename}); give a directory this node can write "
                        f"(default $OMNITRON_CACHE or ~/.cache/omnitron), shared or its own") from None


def file_fingerprint(prefix: str, cache_dir: str | None = None) -> dict:
    """Identity of an indexed dataset: the sizes of both files and a digest of the whole ``.idx`` (every index
    a dataset builds depends on the sequence lengths and document bounds it holds, nowhere on the ``.bin``'s
    bytes). The ``.bin`` is never read. The digest is remembered under ``cache_dir`` beside the file's
    :func:`file_identity`, so a start reads the ``.idx`` again only after it was rewritten or replaced."""
    idx, bin_ = f"{prefix}.idx", f"{prefix}.bin"
    return {"idx_bytes": os.path.getsize(idx), "bin_bytes": os.path.getsize(bin_),
            "idx_sha256": _digest(idx, cache_dir)}


def _digest(path: str, cache_dir: str | None) -> str:
    """sha256 of the file at ``path``, memoised in ``cache_dir/fingerprints`` under its identity (size, inode,
    modification and change times); a copy elsewhere (another inode) is read again and digests the same."""
    identity = file_identity(path)
    memo = None if cache_dir is None else os.path.join(
        cache_dir, "fingerprints", hashlib.md5(os.path.abspath(path).encode()).hexdigest() + ".json")
    if memo is not None:
        try:
            with open(memo, encoding="utf-8") as f:
                saved = json.load(f)
            if saved.get("identity") == identity and isinstance(saved.get("sha256"), str):
                return saved["sha256"]
        except (OSError, ValueError, AttributeError):
            pass
    digest = _sha256_file(path)
    if memo is not None and file_identity(path) == identity:  # not rewritten while it was read
        os.makedirs(os.path.dirname(memo), exist_ok=True)
        record = {"path": os.path.abspath(path), "identity": identity, "sha256": digest}
        _atomic(memo, lambda f: f.write(json.dumps(record).encode()))
    return digest


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def file_identity(path: str) -> dict:
    """Size, inode and modification / change times of ``path``: any rewrite or replacement changes
    one of them (the change time cannot be set back from user space), without reading the file."""
    st = os.stat(path)
    return {"bytes": st.st_size, "inode": st.st_ino, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def cache_key(description: dict) -> str:
    return hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()


def load_or_build(cache_dir: str, description: dict, names: tuple[str, ...],
                  build: Callable[[], dict[str, np.ndarray]] | None) -> dict[str, np.ndarray]:
    """Arrays ``names`` for ``description``: loaded from ``cache_dir``, else built by ``build()`` and saved.

    ``build=None`` (a non-builder rank) raises ``IndexCacheMissing`` when the cache is absent or corrupt.
    """
    key = cache_key(description)
    base = os.path.join(cache_dir, key)
    desc_path = f"{base}-description.json"
    arrays, corrupt = _load(desc_path, description, base, names)
    if arrays is not None:
        return arrays
    if build is None:
        why = f"{corrupt} is corrupt" if corrupt else f"index cache {desc_path} not found"
        raise IndexCacheMissing(
            f"{why}: the builder rank did not build it before the barrier. Make sure --data-cache-path "
            f"({cache_dir}) is a directory every rank sees, or build on each node")
    if corrupt:
        log.warning("index cache %s is corrupt (it does not read back as written): building it again", corrupt)
    arrays = build()
    os.makedirs(cache_dir, exist_ok=True)
    for n in names:
        _atomic(f"{base}-{n}.npy", lambda f, a=arrays[n]: np.save(f, a, allow_pickle=False))
    marker = dict(description, **{ARRAYS_KEY: {n: _shape(arrays[n]) for n in names}})
    _atomic(desc_path, lambda f: f.write(json.dumps(marker, sort_keys=True, indent=1).encode()))
    return arrays


def _shape(array: np.ndarray) -> list:
    return [np.dtype(array.dtype).str, list(array.shape)]


def _load(desc_path: str, description: dict, base: str, names) -> tuple[dict | None, str | None]:
    """(the cached arrays, None) when the cache is complete and reads back as written; else (None, the path of
    the first array file that does not: unreadable, or another dtype or shape than the marker records, or None
    when the cache is simply absent or of another description)."""
    if not os.path.isfile(desc_path) or not all(os.path.isfile(f"{base}-{n}.npy") for n in names):
        return None, None
    try:
        with open(desc_path, encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None, None
    shapes = marker.pop(ARRAYS_KEY, None) if isinstance(marker, dict) else None
    if marker != json.loads(json.dumps(description)):
        return None, None
    arrays = {}
    for n in names:
        path = f"{base}-{n}.npy"
        try:
            arrays[n] = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError):
            return None, path
        if shapes is not None and _shape(arrays[n]) != shapes.get(n):  # caches written before the record: unchecked
            return None, path
    return arrays, None


def _atomic(path: str, write: Callable) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, path)
