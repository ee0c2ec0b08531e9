"""Read part of a saved DCP chunk: only the bytes of the requested box, each verified by its block digests.

DCP's own reader loads every saved chunk a request overlaps whole (``torch.load`` of the chunk, then a
narrowing), so a tensor-parallel rank that wants half of a tensor saved in one chunk (a checkpoint written
at tp1, or by ``checkpoint convert``) reads all of it. A saved chunk is a ``torch.save`` archive: a zip whose
one stored (uncompressed) record ``<archive>/data/0`` holds the tensor's bytes, contiguous and row-major (DCP
writes a contiguous tensor owning exactly its storage: :func:`~.dist_planner.exact_storage`, else a clone).
:class:`ChunkBytes` reads such a chunk through its block digests (:func:`~.integrity.read_block_index`): every
byte used -- the zip's directory and headers, then the box's row runs -- comes from a block that was read
and hashed; nothing else of the chunk is read. Anything unexpected (compression, several storages, a size
that is not the chunk's) returns None and the caller reads the chunk whole, as DCP does.
"""
from __future__ import annotations

import bisect
import hashlib
import io
import itertools
import math
import re
import struct
import zipfile

import torch

from omnitron.core.checkpoint.integrity import IntegrityError, block_bounds

_STORAGE = re.compile(r"^[^/]+/data/\d+$")


MIN_PIECE = 1 << 10
SPAN = 4 << 20
"""Most bytes one file read of consecutive blocks fetches (a whole-chunk read is hashed and copied span by span)."""
"""Smallest row-aligned piece a chunk index cuts a tensor's rows into (:func:`piece_bytes`)."""


def piece_bytes(sizes: tuple[int, ...], itemsize: int, block: int) -> int:
    """Bytes per verified piece of a saved tensor of ``sizes``: a row (the last dimension) halved up to three times
    while the half stays at least :data:`MIN_PIECE` and a whole number of elements -- so a tensor-parallel column
    slice at tp 2, 4 or 8 starts and ends on piece boundaries and reads only its own bytes -- and further while
    over ``block``; rows shorter than :data:`MIN_PIECE` are grouped, as many whole rows as fit in ``block``."""
    row = (sizes[-1] if sizes else 1) * itemsize
    if row < MIN_PIECE:
        return max(1, block // max(row, 1)) * max(row, 1)
    piece, halvings = row, 0
    while piece % (2 * itemsize) == 0 and (piece // 2 >= MIN_PIECE and halvings < 3 or piece > block):
        piece, halvings = piece // 2, halvings + 1
    return piece


def chunk_layout(path: str, base: int, length: int, sizes: tuple[int, ...], itemsize: int,
                 block: int) -> tuple[int, int, int] | None:
    """``(start, piece, end)`` of the saved chunk at ``[base, base + length)`` of ``path`` (its tensor's bytes
    ``[start, end)`` within the chunk, cut every ``piece`` bytes: :func:`~.integrity.block_bounds`), read
    unverified at save time from the file just written; None when the chunk is not a plain one-storage archive."""
    nbytes = math.prod(sizes) * itemsize
    with FileWindow(path, base, length) as window:
        start = storage_offset(window, nbytes)
    return None if start is None else (start, piece_bytes(tuple(sizes), itemsize, block), start + nbytes)


class FileWindow(io.RawIOBase):
    """A seekable, read-only view of bytes ``[base, base + length)`` of file ``path`` (the file protocol zipfile
    needs, plus :meth:`pread`); ``read_bytes`` counts the bytes read from disk. Unverified: :class:`ChunkBytes`
    verifies."""

    def __init__(self, path: str, base: int, length: int) -> None:
        super().__init__()
        self.path, self.base, self.length = path, base, length
        self.pos, self.read_bytes = 0, 0
        self.file = open(path, "rb")

    def close(self) -> None:
        self.file.close()
        super().close()

    def pread(self, offset: int, n: int, into: memoryview | None = None, keep: bool = True) -> bytes | None:
        """Bytes ``[offset, offset + n)`` of the window (clipped at its end), or written into ``into``."""
        n = max(0, min(n, self.length - offset))
        self.file.seek(self.base + offset)
        data = self.file.read(n)
        self.read_bytes += len(data)
        if into is None:
            return data
        into[:len(data)] = data
        return None

    # the file protocol zipfile needs
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: 0, 1: self.pos, 2: self.length}[whence] + offset
        return self.pos

    def read(self, n: int = -1) -> bytes:
        out = self.pread(self.pos, self.length - self.pos if n is None or n < 0 else n)
        self.pos += len(out)
        return out


class ChunkBytes(FileWindow):
    """A :class:`FileWindow` over one saved chunk read block by block (``block`` bytes, or the row-aligned
    ``layout``: :func:`~.integrity.block_bounds`), each block hashed with ``algorithm`` and checked against
    ``digests`` (raw digest bytes per block, :class:`~.integrity.PackedDigests`) before any of it is returned;
    consecutive blocks a read needs are fetched in one file read."""

    def __init__(self, path: str, base: int, length: int, block: int, algorithm: str, digests,
                 layout: tuple[int, int, int] | None = None) -> None:
        super().__init__(path, base, length)
        self.bounds = block_bounds(length, layout, block)
        if len(digests) != max(1, len(self.bounds) - 1) and length:
            raise IntegrityError(f"{path}: the chunk at {base} has {len(digests)} block digests, its "
                                 f"{length} bytes need {len(self.bounds) - 1}")
        self.algorithm, self.digests = algorithm, digests
        self.cache: dict[int, bytes] = {}
        self.last: tuple[int, bytes] = (-1, b"")

    def _held(self, j: int):
        """Block ``j`` if already read and kept (runs come in file order: the next often starts in the last)."""
        return self.cache.get(j, self.last[1] if self.last[0] == j else None)

    def _stretch(self, j: int, j1: int, keep: bool) -> list[tuple[int, memoryview]]:
        """Blocks ``j..k`` (k <= ``j1``), verified: block ``j`` alone when already held, else the blocks not held
        from ``j`` on, up to :data:`SPAN` bytes, in one file read (``keep``: cached, for the archive's headers
        read piecewise). Only the last block outlives the call (``last``), as a copy."""
        if self._held(j) is not None:
            return [(j, memoryview(self._held(j)))]
        k = j
        while k < j1 and self._held(k + 1) is None and self.bounds[k + 2] - self.bounds[j] <= SPAN:
            k += 1
        self.file.seek(self.base + self.bounds[j])
        raw = memoryview(self.file.read(self.bounds[k + 1] - self.bounds[j]))
        self.read_bytes += len(raw)
        out = []
        for i in range(j, k + 1):
            data = raw[self.bounds[i] - self.bounds[j]:self.bounds[i + 1] - self.bounds[j]]
            self._check(i, data)
            if keep:
                self.cache[i] = bytes(data)
            out.append((i, data))
        self.last = (k, bytes(out[-1][1]))
        return out

    def _check(self, j: int, data) -> None:
        want = self.digests[j]
        if (hashlib.new(self.algorithm, data).digest()[:len(want)] != want
                or len(data) != self.bounds[j + 1] - self.bounds[j]):
            raise IntegrityError(f"{self.path} is corrupt: bytes {self.base + self.bounds[j]}.."
                                 f"{self.base + self.bounds[j + 1]} do not match the chunk index's block digest")

    def pread(self, offset: int, n: int, into: memoryview | None = None, keep: bool = True) -> bytes | None:
        """Bytes ``[offset, offset + n)`` of the chunk (clipped at its end), from verified blocks; with ``into``
        (a byte view of ``n`` bytes) written there instead of returned, without caching the blocks."""
        n = max(0, min(n, self.length - offset))
        out = bytearray(n) if into is None else into
        j, j1 = bisect.bisect_right(self.bounds, offset) - 1, bisect.bisect_right(self.bounds, offset + n - 1) - 1
        while n and j <= j1:
            for i, data in self._stretch(j, j1, keep and into is None):
                lo, hi = max(offset, self.bounds[i]), min(offset + n, self.bounds[i + 1])
                out[lo - offset:hi - offset] = data[lo - self.bounds[i]:hi - self.bounds[i]]
                j = i + 1
        return bytes(out) if into is None else None

def storage_offset(chunk: ChunkBytes, nbytes: int) -> int | None:
    """Offset in ``chunk`` of the ``torch.save`` archive's tensor bytes when they are its one stored storage
    record of exactly ``nbytes``; None when the chunk is anything else."""
    try:
        with zipfile.ZipFile(chunk) as archive:
            records = [i for i in archive.infolist() if _STORAGE.match(i.filename)]
    except zipfile.BadZipFile:
        return None
    if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED or records[0].file_size != nbytes:
        return None
    head = chunk.pread(records[0].header_offset, 30)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        return None
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return records[0].header_offset + 30 + name_len + extra_len


def box_runs(sizes: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]):
    """``(first element, count)`` of each contiguous run of the box ``offsets`` / ``lengths`` in a row-major
    tensor of ``sizes``, in the box's own row-major order (so the runs concatenated are the box)."""
    k = max((d for d in range(len(sizes)) if lengths[d] != sizes[d]), default=-1)
    if k < 0:
        yield 0, math.prod(sizes)
        return
    strides = [math.prod(sizes[d + 1:]) for d in range(len(sizes))]
    run = lengths[k] * strides[k]
    for idx in itertools.product(*(range(offsets[d], offsets[d] + lengths[d]) for d in range(k))):
        yield sum(i * s for i, s in zip(idx, strides)) + offsets[k] * strides[k], run


def read_box(chunk: ChunkBytes, sizes, dtype: torch.dtype, offsets, lengths,
             into: torch.Tensor | None = None) -> torch.Tensor | None:
    """The box ``offsets`` / ``lengths`` of the saved tensor of ``sizes`` and ``dtype`` in ``chunk``, reading only
    its runs' blocks, written into ``into`` (a contiguous host tensor of that shape and dtype) or a new tensor;
    None when the chunk is not a plain archive."""
    item = torch.empty((), dtype=dtype).element_size()
    data = storage_offset(chunk, math.prod(sizes) * item)
    if data is None:
        return None
    out = torch.empty(tuple(lengths), dtype=dtype) if into is None else into
    raw = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else None
    at = 0
    for start, count in box_runs(sizes, offsets, lengths):  # straight into the box: no staging copy
        chunk.pread(data + start * item, count * item, into=raw[at:at + count * item])
        at += count * item
    return out
