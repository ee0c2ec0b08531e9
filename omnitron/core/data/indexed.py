"""Megatron-LM compatible indexed datasets: ``PREFIX.bin`` (raw token ids) + ``PREFIX.idx``.

``.idx`` layout (little-endian), byte-for-byte Megatron's MMIDIDX format:
    b"MMIDIDX\\x00\\x00"        9-byte magic
    <Q version (= 1)
    <B dtype code              1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    <Q sequence count          S
    <Q document count          D (= number of documents + 1: the boundaries below)
    int32[S] sequence lengths  (in tokens)
    int64[S] sequence pointers (byte offsets into .bin)
    int64[D] document indices  (sequence index where each document starts, first 0, last S)
Sequences are what the builder adds; a document is one or more consecutive sequences
(one, unless sentences were split). ``IndexedDataset[i]`` is sequence ``i``.

The reader memory-maps both files, so random access to a sequence or a slice of one reads
only those bytes; every size and offset is checked on open, so a truncated ``.bin`` or a
foreign ``.idx`` fails here with the file named, not deep in training. dtype codes that cannot
hold token ids (int8 / int16: negative ids; floats) are refused, and every read checks its ids
are not negative and, once :attr:`IndexedDataset.vocab_size` is set, below it.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
_HEADER = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes
# codes the format defines but that cannot hold token ids (Megatron writes uint16 or int32 tokens)
NOT_TOKEN_CODES = {2: "int8", 3: "int16", 6: "float64", 7: "float32"}


class IndexedDatasetError(ValueError):
    """An indexed dataset file is missing, malformed or inconsistent; the message names the file."""


def dtype_code(dtype) -> int:
    dt = np.dtype(dtype)
    for code, t in DTYPE_CODES.items():
        if np.dtype(t) == dt and code not in NOT_TOKEN_CODES:
            return code
    usable = [np.dtype(t).name for c, t in DTYPE_CODES.items() if c not in NOT_TOKEN_CODES]
    raise IndexedDatasetError(f"dtype {dt} has no MMIDIDX code for token ids; use one of {usable}")


def optimal_dtype(vocab_size: int | None):
    """Megatron's choice: uint16 when every id fits in it, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def data_file(prefix: str) -> str:
    return f"{prefix}.bin"


def index_file(prefix: str) -> str:
    return f"{prefix}.idx"


def exists(prefix: str) -> bool:
    return os.path.isfile(index_file(prefix)) and os.path.isfile(data_file(prefix))


class IndexedDataset:
    """Read-only, memory-mapped view of ``prefix.bin`` / ``prefix.idx``."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        self.vocab_size: int | None = None  # set by the vocabulary check: reads then refuse ids >= it
        idx_path, bin_path = index_file(self.prefix), data_file(self.prefix)
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise IndexedDatasetError(f"{p}: no such file; --data-path takes the prefix of a PREFIX.bin/PREFIX.idx "
                                          "pair written by `omnitron preprocess` (or Megatron's preprocess_data.py)")
        self._read_index(idx_path)
        bin_size = os.path.getsize(bin_path)
        need = self._bin_bytes_needed()
        if bin_size < need:
            raise IndexedDatasetError(f"{bin_path} is truncated: {bin_size} bytes, the index needs {need}; "
                                      "re-run preprocessing or copy the file again")
        self._bin = np.memmap(bin_path, dtype=np.uint8, mode="r") if bin_size else np.zeros(0, np.uint8)

    def __getstate__(self) -> dict:
        # NOTE: re-open by prefix in the receiving process; pickling the memmaps would copy the files
        return {"prefix": self.prefix, "vocab_size": self.vocab_size}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])
        self.vocab_size = state.get("vocab_size")

    def _read_index(self, path: str) -> None:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(_HEADER)
        if len(head) < _HEADER or head[:len(MAGIC)] != MAGIC:
            raise IndexedDatasetError(f"{path}: wrong magic {head[:len(MAGIC)]!r} (expected {MAGIC!r}); "
                                      "not an MMIDIDX index file (legacy Megatron 'TNTIDX' indexes are not supported)")
        version, code, seqs, docs = struct.unpack("<QBQQ", head[len(MAGIC):])
        if version != VERSION:
            raise IndexedDatasetError(f"{path}: index version {version}, only version {VERSION} is supported (the one "
                                      "every Megatron release writes): the file is corrupt or of another format; "
                                      "re-run `omnitron preprocess`")
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{path}: unknown dtype code {code}; valid codes are {sorted(DTYPE_CODES)}")
        if code in NOT_TOKEN_CODES:
            raise IndexedDatasetError(f"{path}: dtype code {code} ({NOT_TOKEN_CODES[code]}) cannot hold token ids "
                                      f"(negative or fractional values); the file is corrupt or not token data: "
                                      f"re-run `omnitron preprocess` (it writes uint16 or int32 ids)")
        expect = _HEADER + seqs * 4 + seqs * 8 + docs * 8
        if size != expect:
            raise IndexedDatasetError(f"{path}: {size} bytes but its header ({seqs} sequences, {docs} document "
                                      f"boundaries) needs {expect}; the file is truncated or corrupt")
        self.dtype = np.dtype(DTYPE_CODES[code])
        mm = np.memmap(path, dtype=np.uint8, mode="r") if size else None
        self.sequence_lengths = np.frombuffer(mm, np.int32, seqs, _HEADER) if seqs else np.zeros(0, np.int32)
        self.sequence_pointers = (np.frombuffer(mm, np.int64, seqs, _HEADER + 4 * seqs) if seqs
                                  else np.zeros(0, np.int64))
        self.document_indices = np.frombuffer(mm, np.int64, docs, _HEADER + 12 * seqs)
        di = self.document_indices
        if docs < 1 or di[0] != 0 or di[-1] != seqs or np.any(np.diff(di) < 0):
            raise IndexedDatasetError(f"{path}: document boundaries must rise from 0 to the sequence count {seqs}")
        if seqs and (np.any(self.sequence_lengths < 0) or np.any(self.sequence_pointers < 0)):
            raise IndexedDatasetError(f"{path}: negative sequence length or pointer; the index is corrupt")
        odd = np.flatnonzero(self.sequence_pointers % self.dtype.itemsize)
        if len(odd):
            raise IndexedDatasetError(f"{path}: sequence {odd[0]}'s pointer {self.sequence_pointers[odd[0]]} is not a "
                                      f"multiple of the {self.dtype.itemsize}-byte {self.dtype} token size; the index "
                                      f"is corrupt: re-run preprocessing")

    def _bin_bytes_needed(self) -> int:
        if not len(self.sequence_lengths):
            return 0
        # NOTE: unsigned: both are checked >= 0, and a crafted pointer near 2**63 must not wrap the int64 sum
        # negative (which would pass the truncation check and fail later, in numpy, without naming the file)
        ends = self.sequence_pointers.astype(np.uint64) + self.sequence_lengths.astype(np.uint64) * self.dtype.itemsize
        return int(ends.max())

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (to its end when length is None)."""
        n = int(self.sequence_lengths[idx])
        if length is None:
            length = n - offset
        if offset < 0 or length < 0 or offset + length > n:
            raise IndexError(f"slice [{offset}, {offset + length}) outside sequence {idx} of length {n}")
        start = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        if not length:
            return np.zeros(0, self.dtype)
        out = np.frombuffer(self._bin, self.dtype, length, start)
        if (self.dtype.kind == "i" and out.min() < 0) or (self.vocab_size is not None and out.max() >= self.vocab_size):
            self._bad_ids(idx, out)
        return out

    def _bad_ids(self, idx: int, ids: np.ndarray) -> None:
        doc = int(np.searchsorted(self.document_indices, idx, side="right")) - 1
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        limit = f"[0, {self.vocab_size})" if self.vocab_size is not None else "0 and up"
        raise IndexedDatasetError(f"{data_file(self.prefix)}: document {doc} (sequence {idx}) holds token id {bad}, "
                                  f"outside the tokenizer's range {limit}: the file is corrupt, changed since it was "
                                  f"checked, or was preprocessed with another tokenizer; re-run `omnitron preprocess` "
                                  f"with this run's tokenizer")

    def __getitem__(self, idx: int) -> np.ndarray:
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sequence {idx} out of range for {len(self)} sequences in {self.prefix}")
        return self.get(idx % len(self))

    def document(self, doc: int) -> np.ndarray:
        """All tokens of document ``doc`` (its sequences concatenated)."""
        lo, hi = int(self.document_indices[doc]), int(self.document_indices[doc + 1])
        parts = [self.get(i) for i in range(lo, hi)]
        return np.concatenate(parts) if parts else np.zeros(0, self.dtype)

    def token_range(self, chunk_tokens: int = 1 << 24) -> tuple[int, int]:
        """(smallest, largest) token id in the ``.bin`` (read in chunks; (0, -1) when empty)."""
        data = self._bin[: self._bin_bytes_needed()].view(self.dtype)
        if not len(data):
            return 0, -1
        lo_id, hi_id = int(data[0]), -1
        for lo in range(0, len(data), chunk_tokens):
            part = data[lo: lo + chunk_tokens]
            lo_id, hi_id = min(lo_id, int(part.min())), max(hi_id, int(part.max()))
        return lo_id, hi_id

    def max_token(self, chunk_tokens: int = 1 << 24) -> int:
        """Largest token id in the ``.bin`` (-1 when empty)."""
        return self.token_range(chunk_tokens)[1]


class IndexedDatasetBuilder:
    """Streams sequences into ``bin_path``; ``finalize(idx_path)`` writes the index.

    Call ``add_item(tokens)`` for each sequence and ``end_document()`` after the last
    sequence of each document (or ``add_document(tokens)`` for a one-sequence document).
    ``add_index(prefix)`` appends a whole existing dataset (merging).
    """

    def __init__(self, bin_path: str, dtype=np.int32):
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)
        self.bin_path = bin_path
        self._out = open(bin_path, "wb")
        self._lengths: list[int] = []
        self._docs: list[int] = [0]
        self._nbytes = 0
        self._info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None

    def add_item(self, tokens) -> None:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise IndexedDatasetError(f"add_item takes a 1-D sequence of token ids, got shape {arr.shape}")
        if self._info is not None and arr.size and (arr.min() < self._info.min or arr.max() > self._info.max):
            raise IndexedDatasetError(f"token ids [{arr.min()}, {arr.max()}] do not fit in {self.dtype}; "
                                      "build with a wider dtype (np.int32)")
        data = arr.astype(self.dtype, copy=False).tobytes(order="C")
        self._out.write(data)
        self._nbytes += len(data)
        self._lengths.append(int(arr.size))

    def end_document(self) -> None:
        self._docs.append(len(self._lengths))

    def add_document(self, tokens, lengths: list[int] | None = None) -> None:
        """One document; ``lengths`` splits it into several sequences (sentences)."""
        arr = np.asarray(tokens)
        if lengths is None:
            self.add_item(arr)
        else:
            if sum(lengths) != arr.size:
                raise IndexedDatasetError(f"sequence lengths sum to {sum(lengths)}, document has {arr.size} tokens")
            bounds = np.cumsum([0] + list(lengths))
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                self.add_item(arr[lo:hi])
        self.end_document()

    def add_index(self, prefix: str) -> None:
        """Append every sequence and document of the dataset at ``prefix`` (same dtype)."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(f"cannot merge {prefix} ({other.dtype}) into a {self.dtype} dataset; "
                                      "preprocess both with the same tokenizer")
        base = len(self._lengths)
        with open(data_file(prefix), "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                self._out.write(block)
                self._nbytes += len(block)
        # NOTE: copying the whole .bin keeps any gap bytes; pointers below are rebuilt from lengths,
        # so the source must be densely packed (Megatron's writer and ours always are).
        if other._bin_bytes_needed() != os.path.getsize(data_file(prefix)):
            raise IndexedDatasetError(f"{data_file(prefix)} has trailing bytes beyond its index; cannot merge it")
        self._lengths.extend(int(x) for x in other.sequence_lengths)
        self._docs.extend(base + int(d) for d in other.document_indices[1:])

    def finalize(self, idx_path: str) -> None:
        self._out.close()
        if self._docs[-1] != len(self._lengths):
            self.end_document()  # close a trailing document the caller left open
        write_index(idx_path, self.dtype, np.asarray(self._lengths, np.int32), np.asarray(self._docs, np.int64))


def write_index(idx_path: str, dtype, lengths: np.ndarray, document_indices: np.ndarray) -> None:
    """Write an MMIDIDX ``.idx`` for densely packed sequences of ``lengths`` tokens."""
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(lengths), np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    with open(idx_path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<QBQQ", VERSION, dtype_code(dtype), len(lengths), len(document_indices)))
        f.write(lengths.astype(np.int32).tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(document_indices.astype(np.int64).tobytes(order="C"))


def prefixes_in(directory: str) -> list[str]:
    """The dataset prefixes of a directory's ``.bin``/``.idx`` pairs, in Megatron's tools/merge_datasets.py order
    (sorted by name); a ``.bin`` without its ``.idx`` (or the reverse) is an error, as there."""
    names = {}
    for entry in os.listdir(directory):
        stem, ext = os.path.splitext(entry)
        if ext in (".bin", ".idx") and os.path.isfile(os.path.join(directory, entry)):
            names.setdefault(stem, set()).add(ext)
    for stem, exts in sorted(names.items()):
        if len(exts) != 2:
            have, lack = next(iter(exts)), ({".bin", ".idx"} - exts).pop()
            raise IndexedDatasetError(f"{os.path.join(directory, stem)}{have} has no {lack} beside it; merge needs "
                                      "both files of every dataset in the directory")
    if not names:
        raise IndexedDatasetError(f"{directory}: no .bin/.idx datasets in it to merge")
    return [os.path.join(directory, stem) for stem in sorted(names)]


def merge_datasets(prefixes: list[str], output_prefix: str) -> IndexedDataset:
    """Concatenate datasets (same dtype) into ``output_prefix``; documents keep their order. A directory among
    ``prefixes`` stands for every dataset in it, sorted by name (Megatron's ``merge_datasets.py --input DIR``)."""
    prefixes = [q for p in prefixes for q in (prefixes_in(p) if os.path.isdir(p) else [p])]
    if not prefixes:
        raise IndexedDatasetError("merge_datasets needs at least one input prefix")
    dtype = IndexedDataset(prefixes[0]).dtype
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(data_file(output_prefix), dtype)
    for p in prefixes:
        builder.add_index(p)
    builder.finalize(index_file(output_prefix))
    return IndexedDataset(output_prefix)
