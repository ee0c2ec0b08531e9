"""BERT / T5 sample mappings against Megatron's own ``helpers.build_mapping`` (fixtures written by
tests/data/megatron_bert_mapping/make_fixtures.py): the same documents, sentence lengths, sample count, target
length, ``--short-seq-prob``, seed and minimum sentences give the same rows in the same (shuffled) order; and a
BertDataset / T5Dataset over such a corpus holds that mapping (its sentence indices relative to the split)."""
from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

from omnitron.core.data.bert_dataset import BertDataset
from omnitron.core.data.sample_mapping import MT19937_64, build_sample_mapping
from omnitron.core.data.t5_dataset import T5Dataset
from omnitron.testing.data import write_documents

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_bert_mapping")
_spec = importlib.util.spec_from_file_location("bert_mapping_fixtures", os.path.join(HERE, "make_fixtures.py"))
M = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(M)  # the corpus generator only; Megatron is imported by its main()
FIX = json.load(open(os.path.join(HERE, "fixtures.json")))


@pytest.mark.parametrize("name", sorted(FIX))
def test_mapping_equals_megatron(name):
    c = FIX[name]
    bounds, lengths = M.corpus(*c["docs"])
    lo, hi = c["range"]
    docs = np.asarray(bounds, np.int64)[lo:hi + 1]
    ours = build_sample_mapping(docs - docs[0], np.asarray(lengths)[docs[0]:docs[-1]], c["samples"], c["max_tokens"],
                                c["seed"], short_seq_prob=c["short_seq_prob"], min_sentences=c["min_sentences"])
    want = np.asarray(c["mapping"], np.int64).reshape(-1, 3)
    want[:, :2] -= docs[0]  # Megatron's rows hold sequence indices of the whole file; ours count from the split's
    assert np.array_equal(ours, want)


def test_the_fixtures_cover_megatron_rules():
    """Short targets, skipped documents (one sentence with two segments; a sentence over 512 tokens), several
    epochs: each case exercises what it names."""
    c = FIX["bert_default"]
    rows = np.asarray(c["mapping"]).reshape(-1, 3)
    assert (rows[:, 2] < c["max_tokens"]).any() and (rows[:, 2] == c["max_tokens"]).any()
    bounds, lengths = M.corpus(*c["docs"])
    used = {int(np.searchsorted(bounds, r, side="right")) - 1 for r in rows[:, 0]}
    long = {d for d in range(190) if max(lengths[bounds[d]:bounds[d + 1]]) > 512 and bounds[d + 1] - bounds[d] > 1}
    single = {d for d in range(190) if bounds[d + 1] - bounds[d] == 1}
    assert long and single and not used & (long | single)
    every = np.asarray(FIX["bert_all_short"]["mapping"]).reshape(-1, 3)[:, 2]  # p = 1: uniform in [2, 29]
    assert (every < FIX["bert_all_short"]["max_tokens"]).mean() > 0.8
    assert (np.asarray(FIX["bert_no_short"]["mapping"]).reshape(-1, 3)[:, 2] == 61).all()


def test_mt19937_64_known_value():
    """C++ requires the 10000th output of a default-seeded ``std::mt19937_64`` to be 9981545732273789042."""
    assert int(MT19937_64(5489).draw(10000)[-1]) == 9981545732273789042


@pytest.mark.parametrize("cls", [BertDataset, T5Dataset])
def test_datasets_hold_megatrons_mapping(tmp_path, cls):
    """A file of the fixture corpus (token ids arbitrary), split at document 10: the dataset's mapping is
    Megatron's for that split at ``--seq-length`` 64 (targets 61 BERT, 62 T5) and the given --short-seq-prob."""
    c = FIX["bert_default"]
    bounds, lengths = M.corpus(*c["docs"])
    rng = np.random.default_rng()
    docs = [[rng.integers(10, 900, n) for n in lengths[bounds[d]:bounds[d + 1]]] for d in range(len(bounds) - 1)]
    indexed = write_documents(tmp_path / "c", docs)
    tok = type("Tok", (), {"name": "synthetic", "vocab_size": 1000, "pad": 0, "unk": 1, "cls": 2, "sep": 3,
                           "mask": 4, "special_ids": (0, 1, 2, 3, 4), "sentinels": tuple(range(990, 1000))})()
    seed, prob, split = int(rng.integers(1, 2**20)), float(rng.choice([0.1, 0.2, 0.5])), np.arange(10, 150)
    extra = {"decoder_seq_length": 40} if cls is T5Dataset else {}
    ds = cls(indexed, split, 300, seq_length=64, seed=seed, tokenizer=tok, cache_dir=str(tmp_path / "cache"),
             short_seq_prob=prob, **extra)
    b = np.asarray(bounds, np.int64)[10:151]
    want = build_sample_mapping(b - b[0], np.asarray(lengths)[b[0]:b[-1]], 300, 62 if cls is T5Dataset else 61, seed,
                                short_seq_prob=prob, min_sentences=1 if cls is T5Dataset else 2)
    assert np.array_equal(np.asarray(ds.mapping), want)

