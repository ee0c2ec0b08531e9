"""BERT / T5 sample mappings against Megatron's own ``helpers.build_mapping`` (fixtures written by
tests/data/megatron_bert_mapping/make_fixtures.py): the same documents, sentence lengths, sample count, target
length, ``--short-seq-prob``, seed and minimum sentences give the same rows in the same (shuffled) order; a
BertDataset / T5Dataset over such a corpus holds that mapping (its sentence indices relative to the split); and whole
BERT and T5 datasets, split by --split, equal the ones pretrain_bert's and pretrain_t5's builders make, sample for
sample."""
from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

from omnitron.core.data import DataConfig, IndexedDatasetBuilder
from omnitron.core.data.bert_dataset import BertDataset, build_bert_datasets
from omnitron.core.data.sample_mapping import MT19937_64, build_sample_mapping
from omnitron.core.data.t5_dataset import T5Dataset, build_t5_datasets
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



class _WordPiece:
    """The fixture's stand-in WordPiece vocabulary (ids 0-4 special, ``##`` pieces as :data:`NAMES` says)."""

    name, vocab_size, pad, unk, cls, sep, mask = "stand-in", 1000, 0, 1, 2, 3, 4
    special_ids = (0, 1, 2, 3, 4)
    continuation_ids = tuple(i for i, n in enumerate(M.NAMES) if n.startswith("##"))


@pytest.mark.parametrize("name", sorted(M.DATASETS))
def test_bert_datasets_equal_megatrons(tmp_path, name):
    """--split 90,8,2 over the fixture files (their sentences partly [UNK]), one file, Megatron's one-dataset blend
    ``1.0 c`` (exactly the samples asked, over a dataset indexed with 0.5% surplus) and a weighted blend: each
    split's length and its first samples (tokens, token types, padding mask, loss mask, labels, is_random) are
    those of Megatron's builder."""
    want = np.load(os.path.join(HERE, "datasets.npz"))
    binary, seq, data_path = M.DATASETS[name]
    M._write(tmp_path, IndexedDatasetBuilder)
    cfg = DataConfig(data_path=[str(tmp_path / x) if x.isalpha() else x for x in data_path], split="90,8,2",
                     seq_length=seq, seed=M.SEED, data_cache_path=str(tmp_path / "cache"))
    train, valid, test = M.SAMPLES
    splits = build_bert_datasets(cfg, _WordPiece(), train_samples=train, valid_samples=valid, test_samples=test,
                                 binary_head=binary)
    for split, ds in zip(("train", "valid", "test"), splits):
        w = {k: want[f"{name}/{split}/{k}"] for k in ("len", "text", "types", "labels", "padding_mask", "loss_mask",
                                                      "is_random")}
        assert len(ds) == int(w["len"])
        for i in range(len(w["text"])):
            x = ds[i]
            masked = w["loss_mask"][i].astype(bool)
            assert x["tokens"].tolist() == w["text"][i].tolist(), (split, i)
            assert x["tokentype_ids"].tolist() == w["types"][i].tolist()
            assert (~x["padding_mask"]).long().tolist() == w["padding_mask"][i].tolist()
            assert x["loss_mask"].long().tolist() == w["loss_mask"][i].tolist()
            assert x["labels"][masked].tolist() == w["labels"][i][masked].tolist()
            assert int(x["is_random"]) == int(w["is_random"][i])


class _T5WordPiece(_WordPiece):
    """T5's stand-in: :class:`_WordPiece` with ids 900-999 the sentinels (``M.T5_NAMES``)."""

    sentinels = tuple(range(900, 1000))
    special_ids = _WordPiece.special_ids + sentinels
    continuation_ids = tuple(i for i, n in enumerate(M.T5_NAMES) if n.startswith("##"))


@pytest.mark.parametrize("name", sorted(M.T5_DATASETS))
def test_t5_datasets_equal_megatrons(tmp_path, name):
    """--split 90,8,2 over the fixture files (their text holds sentinel ids and [UNK]), one file and a weighted
    blend: each split's length and its first samples (encoder input and its padding, decoder input and its padding,
    loss mask, the labels it covers) are those of Megatron's builder with T5MaskedWordPieceDataset."""
    want = np.load(os.path.join(HERE, "t5_datasets.npz"))
    seq, dec, seed, data_path = M.T5_DATASETS[name]
    M._write(tmp_path, IndexedDatasetBuilder)
    cfg = DataConfig(data_path=[str(tmp_path / x) if x.isalpha() else x for x in data_path], split="90,8,2",
                     seq_length=seq, seed=seed, data_cache_path=str(tmp_path / "cache"))
    train, valid, test = M.SAMPLES
    splits = build_t5_datasets(cfg, _T5WordPiece(), train_samples=train, valid_samples=valid, test_samples=test,
                               decoder_seq_length=dec)
    for split, ds in zip(("train", "valid", "test"), splits):
        w = {k: want[f"{name}/{split}/{k}"] for k in ("len", "text_enc", "text_dec", "labels", "loss_mask",
                                                      "enc_mask", "dec_mask")}
        assert len(ds) == int(w["len"]), (split, len(ds), int(w["len"]))
        for i in range(len(w["text_enc"])):
            x = ds[i]
            scored = w["loss_mask"][i].astype(bool)
            assert x["tokens"].tolist() == w["text_enc"][i].tolist(), (split, i)
            assert (~x["padding_mask"]).long().tolist() == w["enc_mask"][i].tolist(), (split, i)
            assert x["decoder_tokens"].tolist() == w["text_dec"][i].tolist(), (split, i)
            assert (~x["decoder_padding_mask"]).long().tolist() == w["dec_mask"][i].tolist(), (split, i)
            assert x["loss_mask"].long().tolist() == w["loss_mask"][i].tolist(), (split, i)
            assert x["labels"][scored].tolist() == w["labels"][i][scored].tolist(), (split, i)
