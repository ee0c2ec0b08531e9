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

import hashlib
import io
import itertools
import math
import re
import struct
import zipfile

import torch

from omnitron.core.checkpoint.integrity import IntegrityError

_STORAGE = re.compile(r"^[^/]+/data/\d+$")


class ChunkBytes(io.RawIOBase):
    """A seekable, read-only view of the saved chunk at bytes ``[base, base + length)`` of file ``path``, read
    block by block (``block`` bytes), each block hashed with ``algorithm`` and checked against ``digests``
    before any of it is returned; ``read_bytes`` counts the bytes read from disk."""

    def __init__(self, path: str, base: int, length: int, block: int, algorithm: str, digests: list[str]) -> None:
        super().__init__()
        if len(digests) != max(1, math.ceil(length / block)) and length:
            raise IntegrityError(f"{path}: the chunk at {base} has {len(digests)} block digests, its "
                                 f"{length} bytes need {math.ceil(length / block)}")
        self.path, self.base, self.length, self.block = path, base, length, block
        self.algorithm, self.digests = algorithm, digests
        self.cache: dict[int, bytes] = {}
        self.last: tuple[int, bytes] = (-1, b"")
        self.pos, self.read_bytes = 0, 0
        self.file = open(path, "rb")

    def close(self) -> None:
        self.file.close()
        super().close()

    def _block(self, j: int, keep: bool) -> bytes:
        """Block ``j``, read and verified (``keep``: cached, for the archive's headers read piecewise)."""
        if j in self.cache:
            return self.cache[j]
        if self.last[0] == j:  # runs come in file order: the next run often starts in the block just read
            return self.last[1]
        self.file.seek(self.base + j * self.block)
        data = self.file.read(min(self.block, self.length - j * self.block))
        self.read_bytes += len(data)
        if hashlib.new(self.algorithm, data).hexdigest() != self.digests[j]:
            raise IntegrityError(f"{self.path} is corrupt: bytes {self.base + j * self.block}.."
                                 f"{self.base + j * self.block + len(data)} do not match the chunk index's "
                                 f"block digest")
        if keep:
            self.cache[j] = data
        self.last = (j, data)
        return data

    def pread(self, offset: int, n: int, into: memoryview | None = None, keep: bool = True) -> bytes | None:
        """Bytes ``[offset, offset + n)`` of the chunk (clipped at its end), from verified blocks; with ``into``
        (a byte view of ``n`` bytes) written there instead of returned, without caching the blocks."""
        n = max(0, min(n, self.length - offset))
        out = bytearray(n) if into is None else into
        pos = offset
        while pos < offset + n:
            j = pos // self.block
            data = self._block(j, keep and into is None)
            lo, hi = pos - j * self.block, min(len(data), offset + n - j * self.block)
            out[pos - offset:pos - offset + hi - lo] = data[lo:hi]
            pos += hi - lo
        return bytes(out) if into is None else None

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
