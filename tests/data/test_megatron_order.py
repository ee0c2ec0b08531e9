"""omnitron's GPT data order against Megatron-LM's own: fixtures.json was written by Megatron's code
(tests/data/megatron_order/make_fixtures.py, which says how to re-run it), not omnitron's. The same synthetic
corpora are written here; every index array and the first samples' token ids must be identical."""
from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

from omnitron.core.data import (BlendedDataset, DataConfig, GPTDataset, IndexedDataset, IndexedDatasetBuilder,
                                build_gpt_datasets, build_tokenizer, split_ranges)
from omnitron.core.data.config import split_weights

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_order")
FIXTURES = json.load(open(os.path.join(HERE, "fixtures.json")))
_spec = importlib.util.spec_from_file_location("make_fixtures", os.path.join(HERE, "make_fixtures.py"))
make_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_fixtures)  # corpus_documents: the corpora Megatron indexed (imports numpy only)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    prefixes = {}
    for name, (n, seed) in FIXTURES["corpora"].items():
        prefixes[name] = str(root / name)
        b = IndexedDatasetBuilder(f"{prefixes[name]}.bin", np.int32)
        for doc in make_fixtures.corpus_documents(n, seed):
            b.add_document(doc)
        b.finalize(f"{prefixes[name]}.idx")
    return prefixes


def _check_gpt(got: GPTDataset, want: dict, where: str) -> None:
    assert isinstance(got, GPTDataset), where
    assert [int(got.documents[0]), int(got.documents[-1]) + 1] == want["documents"], where
    for name in ("document_index", "sample_index", "shuffle_index"):
        assert np.asarray(getattr(got, name)).tolist() == want[name], f"{where}: {name}"
    assert len(got) == want["len"], where


def _check(got, want: dict | None, where: str) -> None:
    if want is None:
        assert got is None, where
        return
    if want["kind"] == "blend":
        assert isinstance(got, BlendedDataset) and len(got) == want["len"], where
        assert got.dataset_index.tolist() == want["dataset_index"], f"{where}: dataset_index"
        assert got.dataset_sample_index.tolist() == want["dataset_sample_index"], f"{where}: dataset_sample_index"
        assert len(got.datasets) == len(want["parts"])
        for i, (g, w) in enumerate(zip(got.datasets, want["parts"])):
            _check_gpt(g, w, f"{where} part {i}")
    else:
        _check_gpt(got, want, where)
    for i, tokens in enumerate(want["first_tokens"]):
        s = got[i]
        assert s["tokens"].tolist() + s["labels"][-1:].tolist() == tokens, f"{where}: sample {i} tokens"


@pytest.mark.parametrize("name", sorted(FIXTURES["cases"]))
def test_same_samples_as_megatron(name, corpora, tmp_path):
    """Document/sample/shuffle indices, blends ('1.0 D', weighted, unweighted by size, per-split paths) and the
    first samples' tokens of every split equal Megatron's for the same corpus, split, sizes and seed."""
    case = FIXTURES["cases"][name]
    paths = lambda p: [corpora.get(x, x) for x in p] if p else []  # noqa: E731
    if "per_split" in case:
        tr, va, te = (paths(p) for p in case["per_split"])
        cfg = DataConfig(train_data_path=tr, valid_data_path=va, test_data_path=te, seq_length=FIXTURES["seq_length"],
                         seed=case["seed"], data_cache_path=str(tmp_path))
    else:
        cfg = DataConfig(data_path=paths(case["data_path"]), split=case["split"], seq_length=FIXTURES["seq_length"],
                         seed=case["seed"], data_cache_path=str(tmp_path))
    tok = build_tokenizer("NullTokenizer", vocab_size=50000)
    n = case["samples"]
    got = build_gpt_datasets(cfg, tok, train_samples=n[0], valid_samples=n[1], test_samples=n[2])
    for split, (g, w) in enumerate(zip(got, case["splits"])):
        if n[split] == 0:  # Megatron builds a split nobody reads; omnitron builds none
            assert g is None
            continue
        _check(g, w, f"{name} split {split}")


def test_split_bounds_as_megatron():
    """--split document ranges for 1..399 documents equal Megatron's rounded cumulative shares."""
    for split, want in FIXTURES["split_bounds"].items():
        weights = split_weights(split)
        assert [w == 0 for w in weights] == want["none"], split
        for n, inner in enumerate(want["bounds"], start=1):
            ranges = [r for r, w in zip(split_ranges(n, weights), weights) if w > 0]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert [hi for _, hi in ranges[:-1]] == inner, (split, n)
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("epochs", [1.0, 1.3, 1.85, 2.0, 3.5])
def test_full_epochs_cover_every_document(epochs, tmp_path):
    """Property (random corpus, split, sequence length, seed): each epoch of the document index holds every
    document of the split once; when the last epoch is used for under 80% of its samples (Megatron's rule), the
    shuffle index reads all samples of the full epochs first, so a run that finishes them has seen every
    document (but those in the last < seq_length tokens of the full epochs) (the old order, one shuffle over all
    epochs' samples, left ~8% unseen at 1.17 epochs)."""
    rng = np.random.default_rng(int(epochs * 100))
    prefix = str(tmp_path / "d")
    b = IndexedDatasetBuilder(f"{prefix}.bin", np.int32)
    for _ in range(int(rng.integers(50, 300))):
        b.add_document(rng.integers(0, 100, int(rng.integers(1, 60))))
    b.finalize(f"{prefix}.idx")
    indexed = IndexedDataset(prefix)
    documents = np.arange(int(rng.integers(0, 10)), len(indexed) - int(rng.integers(0, 10)))
    seq = int(rng.integers(4, 40))
    tokens = int(indexed.sequence_lengths[documents].sum())
    per_epoch = (tokens - 1) // seq
    n = max(1, int(per_epoch * epochs))
    g = GPTDataset(indexed, documents, n, seq_length=seq, seed=int(rng.integers(1 << 30)), eod=100,
                   cache_dir=str(tmp_path / "c"))
    full = len(g.document_index) // len(documents)
    assert np.sort(np.asarray(g.document_index)).tolist() == np.repeat(documents, full).tolist()
    before = ((full - 1) * tokens - 1) // seq  # samples of the epochs before the last
    if full > 1 and n - before < int(0.8 * per_epoch):
        first = [int(j) for j in g.shuffle_index[:before]]
        assert sorted(first) == list(range(before))
        seen = {int(g.document_index[d]) for j in first
                for d in range(int(g.sample_index[j][0]), int(g.sample_index[j + 1][0]) + 1)}
        # the few documents after the last whole sample of the full epochs continue in the final epoch's first one
        tail = {int(d) for d in g.document_index[int(g.sample_index[before][0]):(full - 1) * len(documents)]}
        assert seen | tail == set(documents.tolist()) and len(tail) <= seq
