"""Index caches on each node's own disk: two torchrun agents as two nodes, each with its own ``$OMNITRON_CACHE``
(the default --data-cache-path), train on a real indexed dataset.

Megatron builds the index caches on global rank 0 only and has every other rank load them
(megatron/core/datasets/blended_megatron_dataset_builder.py, ``build_on_rank`` then a barrier): a rank on another
node whose cache directory is its own disk finds nothing to load. omnitron did the same, and node 1 stopped with
"index cache ... not found: the builder rank did not build it before the barrier". Now, after rank 0's build, the
first rank of each node builds what its node's cache lacks (nothing where the cache is shared: it loads rank 0's),
and the node's other ranks load that (:func:`omnitron.core.data.cache.build_in_turn`).
"""
from __future__ import annotations

import glob
import os

import numpy as np
import pytest

from omnitron.testing.data import random_corpus
from tests.training.test_settings_agreement import _last_line, _two_nodes


@pytest.mark.slow
def test_two_nodes_with_their_own_index_caches_train(tmp_path):
    """Each node's cache holds the same index files, built on that node; the job trains its two steps. About 25 s
    on 2 cores."""
    prefix = str(tmp_path / "corpus")
    random_corpus(prefix, 200)
    caches = [tmp_path / f"cache{node}" for node in (0, 1)]

    def own_cache(node, argv):  # the real dataset in place of the shared arguments' --mock-data
        return ["env", f"OMNITRON_CACHE={caches[node]}", *[a for a in argv if a != "--mock-data"]]

    args = ["--data-path", prefix, "--split", "100,0,0", "--eval-iters", "0"]
    got = _two_nodes(tmp_path, [args] * 2, own_cache)
    for node, (code, out) in enumerate(got):
        assert code == 0, (node, _last_line(out), out[-3000:])
    files = [sorted(os.path.relpath(f, c) for f in glob.glob(os.path.join(c, "**", "*.npy"), recursive=True))
             for c in caches]
    assert files[0] and files[0] == files[1], files
    for name in files[0]:  # the same index on both nodes, built independently
        assert np.array_equal(np.load(caches[0] / name), np.load(caches[1] / name)), name
