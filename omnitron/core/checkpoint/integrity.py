"""Checksums and crash-safe directory commits for checkpoint files (any checkpoint format).

Checksums: each writer hashes the file it wrote (SHA-256, hardware-accelerated on current x86 and
ARM cores; a corrupt byte anywhere changes it) and leaves the digest beside it as ``NAME.sha256``;
the committing process folds those into its metadata (:func:`collect_digests`) and a reader
verifies each file before deserialising it (:func:`verify`), so a flipped byte is an error naming
the file instead of silently different weights.

Commits: a complete directory ``X.tmp`` becomes ``X`` by rename. Re-saving ``X`` needs two renames
(``X`` -> ``X.replaced``, ``X.tmp`` -> ``X``); between them ``X`` is missing, so readers go
through :func:`resolve`, which then finds the complete ``X.tmp`` (or ``X.replaced``), and the next
writer finishes an interrupted swap with :func:`repair` before touching anything.
"""
from __future__ import annotations

import hashlib
import os
import shutil

ALGORITHM = "sha256"
_SUFFIX = "." + ALGORITHM
_CHUNK = 8 << 20


class IntegrityError(ValueError):
    """A file's bytes do not match the digest recorded for it, or its digest is missing."""


def file_digest(path: str, algorithm: str = ALGORITHM) -> str:
    """``"sha256:<hex>"`` of the file's bytes (read in 8 MiB chunks: bounded memory)."""
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return f"{algorithm}:{h.hexdigest()}"


def write_digest(path: str) -> str:
    """Hash ``path`` and write the digest to ``path.sha256`` (fsynced); returns the digest."""
    digest = file_digest(path)
    with open(path + _SUFFIX, "w") as f:
        f.write(digest)
        f.flush()
        os.fsync(f.fileno())
    return digest


def collect_digests(directory: str, names: list[str]) -> dict[str, str]:
    """``{name: digest}`` from the ``name.sha256`` files the writers left in ``directory`` (removed)."""
    out = {}
    for name in names:
        side = os.path.join(directory, name + _SUFFIX)
        try:
            with open(side) as f:
                out[name] = f.read().strip()
        except FileNotFoundError:
            raise IntegrityError(f"{os.path.join(directory, name)}: its writer left no {ALGORITHM} digest; the "
                                 f"shard was not written completely") from None
        os.remove(side)
    return out


def verify(path: str, expected: str) -> None:
    """Raise IntegrityError naming ``path`` when its bytes do not hash to ``expected`` (whose prefix
    names the algorithm, so digests written with another one still verify)."""
    algorithm, _, want = str(expected).partition(":")
    if algorithm not in hashlib.algorithms_guaranteed or not want:
        raise IntegrityError(f"{path}: the recorded checksum {str(expected)[:40]!r} is not ALGORITHM:HEX")
    got = file_digest(path, algorithm).partition(":")[2]
    if got != want:
        raise IntegrityError(f"{path} is corrupt: its {algorithm} is {got[:16]}..., the checkpoint metadata "
                             f"records {want[:16]}...")


def _complete(path: str, marker: str) -> bool:
    return os.path.isfile(os.path.join(path, marker))


def resolve(path: str, marker: str) -> str | None:
    """The complete directory committed as ``path``: ``path`` itself, or while a re-save of it is
    between its two renames (or died there), the complete ``path.tmp`` (newer) or ``path.replaced``.
    ``marker`` is the file written last into a directory (its presence means complete)."""
    for candidate in (path, path + ".tmp", path + ".replaced"):
        if _complete(candidate, marker):
            return candidate
    return None


def commit_dir(tmp: str, final: str) -> None:
    """Rename the complete directory ``tmp`` to ``final``, replacing an existing ``final`` (see module)."""
    aside = None
    if os.path.exists(final):
        aside = final + ".replaced"
        if os.path.exists(aside):
            shutil.rmtree(aside)
        os.rename(final, aside)
    os.rename(tmp, final)
    fsync_dir(os.path.dirname(final) or ".")
    if aside:
        shutil.rmtree(aside, ignore_errors=True)


def repair(parent: str, marker: str) -> list[str]:
    """Finish every re-save that died between its renames under ``parent``: the complete ``X.tmp``
    becomes ``X``, else ``X.replaced`` is put back. Returns the directories repaired."""
    fixed = []
    for name in sorted(os.listdir(parent)) if os.path.isdir(parent) else ():
        if not name.endswith(".replaced"):
            continue
        aside = os.path.join(parent, name)
        final = aside[:-len(".replaced")]
        if not os.path.exists(final):
            os.rename(final + ".tmp" if _complete(final + ".tmp", marker) else aside, final)
            fixed.append(final)
        shutil.rmtree(aside, ignore_errors=True)
    if fixed:
        fsync_dir(parent)
    return fixed


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
