"""The on-disk index cache (--data-cache-path): written once, reused, and a damaged array file rebuilt on the builder
rank or refused, naming the file, on the others (never read as if it were the index)."""
from __future__ import annotations

import glob
import os
import shutil

import numpy as np
import pytest

from omnitron.core.data import GPTDataset, IndexCacheMissing, IndexedDataset, IndexedDatasetBuilder
from omnitron.core.data.gpt_dataset import build_indices
from omnitron.core.data.indexed import write_index

SEQ, SAMPLES, SEED = 8, 40, 5


@pytest.fixture
def corpus(tmp_path):
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    prefix = str(tmp_path / "d")
    b = IndexedDatasetBuilder(f"{prefix}.bin", np.int32)
    for _ in range(int(rng.integers(20, 60))):
        b.add_document(rng.integers(0, 500, int(rng.integers(1, 30))))
    b.finalize(f"{prefix}.idx")
    return IndexedDataset(prefix)


def _dataset(indexed, cache_dir, allow_build=True):
    return GPTDataset(indexed, np.arange(len(indexed)), SAMPLES, seq_length=SEQ, seed=SEED, eod=500,
                      cache_dir=cache_dir, allow_build=allow_build)


def _want(indexed):
    """The indices computed afresh, no cache involved: the reference every load must return."""
    return build_indices(indexed.sequence_lengths, np.arange(len(indexed)), SAMPLES, SEQ, SEED)


def _same(ds, want) -> bool:
    return all(np.array_equal(np.asarray(getattr(ds, n)), want[n]) for n in want)


def _damage(path: str, how: str) -> None:
    if how == "truncated":  # a copy cut short
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 8)
    elif how == "garbage":
        with open(path, "wb") as f:
            f.write(b"not an array")
    else:  # another valid array in its place
        np.save(path, np.arange(3, dtype=np.int64))


def test_cache_is_written_once_and_reused(corpus, tmp_path):
    cache = str(tmp_path / "cache")
    assert _same(_dataset(corpus, cache), _want(corpus))
    files = sorted(glob.glob(os.path.join(cache, "indices", "*")))
    stamps = [os.stat(f).st_mtime_ns for f in files]
    again = _dataset(corpus, cache, allow_build=False)  # a non-builder rank loads what the builder wrote
    assert _same(again, _want(corpus))
    assert sorted(glob.glob(os.path.join(cache, "indices", "*"))) == files
    assert [os.stat(f).st_mtime_ns for f in files] == stamps


@pytest.mark.parametrize("how", ["truncated", "garbage", "another_array"])
@pytest.mark.parametrize("name", ["document_index", "sample_index", "shuffle_index"])
def test_a_damaged_cache_is_rebuilt_or_refused(corpus, tmp_path, how, name):
    cache = str(tmp_path / "cache")
    _dataset(corpus, cache)
    (path,) = glob.glob(os.path.join(cache, "indices", f"*-{name}.npy"))
    _damage(path, how)
    with pytest.raises(IndexCacheMissing, match=f"{os.path.basename(path)} is corrupt"):
        _dataset(corpus, cache, allow_build=False)
    assert _same(_dataset(corpus, cache), _want(corpus))  # the builder rank builds it again
    assert _same(_dataset(corpus, cache, allow_build=False), _want(corpus))  # and the others then read it


def _write_large(prefix: str, lengths: np.ndarray) -> None:
    """A dataset of one document per sequence, its ``.idx`` written in bulk (``write_index``); the ``.bin`` is
    zeros of the right size (the indices never read it)."""
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(int(lengths.sum()) * 4)
    write_index(f"{prefix}.idx", np.int32, lengths.astype(np.int32), np.arange(len(lengths) + 1))


def test_a_dataset_rewritten_in_the_middle_is_indexed_again(tmp_path):
    """Two starts on one --data-cache-path: between them the dataset is rewritten with two sequences of its
    middle swapped (same files' sizes, same first and last megabyte of an ``.idx`` of over 3 MB). The second
    start's indices are those of the new file, computed afresh, not the first start's cached ones."""
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    n = 300_000  # .idx: 12 bytes a sequence + 8 a document bound, about 6 MB
    lengths = rng.integers(1, 9, n)
    prefix, cache = str(tmp_path / "big"), str(tmp_path / "cache")
    _write_large(prefix, lengths)
    GPTDataset(IndexedDataset(prefix), np.arange(n), SAMPLES * 50, seq_length=SEQ, seed=SEED, eod=0, cache_dir=cache)
    # the .idx: a 34-byte header, sizes (4 bytes each), pointers (8 each), document bounds (8 each); swapping
    # sizes i and j (i < j < 290k) changes bytes 34 + 4 i.. (past the first MB) and pointers i + 1..j (at 2.4 MB +
    # 8 i .. < 4.7 MB: before the last MB)
    i = int(rng.integers(270_000, 285_000))
    j = i + 1 + int(np.flatnonzero(lengths[i + 1:] != lengths[i])[0])
    lengths[[i, j]] = lengths[[j, i]]
    _write_large(prefix, lengths)
    indexed = IndexedDataset(prefix)
    assert os.path.getsize(f"{prefix}.idx") > 3 << 20
    ds = GPTDataset(indexed, np.arange(n), SAMPLES * 50, seq_length=SEQ, seed=SEED, eod=0, cache_dir=cache)
    assert _same(ds, build_indices(indexed.sequence_lengths, np.arange(n), SAMPLES * 50, SEQ, SEED))


def test_the_idx_digest_is_read_once_per_file_version(corpus, tmp_path, monkeypatch):
    """The whole-``.idx`` digest is remembered under the cache directory: a second start does not read the file
    again; a rewrite (new identity) is read again; a copy elsewhere digests the same (the key every node agrees
    on); the ``.bin`` is never read."""
    from omnitron.core.data import cache as cache_mod

    reads = []
    real = cache_mod._sha256_file
    monkeypatch.setattr(cache_mod, "_sha256_file", lambda p: reads.append(p) or real(p))
    cache = str(tmp_path / "cache")
    first = cache_mod.file_fingerprint(corpus.prefix, cache)
    assert cache_mod.file_fingerprint(corpus.prefix, cache) == first
    assert reads == [f"{corpus.prefix}.idx"]
    copy = str(tmp_path / "copy")
    for ext in (".bin", ".idx"):
        shutil.copyfile(corpus.prefix + ext, copy + ext)
    assert cache_mod.file_fingerprint(copy, cache) == first
    os.utime(f"{corpus.prefix}.idx", ns=(1, 1))  # touched: read again, same content, same digest
    assert cache_mod.file_fingerprint(corpus.prefix, cache) == first
    assert reads == [f"{corpus.prefix}.idx", f"{copy}.idx", f"{corpus.prefix}.idx"]
