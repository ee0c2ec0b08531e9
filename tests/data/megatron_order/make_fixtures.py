"""Writes ``fixtures.json`` beside this file WITH MEGATRON-LM'S OWN CODE: the sample order omnitron must reproduce.

Needs a Megatron-LM checkout (snapshot d98e8a64dd was used) with its C++ dataset helpers built
(``make -C megatron/core/datasets``), numpy and torch; it runs on CPU, offline. Run from the omnitron root:

    MEGATRON_LM=/path/to/Megatron-LM python tests/data/megatron_order/make_fixtures.py

(On Python < 3.12 Megatron imports ``typing.override``; the script supplies a stand-in.) omnitron is not imported:
the corpora are written with Megatron's IndexedDatasetBuilder from :func:`corpus_documents` (which the test
repeats), the datasets built with Megatron's BlendedMegatronDatasetBuilder, and every index array (document,
sample, shuffle; blend dataset / dataset-sample) plus the token ids of each split's first samples is stored.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import typing

import numpy as np

if not hasattr(typing, "override"):
    typing.override = lambda f: f

HERE = os.path.dirname(os.path.abspath(__file__))
SEQ, FIRST = 16, 4  # sequence length; token ids stored for each split's first FIRST samples
CORPORA = {"a": (157, 1), "b": (61, 2), "c": (97, 3), "d": (620, 4)}  # name -> (documents, seed)


def corpus_documents(num_docs: int, seed: int) -> list[np.ndarray]:
    """The synthetic corpus: document lengths 1..40 and token ids below 50000 from RandomState(seed)."""
    rng = np.random.RandomState(seed)
    lengths = rng.randint(1, 41, num_docs)
    return [rng.randint(0, 50000, n).astype(np.int32) for n in lengths]


# name -> (data path, split, (train, valid, test) samples, seed); data paths name the corpora above.
CASES = {
    "single_default_split": (["d"], "969,30,1", (100, 20, 5), 1234),  # (every split gets documents: Megatron
    # loops forever on an empty one)
    "single_half_epoch": (["a"], "1", (90, 0, 0), 7),
    "single_1.17_epochs": (["a"], "1", (230, 0, 0), 7),  # the final partial epoch shuffled apart
    "single_1.9_epochs": (["a"], "1", (370, 0, 0), 7),  # the final epoch is >= 80% used: shuffled with the rest
    "single_2.4_epochs": (["a"], "1", (470, 0, 0), 5),
    "single_3_epochs_split": (["c"], "80,15,5", (350, 60, 10), 11),
    "blend_two": (["0.7", "a", "0.3", "b"], "90,8,2", (200, 30, 6), 1234),
    "blend_three": (["0.5", "a", "0.3", "b", "0.2", "c"], "98,2", (300, 12, 0), 3),
    "blend_integer_weights": (["30", "a", "70", "c"], "1", (500, 0, 0), 1234),
    "one_dataset_blend": (["1.0", "d"], "969,30,1", (150, 10, 3), 1234),
    "unweighted_two": (["a", "b"], "98,2", (40, 5, 0), 1234),
    "unweighted_three": (["a", "b", "c"], "90,10", (100, 8, 0), 9),
}
PER_SPLIT = {  # name -> ((train, valid, test) data paths, samples, seed)
    "per_split": ((["0.6", "a", "0.4", "b"], ["c"], ["1.0", "b"]), (120, 30, 8), 1234),
}
SPLIT_BOUND_SPLITS = ("969,30,1", "98,2", "949,50,1", "90,5,5", "1,1,1", "99,1,0")


class _Tokenizer:  # what Megatron's GPTDataset reads of a tokenizer
    eod, vocab_size, unique_identifiers = 50000, 50001, {"class": "fixture"}

    @property
    def pad(self):
        raise NotImplementedError


def _write_corpora(root: str) -> dict[str, str]:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefixes = {}
    for name, (n, seed) in CORPORA.items():
        prefixes[name] = os.path.join(root, name)
        builder = IndexedDatasetBuilder(prefixes[name] + ".bin", dtype=np.int32)
        for doc in corpus_documents(n, seed):
            builder.add_document(doc, [len(doc)])
        builder.finalize(prefixes[name] + ".idx")
    return prefixes


def _tokens(ds, i: int) -> list[int]:
    s = ds[i]
    return s["tokens"].tolist() + s["labels"][-1:].tolist()


def _gpt(ds) -> dict:
    return {"kind": "gpt", "len": len(ds), "documents": [int(ds.indices[0]), int(ds.indices[-1]) + 1],
            "document_index": ds.document_index.tolist(), "sample_index": ds.sample_index.tolist(),
            "shuffle_index": ds.shuffle_index.tolist()}


def _describe(ds) -> dict | None:
    from megatron.core.datasets.blended_dataset import BlendedDataset

    if ds is None:
        return None
    if isinstance(ds, BlendedDataset):
        out = {"kind": "blend", "len": len(ds), "dataset_index": ds.dataset_index.tolist(),
               "dataset_sample_index": ds.dataset_sample_index.tolist(), "parts": [_gpt(d) for d in ds.datasets]}
    else:
        out = _gpt(ds)
    out["first_tokens"] = [_tokens(ds, i) for i in range(min(FIRST, len(ds)))]
    return out


def _build(prefixes, cache, seed, sizes, **where):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list

    def blend(path):
        return get_blend_from_list([prefixes.get(x, x) for x in path]) if path else None

    if "per_split" in where:
        kw = {"blend_per_split": [blend(p) for p in where["per_split"]]}
    else:
        kw = {"blend": blend(where["data_path"]), "split": where["split"]}
    cfg = GPTDatasetConfig(random_seed=seed, sequence_length=SEQ, path_to_cache=cache, tokenizer=_Tokenizer(),
                           reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False, **kw)
    return BlendedMegatronDatasetBuilder(GPTDataset, list(sizes), lambda: True, cfg).build()


def _split_bounds() -> dict:
    """Per --split: which splits are None, and the inner bounds [train end, test start] for 1..399 documents
    (train starts at 0, test ends at the document count)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                        parse_and_normalize_split)

    out = {}
    for split in SPLIT_BOUND_SPLITS:
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
        bounds = []
        for n in range(1, 400):
            ends = [int(round(m[i] * float(n))) for m in matrix if m is not None for i in (0, 1)]
            assert ends[0] == 0 and ends[-1] == n and all(a == b for a, b in zip(ends[1:-1:2], ends[2:-1:2]))
            bounds.append(ends[1:-1:2][:2] if len(ends) == 6 else ends[1:2])
        out[split] = {"none": [m is None for m in matrix], "bounds": bounds}
    return out


def main() -> None:
    import faulthandler

    faulthandler.dump_traceback_later(300, exit=True)
    sys.path.insert(0, os.environ["MEGATRON_LM"])
    import logging

    logging.disable(logging.WARNING)
    root = tempfile.mkdtemp()
    prefixes = _write_corpora(root)
    out = {"megatron": "d98e8a64dd", "seq_length": SEQ, "corpora": CORPORA, "cases": {},
           "split_bounds": _split_bounds()}
    for name, (path, split, sizes, seed) in CASES.items():
        got = _build(prefixes, os.path.join(root, "cache", name), seed, sizes, data_path=path, split=split)
        out["cases"][name] = {"data_path": path, "split": split, "samples": sizes, "seed": seed,
                              "splits": [_describe(d) for d in got]}
    for name, (paths, sizes, seed) in PER_SPLIT.items():
        got = _build(prefixes, os.path.join(root, "cache", name), seed, sizes, per_split=paths)
        out["cases"][name] = {"per_split": paths, "samples": sizes, "seed": seed,
                              "splits": [_describe(d) for d in got]}
    with open(os.path.join(HERE, "fixtures.json"), "w") as f:
        json.dump(out, f, separators=(",", ":"))


if __name__ == "__main__":
    main()
