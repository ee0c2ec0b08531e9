"""Index caches built in turn (:func:`omnitron.core.data.cache.build_in_turn`): rank 0 builds, then each node's first
rank builds what its node's cache lacks, then the rest load. Four ranks on two "nodes" are threads here, the
barrier a ``threading.Barrier`` whose action records the cache files at each of the two barriers."""
from __future__ import annotations

import errno
import glob
import os
import random
import threading

import pytest
import torch

from omnitron.core.data import DataConfig, DataError, build_gpt_datasets, build_tokenizer
from omnitron.core.data.cache import build_in_turn
from omnitron.testing.data import random_corpus

SEQ, SAMPLES = 8, 30


def _files(caches: list[str]) -> list[dict]:
    """Per cache directory: ``{file: inode}`` of its index files (a rebuild renames a new file into place)."""
    return [{os.path.relpath(f, c): os.stat(f).st_ino for f in glob.glob(os.path.join(c, "**", "*.npy"),
                                                                        recursive=True)} for c in caches]


def _four_ranks(tmp_path, shared: bool):
    """Ranks 0, 1 on node 0 and 2, 3 on node 1, the cache one directory (``shared``) or one per node; what each
    rank's train split returned (or raised), and the cache files at each barrier and at the end."""
    prefix, tok = str(tmp_path / "d"), build_tokenizer("NullTokenizer", vocab_size=300)
    random_corpus(prefix, 300)
    caches = [str(tmp_path / "shared")] * 2 if shared else [str(tmp_path / f"node{n}") for n in (0, 1)]
    seen: list = []
    barrier = threading.Barrier(4, action=lambda: seen.append(_files(caches)))
    got: list = [None] * 4

    def rank(r: int) -> None:
        cfg = DataConfig(data_path=[prefix], split="100,0,0", seq_length=SEQ, seed=7, data_cache_path=caches[r // 2])
        try:
            got[r] = build_gpt_datasets(cfg, tok, train_samples=SAMPLES, valid_samples=0, test_samples=0,
                                        is_builder_rank=r == 0, barrier=lambda: barrier.wait(60),
                                        is_node_builder=r % 2 == 0)[0]
        except Exception as err:  # noqa: BLE001 - the test reads it
            got[r] = err
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    reference = build_gpt_datasets(DataConfig(data_path=[prefix], split="100,0,0", seq_length=SEQ, seed=7,
                                              data_cache_path=str(tmp_path / "reference")), tok,
                                   train_samples=SAMPLES, valid_samples=0, test_samples=0)[0]
    return got, seen + [_files(caches)], reference


def _same_samples(ds, reference) -> bool:
    return len(ds) == len(reference) and all(torch.equal(ds[i]["tokens"], reference[i]["tokens"])
                                             for i in range(len(ds)))


def test_each_node_builds_the_caches_its_own_disk_lacks(tmp_path):
    got, (first, second, end), reference = _four_ranks(tmp_path, shared=False)
    assert all(_same_samples(ds, reference) for ds in got), got  # no rank failed to find its index
    assert first[0] and not first[1]  # rank 0 built node 0's; node 1's disk held nothing yet
    assert set(second[1]) == set(first[0]) and end == second  # node 1's first rank built it; the others loaded


def test_a_shared_cache_is_built_once(tmp_path):
    got, (first, second, end), reference = _four_ranks(tmp_path, shared=True)
    assert all(_same_samples(ds, reference) for ds in got), got
    assert first[0] and first == second == end  # the node's first rank loaded rank 0's files: none rebuilt


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES, errno.ENOSPC])
def test_a_cache_directory_that_cannot_be_written_is_named(tmp_path, code):
    """The build's OSError (a read-only disk, another user's directory, a full one) becomes one line naming the
    directory; any other OSError is the build's own and passes unchanged."""
    where, failing = str(tmp_path / "c"), str(tmp_path / "c" / f"x{random.randrange(99)}.npy")

    def build_all(allow: bool):
        raise OSError(code, os.strerror(code), failing)

    with pytest.raises(DataError) as err:
        build_in_turn(build_all, True, None, cache_dir=where)
    assert str(err.value).startswith(f"--data-cache-path {where}: the index caches cannot be written there "
                                     f"({os.strerror(code)}: {failing}); give a directory this node can write")

    def missing(allow: bool):
        raise FileNotFoundError(errno.ENOENT, "gone", failing)

    with pytest.raises(FileNotFoundError):
        build_in_turn(missing, True, None, cache_dir=where)
