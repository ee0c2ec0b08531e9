"""T5 span corruption against fixtures written by Megatron-LM's own T5MaskedWordPieceDataset
(tests/data/megatron_t5_masking/make_fixtures.py, which says how to re-run it).

Exact: on the fixture's texts, target lengths and seeds omnitron's sample (encoder input, decoder input,
labels, loss mask, padding) equals Megatron's token for token: both draw from ``RandomState(seed)`` in the
same order. Statistics: on fresh texts from the same generator and fresh seeds, the corrupted-token count,
the span count and the span-length (in words) histogram agree with Megatron's within 5 standard errors.
"""
from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

from omnitron.core.data.t5_dataset import build_sample

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_t5_masking")
_spec = importlib.util.spec_from_file_location("t5_masking_fixtures", os.path.join(HERE, "make_fixtures.py"))
M = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(M)  # the text generator and vocabulary only; Megatron is imported by its main()
FIX = json.load(open(os.path.join(HERE, "fixtures.json")))
SUBWORDS = tuple(i for i, t in M.VOCAB.items() if t.startswith("##"))
IDS = {"cls": M.CLS, "sep": M.SEP, "pad": M.PAD}


def _sample(text, target, seed, prob=0.15):
    """omnitron's sample of ``text`` (already cut to ``target``) with ``RandomState(seed)``, as numpy."""
    s = build_sample(np.asarray(text, np.int64), np.random.RandomState(seed), seq_length=M.SEQ,
                     decoder_seq_length=M.DEC, ids=IDS, sentinels=tuple(range(M.SENTINEL0, M.V)),
                     subword_ids=SUBWORDS, target_length=target, masked_lm_prob=prob)
    return {k: v.numpy() for k, v in s.items()}


@pytest.mark.parametrize("case", range(len(FIX["exact"])), ids=lambda i: f"case{i}")
def test_same_sample_as_megatron(case):
    _check_case(FIX["exact"][case])


def test_same_samples_as_megatron_at_other_mask_probs():
    """--mask-prob 0.05, 0.25, 0.3 (Megatron's masking_probability): the same samples, token for token."""
    assert {c["prob"] for c in FIX["exact_prob"]} == set(M.PROBS)
    for c in FIX["exact_prob"]:
        _check_case(c)


def test_same_samples_as_megatron_on_texts_with_special_ids():
    """Texts holding [PAD] [UNK] [CLS] [SEP] [MASK] and sentinel ids: kept in the text as Megatron reads them, a
    [CLS] / [SEP] no span candidate, the padding mask where the encoder input holds [PAD]; token for token."""
    specials = set(M.SPECIAL_IDS)
    assert sum(any(t in specials for s in c["sentences"] for t in s) for c in FIX["exact_special"]) >= 80
    for c in FIX["exact_special"]:
        _check_case(c)


def _check_case(c):
    text = [t for s in c["sentences"] for t in s][: c["target"]]
    s = _sample(text, c["target"], c["seed"], c.get("prob", 0.15))
    t = int(sum(c["loss_mask"]))
    assert s["tokens"].tolist() == c["text_enc"]  # Megatron pads with [PAD] = 0 as well
    assert (~s["padding_mask"]).astype(int).tolist() == c["enc_mask"]
    assert s["decoder_tokens"].tolist() == c["text_dec"]
    # Megatron's dec_mask (t5_dataset.py: 0 where decoder_input == pad) from its own decoder input ([PAD] = 0)
    assert (~s["decoder_padding_mask"]).astype(int).tolist() == [int(t != M.PAD) for t in c["text_dec"]]
    assert s["loss_mask"].astype(int).tolist() == c["loss_mask"]
    assert s["labels"][:t].tolist() == c["labels"][:t]


def _span_words(labels, n):
    """Each span's length in words from a target's first ``n`` labels (sentinels start spans, the end token last)."""
    out = []
    for x in labels[: n - 1]:
        if x >= M.SENTINEL0:
            out.append(0)
        elif not M.VOCAB[int(x)].startswith("##"):
            out[-1] += 1
    return out


@pytest.mark.slow  # 12 s: the exact-sample test above covers the rules in the default suite
def test_span_statistics_match_megatron():
    """Means of per-sample counts: the difference of two independent means of n1, n2 samples has standard
    deviation sqrt(v1 / n1 + v2 / n2); histogram bins as proportions p with variance p (1 - p) / spans. At 5
    standard errors a correct implementation fails about once in 10^6 per statistic."""
    rng = np.random.RandomState(np.random.SeedSequence().entropy % 2**32)  # fresh texts and seeds every run
    masked, spans, hist = [], [], np.zeros(M.MAX_NGRAM + 1)
    for _ in range(len(FIX["stats"]["masked"])):
        text = [t for s in M.random_text(rng, M.SEQ - 2) for t in s][: M.SEQ - 2]
        s = _sample(text, M.SEQ - 2, int(rng.randint(2**31)))
        n = int(s["loss_mask"].sum())
        words = _span_words(s["labels"], n)
        masked.append(n - 1 - len(words))
        spans.append(len(words))
        for w in words:
            hist[min(w, M.MAX_NGRAM)] += 1
    for ours, theirs in ((masked, FIX["stats"]["masked"]), (spans, FIX["stats"]["spans"])):
        a, b = np.asarray(ours, float), np.asarray(theirs, float)
        se = np.sqrt(a.var() / len(a) + b.var() / len(b))
        assert abs(a.mean() - b.mean()) <= 5 * se + 1e-12, (a.mean(), b.mean(), se)
    h = np.asarray(FIX["stats"]["span_words_hist"], float)
    p, q = hist / hist.sum(), h / h.sum()
    se = np.sqrt(p * (1 - p) / hist.sum() + q * (1 - q) / h.sum())
    assert (np.abs(p - q) <= 5 * se + 1e-12).all(), (p.round(3), q.round(3))
    assert q[2:].sum() > 0.2  # the fixture itself has multi-word spans (Megatron's n-grams, not one-word masks)
