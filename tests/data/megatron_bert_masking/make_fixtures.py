"""Writes ``fixtures.pt`` beside this file WITH MEGATRON-LM'S OWN CODE: BERT samples (segments, short-sample cut,
whole-word n-gram masking) that omnitron's ``build_sample`` must reproduce (tests/data/test_bert_masking_megatron.py).

Needs the Megatron-LM d98e8a6 snapshot (``megatron/``) on the path; CPU, one process, offline. Run from the
omnitron root:

    PYTHONPATH=/path/to/Megatron-LM python tests/data/megatron_bert_masking/make_fixtures.py

omnitron is not imported. Megatron's ``BERTMaskedWordPieceDataset.__getitem__`` runs on an instance whose
constructor is skipped (no indexed dataset, no cache): its sample index and sentences are set directly, its
tokenizer is a stand-in over a synthetic vocabulary with ``##`` continuation pieces. Masking options are
pretrain_bert's: probability 0.15 (``--mask-prob``; PROB_CASES more cases at other values), n-grams up to 3,
whole words, no permutation, 1/n n-gram probabilities; SPECIAL_CASES more whose text holds special ids.
Stored per case: the sentences, target length, seed,
masking probability and Megatron's sample (sample index 0), as int8.
"""
from __future__ import annotations

import os
import types

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
V, WORDS = 64, 34  # ids 0-4 special, 5..33 word starts, 34..63 "##" continuations


def _vocab() -> dict:
    names = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    names += [f"w{i}" for i in range(5, WORDS)] + [f"##c{i}" for i in range(WORDS, V)]
    return dict(enumerate(names))


def _dataset(binary: bool, seq_length: int, seed: int, prob: float = 0.15):
    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset

    ds = object.__new__(BERTMaskedWordPieceDataset)
    tok = types.SimpleNamespace(cls=2, sep=3, mask=4, pad=0, inv_vocab=_vocab())
    ds.config = types.SimpleNamespace(
        tokenizer=tok, classification_head=binary, random_seed=seed, sequence_length=seq_length,
        masking_probability=prob, masking_max_ngram=3, masking_do_full_word=True, masking_do_permutation=False,
        masking_use_longer_ngrams=False, masking_use_geometric_distribution=False)
    ds.token_lookup = sorted(tok.inv_vocab.keys())
    ds._pad_token_id = 0
    return ds


def _sentences(rng, binary: bool, seq_length: int, special: float = 0.0) -> list[list[int]]:
    """2-6 sentences (1 with no binary head) of random ids, ~40% continuations, often longer than the sample;
    with ``special`` > 0 that share of the ids replaced by special ones (0-4: [PAD] [UNK] [CLS] [SEP] [MASK])."""
    n = int(rng.randint(2, 7)) if binary else int(rng.randint(1, 4))
    out = []
    for _ in range(n):
        k = int(rng.randint(1, seq_length // 2))
        cont = rng.random_sample(k) < 0.4
        out.append([int(rng.randint(WORDS, V)) if c else int(rng.randint(5, WORDS)) for c in cont])
        if special:
            out[-1] = [int(rng.randint(0, 5)) if rng.random_sample() < special else t for t in out[-1]]
    return out


PROB_CASES, PROBS = 150, (0.05, 0.3, 0.5)
SPECIAL_CASES, SPECIAL_SHARE = 150, 0.15  # texts holding special ids, as Megatron reads them (kept, not dropped)


def _case(rng, i: int, prob: float, special: float = 0.0) -> dict:
    """One case: random sentences, target and seed; Megatron's sample of them at masking probability ``prob``."""
    binary, seq_length = bool(i % 3), int(rng.choice([16, 32, 64, 128]))
    seed = int(rng.randint(0, 2**31))
    ds = _dataset(binary, seq_length, seed, prob)
    sentences = _sentences(rng, binary, seq_length, special)
    short = rng.random_sample() < 0.3
    target = int(rng.randint(2, seq_length - 2)) if short else seq_length - 3
    ds.sample_index = np.asarray([[0, len(sentences), target]], np.int64)
    ds.dataset = [list(s) for s in sentences]
    sample = ds[0]
    return {"binary": binary, "seq_length": seq_length, "seed": seed, "target": target, "prob": prob,
            "sentences": [torch.tensor(s, dtype=torch.int8) for s in sentences],  # ids < 64: int8 keeps
            **{k: torch.as_tensor(np.asarray(v)).to(torch.int8) for k, v in sample.items()}}  # it small


def main():
    rng = np.random.RandomState(20261206)
    cases = [_case(rng, i, 0.15) for i in range(300)]
    rng = np.random.RandomState(20261207)  # the other probabilities: their own stream, the first cases unchanged
    cases += [_case(rng, i, PROBS[i % len(PROBS)]) for i in range(PROB_CASES)]
    rng = np.random.RandomState(20261208)  # special ids in the text: their own stream too
    cases += [_case(rng, i, 0.15, SPECIAL_SHARE) for i in range(SPECIAL_CASES)]
    torch.save({"vocab": _vocab(), "cases": cases}, os.path.join(HERE, "fixtures.pt"))
    print(f"wrote {len(cases)} cases")


if __name__ == "__main__":
    main()
