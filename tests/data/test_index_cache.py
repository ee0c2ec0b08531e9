"""The on-disk index cache (--data-cache-path): written once, reused, and a damaged array file rebuilt on the builder
rank or refused, naming the file, on the others (never read as if it were the index)."""
from __future__ import annotations

import glob
import os

import numpy as np
import pytest

from omnitron.core.data import GPTDataset, IndexCacheMissing, IndexedDataset, IndexedDatasetBuilder
from omnitron.core.data.gpt_dataset import build_indices

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
