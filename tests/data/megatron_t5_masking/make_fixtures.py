"""Writes ``fixtures.json`` beside this file WITH MEGATRON-LM'S OWN CODE: the T5 samples and span statistics
omnitron's T5 masking must reproduce (tests/data/test_t5_megatron_masking.py).

Needs the Megatron-LM d98e8a6 snapshot (``megatron/``), numpy, torch and packaging; runs on CPU, offline.
Run from the omnitron root:

    PYTHONPATH=/path/to/Megatron-LM python tests/data/megatron_t5_masking/make_fixtures.py

(On Python < 3.12 Megatron imports ``typing.override``; the script supplies a stand-in.) omnitron is not
imported. Megatron's ``T5MaskedWordPieceDataset.__getitem__`` (with ``MaskedWordPieceDataset``'s
``_create_masked_lm_predictions``) runs on a stand-in object that holds the sample's sentences, a sample index
row ``(0, sentences, target length)`` and pretrain_t5's masking settings (whole words, max n-gram 10, geometric
n, no permutation), over a synthetic WordPiece vocabulary (:data:`VOCAB`): ids ``3k`` at or above ``FIRST_ID``
are ``##`` pieces. Stored: EXACT cases (text, target length, seed and Megatron's encoder input, decoder input,
labels, loss mask), EXACT_PROB more at other masking probabilities (``--mask-prob``), EXACT_SPECIAL more whose
text holds special ids ([PAD] [UNK] [CLS] [SEP] [MASK], sentinels; kept in the text, as Megatron reads it) and, over
STATS_SAMPLES texts from :func:`random_text`, the per-sample corrupted-token and
span counts and the histogram of span lengths in words.
"""
from __future__ import annotations

import json
import os
import sys
import typing
from types import SimpleNamespace

import numpy as np

if not hasattr(typing, "override"):
    typing.override = lambda f: f

HERE = os.path.dirname(os.path.abspath(__file__))
PAD, UNK, CLS, SEP, MASK, FIRST_ID, SENTINEL0, V = 0, 1, 2, 3, 4, 10, 900, 1000
SEQ, DEC = 128, 40  # encoder / decoder lengths: texts of at most 126 tokens, at most 19 corrupted (2 * 19 + 2)
EXACT, STATS_SAMPLES, MAX_NGRAM = 300, 4000, 10
# EXACT_PROB cases at other masking probabilities, texts of at most PROB_TEXT tokens: at p = 0.3 at most
# round(0.3 * 64) = 19 corrupted tokens, a target of at most 2 * 19 + 1 = 39 <= DEC (Megatron never asserts)
EXACT_PROB, PROBS, PROB_TEXT = 120, (0.05, 0.25, 0.3), 64
VOCAB = {i: ("##p%d" % i if i >= FIRST_ID and i % 3 == 0 else "w%d" % i) for i in range(SENTINEL0)}
VOCAB.update({i: f"<extra_id_{i - SENTINEL0}>" for i in range(SENTINEL0, V)})
EXACT_SPECIAL, SPECIAL_SHARE = 120, 0.1  # texts holding special ids (0-4 and sentinels), as Megatron reads them
SPECIAL_IDS = (PAD, UNK, CLS, SEP, MASK, SENTINEL0, SENTINEL0 + 1, V - 1)


def random_text(rng: np.random.RandomState, n: int) -> list[list[int]]:
    """About ``n`` tokens of synthetic words (1 to 4 pieces: a word start, then ``##`` pieces), cut into
    sentences of 1 to 12 words; a word may run past ``n``."""
    starts = np.array([i for i in range(FIRST_ID, SENTINEL0) if i % 3])
    pieces = np.array([i for i in range(FIRST_ID, SENTINEL0) if i % 3 == 0])
    sentences, sentence, total = [], [], 0
    while total < n:
        k = int(rng.choice(4, p=[0.55, 0.25, 0.12, 0.08]))
        sentence += [int(rng.choice(starts))] + [int(x) for x in rng.choice(pieces, k)]
        total += 1 + k
        if rng.random_sample() < 1 / 12 or total >= n:
            sentences.append(sentence)
            sentence = []
    return sentences


def megatron_sample(sentences, target: int, seed: int, prob: float = 0.15) -> dict:
    """Megatron's T5 sample of ``sentences`` at ``target`` tokens with ``RandomState(seed)``, masking
    probability ``prob`` (``--mask-prob``)."""
    from megatron.core.datasets.masked_dataset import MaskedWordPieceDataset
    from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset

    class Standin:
        _create_masked_lm_predictions = MaskedWordPieceDataset._create_masked_lm_predictions
        _get_token_mask = T5MaskedWordPieceDataset._get_token_mask
        getitem = T5MaskedWordPieceDataset.__getitem__

    tok = SimpleNamespace(cls=CLS, sep=SEP, mask=MASK, bos=CLS, eos=SEP, pad=PAD, inv_vocab=VOCAB,
                          additional_special_tokens_ids=list(range(SENTINEL0, V)))
    s = Standin()
    s.sample_index, s.dataset, s._pad_token_id = [(0, len(sentences), target)], sentences, PAD
    s.config = SimpleNamespace(random_seed=seed, sequence_length=SEQ, sequence_length_encoder=SEQ,
                               sequence_length_decoder=DEC, tokenizer=tok, masking_probability=prob,
                               masking_max_ngram=MAX_NGRAM, masking_do_full_word=True, masking_do_permutation=False,
                               masking_use_longer_ngrams=False, masking_use_geometric_distribution=True)
    return {k: np.asarray(v).tolist() for k, v in s.getitem(0).items()}


def span_words(sample: dict) -> list[int]:
    """Each span's length in words, from a Megatron sample's labels (sentinels start spans)."""
    labels = [x for x, m in zip(sample["labels"], sample["loss_mask"]) if m][:-1]
    out = []
    for x in labels:
        if x >= SENTINEL0:
            out.append(0)
        elif VOCAB[x][:2] != "##":
            out[-1] += 1
    return out


def main() -> None:
    rng = np.random.RandomState(1234)
    exact = []
    for i in range(EXACT):
        sentences = random_text(rng, int(rng.randint(1, SEQ - 1)))
        target = SEQ - 2 if rng.random_sample() < 0.7 else int(rng.randint(2, SEQ - 1))
        seed = int(rng.randint(2**31))
        exact.append({"sentences": sentences, "target": target, "seed": seed,
                      **megatron_sample(sentences, target, seed)})
    masked, spans, hist = [], [], [0] * (MAX_NGRAM + 1)
    for i in range(STATS_SAMPLES):
        sample = megatron_sample(random_text(rng, SEQ - 2), SEQ - 2, 10_000 + i)
        words = span_words(sample)
        masked.append(int(sum(sample["loss_mask"])) - 1 - len(words))
        spans.append(len(words))
        for w in words:
            hist[min(w, MAX_NGRAM)] += 1
    rng = np.random.RandomState(4321)  # other --mask-prob values: their own stream, the cases above unchanged
    exact_prob = []
    for i in range(EXACT_PROB):
        prob = PROBS[i % len(PROBS)]
        sentences = random_text(rng, int(rng.randint(1, PROB_TEXT)))
        target = PROB_TEXT if rng.random_sample() < 0.7 else int(rng.randint(2, PROB_TEXT))
        seed = int(rng.randint(2**31))
        exact_prob.append({"sentences": sentences, "target": target, "seed": seed, "prob": prob,
                           **megatron_sample(sentences, target, seed, prob)})
    rng = np.random.RandomState(8642)  # special ids in the text: their own stream
    exact_special = []
    for i in range(EXACT_SPECIAL):
        sentences = [[int(rng.choice(SPECIAL_IDS)) if rng.random_sample() < SPECIAL_SHARE else t for t in s]
                     for s in random_text(rng, int(rng.randint(1, PROB_TEXT)))]
        target = PROB_TEXT if rng.random_sample() < 0.7 else int(rng.randint(2, PROB_TEXT))
        seed = int(rng.randint(2**31))
        exact_special.append({"sentences": sentences, "target": target, "seed": seed,
                              **megatron_sample(sentences, target, seed)})
    with open(os.path.join(HERE, "fixtures.json"), "w") as f:
        json.dump({"seq": SEQ, "dec": DEC, "exact": exact, "exact_prob": exact_prob, "exact_special": exact_special,
                   "stats": {"masked": masked, "spans": spans, "span_words_hist": hist}}, f)
    print(f"wrote {len(exact)} exact cases; mean masked {np.mean(masked):.3f}, spans {np.mean(spans):.3f}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
