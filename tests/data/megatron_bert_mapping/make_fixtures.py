"""Writes ``fixtures.json`` beside this file WITH MEGATRON-LM'S OWN CODE: BERT / T5 sample mappings (Megatron's
``helpers.build_mapping``, which ``MaskedWordPieceDataset._build_sample_index`` calls) that omnitron's
``build_sample_mapping`` must reproduce row for row (tests/data/test_bert_mapping_megatron.py).

Needs a Megatron-LM checkout (snapshot d98e8a64dd was used) with its C++ dataset helpers built
(``make -C megatron/core/datasets``) and numpy; CPU, offline. Run from the omnitron root:

    PYTHONPATH=/path/to/Megatron-LM python tests/data/megatron_bert_mapping/make_fixtures.py

omnitron is not imported. Each case is a synthetic corpus from :func:`corpus` (documents of 1-6 sentences of
1-60 tokens, some with a sentence over Megatron's 512-token limit), a document range (a split), and the
arguments ``_build_sample_index`` passes: the range's document bounds, every sequence length, epochs (the int32
maximum less one: a sample count is given), the sample count, ``sequence_length - 3`` (BERT) or ``- 2``
(T5), ``--short-seq-prob``, the seed and the minimum sentences (2 with BERT's binary head, else 1).

``datasets.npz``: whole BERT datasets, as pretrain_bert builds them (BlendedMegatronDatasetBuilder with
BERTMaskedWordPieceDataset, --split 90,8,2, a one-process gloo group), over the file :func:`bert_documents` (some
sentences hold [UNK]) with the stand-in WordPiece vocabulary :data:`NAMES`: each split's length and the first
:data:`FIRST` samples' arrays, with and without the binary head.

``t5_datasets.npz``: whole T5 datasets, as pretrain_t5 builds them (T5MaskedWordPieceDataset with pretrain_t5's
masking settings, the same files and split), over :data:`T5_NAMES` (ids 900-999 the sentinels, which the text
also holds): each split's length and the first :data:`FIRST` samples' arrays, for each of :data:`T5_DATASETS`.
(On Python < 3.12 Megatron imports ``typing.override``; the script supplies a stand-in.)
"""
from __future__ import annotations

import json
import os
import typing

import numpy as np

if not hasattr(typing, "override"):
    typing.override = lambda f: f

HERE = os.path.dirname(os.path.abspath(__file__))
INT32_MAX = 2**31 - 1


def corpus(num_docs: int, seed: int) -> tuple[list[int], list[int]]:
    """(document bounds, sentence lengths): 1-6 sentences a document of 1-60 tokens; about one document in 15
    holds a sentence of 513-700 tokens (Megatron skips such a document when it has more than one sentence)."""
    rng = np.random.RandomState(seed)
    bounds, lengths = [0], []
    for _ in range(num_docs):
        n = int(rng.randint(1, 7))
        sizes = [int(x) for x in rng.randint(1, 61, n)]
        if rng.random_sample() < 1 / 15:
            sizes[int(rng.randint(n))] = int(rng.randint(513, 701))
        lengths += sizes
        bounds.append(len(lengths))
    return bounds, lengths


# name -> (documents, corpus seed, [first doc, end doc), samples, max tokens, short_seq_prob, seed, min sentences)
CASES = {
    "bert_default": (200, 1, (0, 190), 500, 509, 0.1, 1234, 2),
    "bert_split_middle": (200, 1, (190, 200), 40, 61, 0.1, 1234, 2),
    "bert_short_128": (150, 2, (0, 150), 900, 125, 0.1, 7, 2),
    "bert_short_03": (150, 3, (10, 140), 700, 61, 0.3, 99, 2),
    "bert_no_short": (120, 4, (0, 120), 300, 61, 0.0, 5, 2),
    "bert_all_short": (80, 5, (0, 80), 200, 29, 1.0, 3, 2),
    "bert_round_half": (100, 6, (0, 100), 250, 61, 0.4, 11, 2),  # 1 / 0.4 = 2.5: C's round() gives 3
    "one_segment": (150, 7, (0, 150), 600, 61, 0.1, 1234, 1),
    "t5_default": (150, 8, (5, 150), 800, 126, 0.1, 42, 1),
    "t5_few_samples": (60, 9, (0, 60), 3, 62, 0.1, 8, 1),  # one epoch is more than enough
}


NAMES = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
NAMES += [("##c%d" if i % 3 == 0 else "w%d") % i for i in range(5, 1000)]
"""A 1000-id WordPiece stand-in: ids 0-4 special, every third id from 6 a ``##`` piece."""
FIRST = 25
DATASETS = {"binary": (True, 64, ["c"]), "one_segment": (False, 48, ["c"]),  # name -> (binary head, sequence
            "one_dataset_blend": (True, 64, ["1.0", "c"]),  # length, --data-path over the files of ``_write``)
            "weighted_blend": (True, 64, ["0.6", "a", "0.4", "b"])}
"""``1.0 c`` is Megatron's one-dataset blend (the dataset indexed with 0.5% surplus, the blend exactly the samples);
prefixes without weights (``a b``) are no case: Megatron's BERT dataset cannot build them (a TypeError in
``helpers.build_mapping``, which gets no sample count)."""
SAMPLES, SEED = (200, 30, 5), 1234
T5_NAMES = NAMES[:900] + ["<extra_id_%d>" % k for k in range(100)]
"""T5's vocabulary: :data:`NAMES` with ids 900-999 the sentinels ``<extra_id_k>``."""
T5_DATASETS = {"t5": (64, 40, 77, ["c"]), "t5_weighted_blend": (48, 32, 5, ["0.6", "a", "0.4", "b"])}
"""name -> (encoder length, decoder length, seed, --data-path over the files of ``_write``)."""


def bert_documents() -> list[list[np.ndarray]]:
    """300 documents of 1-6 sentences of 1-39 ids; one sentence in 20 may hold [UNK] (id 1)."""
    rng = np.random.RandomState(5)
    return [[rng.randint(1 if rng.random_sample() < 0.05 else 5, 1000, int(rng.randint(1, 40))).astype(np.int32)
             for _ in range(int(rng.randint(1, 7)))] for _ in range(300)]


def _write(root, builder_cls) -> None:
    """The files the cases read: ``c`` all of :func:`bert_documents`, ``a`` its first 180 documents, ``b`` the rest
    (``builder_cls``: Megatron's IndexedDatasetBuilder, or omnitron's, whose interface is the same)."""
    docs = bert_documents()
    for name, part in (("c", docs), ("a", docs[:180]), ("b", docs[180:])):
        b = builder_cls(f"{root}/{name}.bin", dtype=np.int32)
        for sentences in part:
            b.add_document(np.concatenate(sentences), [len(x) for x in sentences])
        b.finalize(f"{root}/{name}.idx")


def _datasets(tmp: str) -> dict:
    import types

    import torch.distributed as dist
    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from megatron.core.datasets.utils import get_blend_from_list

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29631")
    dist.init_process_group("gloo", rank=0, world_size=1)
    _write(tmp, IndexedDatasetBuilder)
    tok = types.SimpleNamespace(cls=2, sep=3, mask=4, pad=0, eod=3, inv_vocab=dict(enumerate(NAMES)), vocab_size=1000,
                                unique_identifiers={"class": "stand-in"})
    out = {}
    for name, (binary, seq, data_path) in DATASETS.items():
        blend = get_blend_from_list([f"{tmp}/{x}" if x.isalpha() else x for x in data_path])
        cfg = BERTMaskedWordPieceDatasetConfig(
            random_seed=SEED, sequence_length=seq, blend=blend, split="90,8,2", path_to_cache=tmp,
            tokenizer=tok, masking_probability=0.15, short_sequence_probability=0.1, masking_max_ngram=3,
            masking_do_full_word=True, masking_do_permutation=False, masking_use_longer_ngrams=False,
            masking_use_geometric_distribution=False, classification_head=binary)
        _store(out, name, BERTMaskedWordPieceDataset, cfg,
               ("text", "types", "labels", "padding_mask", "loss_mask", "is_random"))
    return out


def _store(out: dict, name: str, dataset_cls, cfg, keys) -> None:
    """Megatron's builder's three splits of ``dataset_cls``: each split's length and its first :data:`FIRST`
    samples' ``keys`` into ``out`` (as ``name/split/key``)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    splits = BlendedMegatronDatasetBuilder(dataset_cls, list(SAMPLES), lambda: True, cfg).build()
    for split, ds in zip(("train", "valid", "test"), splits):
        out[f"{name}/{split}/len"] = np.asarray(len(ds))
        samples = [ds[i] for i in range(min(FIRST, len(ds)))]
        for key in keys:
            out[f"{name}/{split}/{key}"] = np.asarray([s[key] for s in samples]).astype(np.int16)


def _t5_datasets(tmp: str) -> dict:
    """Megatron's T5 datasets over the files ``_write`` left in ``tmp`` (the BERT datasets' process group)."""
    import types

    from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list

    tok = types.SimpleNamespace(cls=2, sep=3, mask=4, pad=0, eod=3, bos=2, eos=3, vocab_size=1000,
                                inv_vocab=dict(enumerate(T5_NAMES)), unique_identifiers={"class": "stand-in"},
                                additional_special_tokens_ids=list(range(900, 1000)))
    out = {}
    for name, (seq, dec, seed, data_path) in T5_DATASETS.items():
        cfg = T5MaskedWordPieceDatasetConfig(  # pretrain_t5's masking settings
            random_seed=seed, sequence_length=seq, sequence_length_decoder=dec, split="90,8,2", tokenizer=tok,
            blend=get_blend_from_list([f"{tmp}/{x}" if x.isalpha() else x for x in data_path]),
            path_to_cache=f"{tmp}/t5-{name}", masking_probability=0.15, short_sequence_probability=0.1,
            masking_max_ngram=10, masking_do_full_word=True, masking_do_permutation=False,
            masking_use_longer_ngrams=False, masking_use_geometric_distribution=True)
        _store(out, name, T5MaskedWordPieceDataset, cfg,
               ("text_enc", "text_dec", "labels", "loss_mask", "enc_mask", "dec_mask"))
    return out


def main() -> None:
    import tempfile

    from megatron.core.datasets import helpers

    with tempfile.TemporaryDirectory() as tmp:
        np.savez_compressed(os.path.join(HERE, "datasets.npz"), **_datasets(tmp))
        np.savez_compressed(os.path.join(HERE, "t5_datasets.npz"), **_t5_datasets(tmp))
    import torch.distributed as dist

    dist.destroy_process_group()

    out = {}
    for name, (n_docs, cseed, (lo, hi), samples, max_tokens, prob, seed, min_sent) in CASES.items():
        bounds, lengths = corpus(n_docs, cseed)
        docs = np.asarray(bounds, np.int64)[np.append(np.arange(lo, hi), hi)]  # Megatron: indices + [last + 1]
        mapping = helpers.build_mapping(docs, np.asarray(lengths, np.int32), INT32_MAX - 1, samples, max_tokens,
                                        prob, seed, False, min_sent)
        out[name] = {"docs": [n_docs, cseed], "range": [lo, hi], "samples": samples, "max_tokens": max_tokens,
                     "short_seq_prob": prob, "seed": seed, "min_sentences": min_sent,
                     "mapping": np.asarray(mapping, np.int64).tolist()}
    with open(os.path.join(HERE, "fixtures.json"), "w") as f:
        json.dump(out, f)
    print("wrote", {k: len(v["mapping"]) for k, v in out.items()})


if __name__ == "__main__":
    main()
