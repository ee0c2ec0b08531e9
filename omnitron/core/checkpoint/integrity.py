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
import json
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


def range_digests(path: str, ranges: list[tuple[int, int]], algorithm: str = ALGORITHM,
                  block: int | None = None, layouts: dict | None = None) -> tuple[str, dict, dict]:
    """One pass over ``path``: the whole file's digest, ``{(offset, length): digest}`` of each of the
    disjoint byte ``ranges`` (chunks a reader may verify alone: :func:`verify_range`) and
    ``{(offset, length): [digest of each block]}``: each range cut into blocks (:func:`block_bounds` of its
    ``layouts`` entry; none: every ``block`` bytes, :data:`BLOCK` when None), so a reader of part of a chunk
    verifies only the blocks it reads. Row-aligned blocks (a layout) get :data:`PIECE_HEX`-character digests."""
    block = BLOCK if block is None else block
    layouts = layouts or {}
    whole, out, blocks = hashlib.new(algorithm), {}, {}
    with open(path, "rb") as f:
        pos = 0
        for off, n in sorted(ranges) + [(os.path.getsize(path), 0)]:
            whole.update(f.read(off - pos))  # bytes between ranges (none in a DCP file)
            part, digests = hashlib.new(algorithm), []
            layout = layouts.get((off, n))
            bounds = block_bounds(n, layout, block)
            for lo, hi in zip(bounds, bounds[1:]):
                data = b"".join(_blocks(f, hi - lo))
                part.update(data)
                whole.update(data)
                digests.append(hashlib.new(algorithm, data).hexdigest()[:PIECE_HEX if layout else None])
            if n:
                out[(off, n)] = f"{algorithm}:{part.hexdigest()}"
                blocks[(off, n)] = digests
            pos = off + n
    return f"{algorithm}:{whole.hexdigest()}", out, blocks


def block_bounds(length: int, layout: tuple[int, int, int] | None, block: int) -> list[int]:
    """Block boundaries ``[0, ..., length]`` of a chunk of ``length`` bytes. ``layout`` None: every ``block``
    bytes. ``layout = (start, piece, end)``: the tensor's bytes ``[start, end)`` in pieces of ``piece`` bytes
    (the last shorter), after one block of the archive's header bytes before ``start`` and before one of its
    trailer after ``end`` (each only when not empty)."""
    if layout is None:
        return list(range(0, length, block)) + [length] if length else [0]
    start, piece, end = layout
    if not (0 <= start <= end <= length and piece > 0):
        raise IntegrityError(f"block layout {layout} does not fit a chunk of {length} bytes")
    return ([0] if start else []) + list(range(start, end, piece)) + [end] + ([length] if end < length else [])


def _blocks(f, n: int, size: int = _CHUNK):
    """``n`` bytes of ``f`` from where it is, in blocks of at most ``size`` bytes."""
    while n > 0:
        block = f.read(min(n, size))
        if not block:
            raise IntegrityError(f"{f.name} ends {n} bytes before the range the checkpoint index gives")
        n -= len(block)
        yield block


CHUNK_INDEX = ".chunks.json"
"""Suffix of a data file's chunk index: ``{"offset:length": digest}`` of each chunk a reader may read alone, and
under ``"blocks"`` the block size and each chunk's block digests (:func:`read_block_index`)."""

BLOCK = 64 << 10
"""Bytes per block digest in a chunk index, for a chunk without a row layout; the most a row-aligned piece holds.
Index cost: 64 hex characters per block (0.1% of the data)."""
PIECE_HEX = 32
"""Hex characters kept of a row-aligned piece's SHA-256 (128 bits: a flipped byte is still caught with certainty
for all practical purposes; the index stays ~2% of the data at 1.5 KiB pieces)."""


def write_chunk_index(path: str, ranges: list[tuple[int, int]], layouts: dict | None = None) -> None:
    """Hash ``path`` whole, per chunk (``ranges``) and per block of each chunk (``layouts``: ``{(offset, length):
    (start, piece, end)}`` where a chunk's tensor bytes are cut at row-aligned pieces, :func:`block_bounds`;
    others per :data:`BLOCK`) in one pass; leave ``path.sha256``, the chunk index ``path.chunks.json`` and that
    index's own ``.sha256`` (so the commit records both)."""
    layouts = layouts or {}
    whole, chunks, blocks = range_digests(path, ranges, layouts=layouts)
    _store_digest(path, whole)
    index = path + CHUNK_INDEX
    raw = {f"{o}:{n}": d for (o, n), d in sorted(chunks.items())}
    raw["blocks"] = {"size": BLOCK, "algorithm": ALGORITHM,
                     **{f"{o}:{n}": d if (o, n) not in layouts else {"layout": list(layouts[(o, n)]), "digests": d}
                        for (o, n), d in sorted(blocks.items())}}
    with open(index, "w") as f:
        json.dump(raw, f)
        f.flush()
        os.fsync(f.fileno())
    write_digest(index)


def read_chunk_index(index: str) -> dict[tuple[int, int], str]:
    """``{(offset, length): digest}`` of a chunk index (JSON: nothing is unpickled)."""
    raw = _load_index(index)
    out = {}
    for key, digest in raw.items():
        if key == "blocks":
            continue
        off, _, n = str(key).partition(":")
        out[(int(off), int(n))] = str(digest)
    return out


class PackedDigests:
    """One chunk's block digests as one ``bytes`` of equal-width raw digests: item ``j`` is block ``j``'s digest
    (``width`` bytes). A loader holds the digests of every chunk it may read until the load ends; as Python
    strings of hex they cost ~90 bytes each (a 32-character str and its list slot), packed 16-32."""

    __slots__ = ("raw", "width")

    def __init__(self, hex_digests: list, where: str) -> None:
        widths = {len(str(d)) for d in hex_digests}
        if len(widths) > 1 or any(w % 2 for w in widths):
            raise IntegrityError(f"{where}: block digests of unequal or odd hex lengths {sorted(widths)}: the chunk "
                                 "index is corrupt; re-save the checkpoint")
        try:
            self.raw = bytes.fromhex("".join(str(d) for d in hex_digests))
        except ValueError:
            raise IntegrityError(f"{where}: a block digest is not hexadecimal: the chunk index is corrupt; re-save "
                                 "the checkpoint") from None
        self.width = widths.pop() // 2 if widths else 0

    def __len__(self) -> int:
        return len(self.raw) // self.width if self.width else 0

    def __getitem__(self, j: int) -> bytes:
        return self.raw[j * self.width:(j + 1) * self.width]


def read_block_index(index: str) -> tuple[int, str, dict[tuple[int, int], tuple]] | None:
    """``(block size, algorithm, {(offset, length): (layout or None, PackedDigests)})`` of a chunk index
    (:func:`block_bounds` gives each chunk's blocks); None for an index written before block digests (its chunks
    are verified whole)."""
    raw = _load_index(index).get("blocks")
    if not isinstance(raw, dict):
        return None
    size, algorithm = int(raw.pop("size")), str(raw.pop("algorithm"))
    if size <= 0 or algorithm not in hashlib.algorithms_guaranteed:
        raise IntegrityError(f"{index}: block size {size} or algorithm {algorithm!r} is not valid")
    out = {}
    for key, entry in raw.items():
        off, _, n = str(key).partition(":")
        if isinstance(entry, list):
            layout, digests = None, PackedDigests(entry, f"{index}: chunk {key}")
        else:
            layout, digests = tuple(int(v) for v in entry["layout"]), entry.get("digests")
            if len(layout) != 3 or not isinstance(digests, PackedDigests) or 2 * digests.width < PIECE_HEX:
                raise IntegrityError(f"{index}: chunk {key} has a malformed block layout or digests shorter than "
                                     f"{PIECE_HEX} hex characters")
        out[(int(off), int(n))] = (layout, digests)
    return size, algorithm, out


def _load_index(index: str) -> dict:
    """A chunk index's JSON with each row-aligned chunk's digest list packed as it is parsed (``object_hook``), so
    the strings of one chunk at a time are alive, not the whole index's (~2% of the data for row-aligned pieces)."""
    def pack(entry: dict) -> dict:
        if isinstance(entry.get("digests"), list) and "layout" in entry:
            entry["digests"] = PackedDigests(entry["digests"], f"{index}: a row-aligned chunk's block digests")
        return entry

    with open(index) as f:
        return json.load(f, object_hook=pack)


def verify_range(path: str, offset: int, length: int, expected: str) -> None:
    """Raise IntegrityError naming ``path`` and the range when bytes ``[offset, offset + length)`` do not hash
    to ``expected`` (``ALGORITHM:HEX``)."""
    algorithm, _, want = str(expected).partition(":")
    if algorithm not in hashlib.algorithms_guaranteed or not want:
        raise IntegrityError(f"{path}: the recorded checksum {str(expected)[:40]!r} is not ALGORITHM:HEX")
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        f.seek(offset)
        for block in _blocks(f, length):
            h.update(block)
    if h.hexdigest() != want:
        raise IntegrityError(f"{path} is corrupt: bytes {offset}..{offset + length} hash to {h.hexdigest()[:16]}..., "
                             f"the checkpoint's chunk index records {want[:16]}...")


def write_digest(path: str) -> str:
    """Hash ``path`` and write the digest to ``path.sha256`` (fsynced); returns the digest."""
    return _store_digest(path, file_digest(path))


def _store_digest(path: str, digest: str) -> str:
    """Write ``digest`` to ``path.sha256`` (fsynced); returns it."""
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
