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
"""
from __future__ import annotations

import json
import os

import numpy as np

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


def main() -> None:
    from megatron.core.datasets import helpers

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
