"""BERT data: WordPiece tokenizer, Megatron masking statistics, two-segment structure, padding,
determinism per (seed, index), span fallback for one-sequence documents, and clear errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from omnitron.core.data import build_tokenizer
from omnitron.core.data.bert_dataset import BertDataset, mask_tokens, sentence_table, truncate_segments
from omnitron.core.data.tokenizers import TokenizerError
from omnitron.testing.data import write_documents as _write
from omnitron.core.data.tokenizers.wordpiece import build_wordpiece_vocab

V = 1000


class _Tok:
    """The ids a BERT dataset reads (a tokenizer stand-in over a synthetic vocabulary of ``V`` ids)."""

    name, vocab_size, pad, unk, cls, sep, mask = "synthetic", V, 0, 1, 2, 3, 4
    special_ids = (0, 1, 2, 3, 4)


def _consecutive_docs(rng, n_docs, max_doc_tokens=40):
    """Documents whose text is a run of consecutive ids (so any contiguous piece is recognisable),
    cut into sentences of 2-6 tokens; at most ``max_doc_tokens`` per document (no truncation at seq 64)."""
    docs, start = [], 10
    for _ in range(n_docs):
        n = int(rng.randint(8, max_doc_tokens + 1))
        ids = np.arange(start, start + n)
        start += n + 1
        cuts = np.cumsum(rng.randint(2, 7, size=n))
        docs.append([s for s in np.split(ids, cuts[cuts < n]) if len(s)])
    return docs


def _dataset(tmp_path, docs, n=400, seed=3, name="d", **kw):
    ds = _write(tmp_path / name, docs)
    return BertDataset(ds, np.arange(ds.num_documents), n, seq_length=64, seed=seed, tokenizer=_Tok(),
                       cache_dir=str(tmp_path / f"cache-{name}-{seed}"), **kw)


def test_masking_statistics_match_megatron():
    rng = np.random.RandomState(0)
    vocab_ids = np.arange(5, V)
    chosen = kept = masked = replaced = candidates_total = 0
    for _ in range(400):
        tokens = rng.randint(5, V, size=rng.randint(20, 120))
        cand = np.arange(1, len(tokens) - 1)
        special = np.ones(len(tokens), bool)
        special[cand] = False
        out, pos, orig = mask_tokens(tokens, special, rng, mask_id=4, vocab_ids=vocab_ids, target=10**6)
        assert np.array_equal(orig, tokens[pos]) and set(pos) <= set(cand)
        untouched = np.setdiff1d(np.arange(len(tokens)), pos)
        assert np.array_equal(out[untouched], tokens[untouched])  # only chosen positions change
        assert len(pos) == max(1, int(round(0.15 * len(tokens))))  # single-token words fill the budget
        candidates_total += len(cand)
        chosen += len(pos)
        masked += int((out[pos] == 4).sum())
        kept += int((out[pos] == tokens[pos]).sum())
        replaced += int(((out[pos] != 4) & (out[pos] != tokens[pos])).sum())
    assert abs(chosen / (candidates_total + 800) - 0.15) < 0.005  # the budget counts [CLS] / [SEP] too
    assert abs(masked / chosen - 0.8) < 0.02
    assert abs(kept / chosen - 0.1) < 0.015 and abs(replaced / chosen - 0.1) < 0.015


def test_truncation_keeps_contiguous_pieces():
    rng = np.random.RandomState(1)
    for _ in range(50):
        a, b = np.arange(rng.randint(1, 40)), np.arange(100, 100 + rng.randint(1, 40))
        ta, tb = truncate_segments(a, b, 20, rng)
        assert len(ta) + len(tb) <= 20 and len(ta) >= 1 and len(tb) >= 1
        for t, orig in ((ta, a), (tb, b)):
            assert np.all(np.diff(t) == 1) and t[0] in orig and t[-1] in orig


def test_samples_have_megatron_structure(tmp_path):
    docs = _consecutive_docs(np.random.RandomState(2), 60)
    sentence_starts = {int(s[0]) for d in docs for s in d}
    ds = _dataset(tmp_path, docs)
    assert len(ds) >= 400
    randoms = []
    for i in range(200):
        s = ds[i]
        tok, types, pad = s["tokens"].numpy(), s["tokentype_ids"].numpy(), s["padding_mask"].numpy()
        restored = tok.copy()
        lm = s["loss_mask"].numpy().astype(bool)
        restored[lm] = s["labels"].numpy()[lm]
        n = int((~pad).sum())
        assert not pad[:n].any() and pad[n:].all() and (tok[n:] == _Tok.pad).all() and not lm[n:].any()
        seps = np.flatnonzero(restored[:n] == _Tok.sep)
        assert restored[0] == _Tok.cls and len(seps) == 2 and seps[1] == n - 1
        assert not lm[[0, seps[0], seps[1]]].any()  # specials are never masked
        assert (types[: seps[0] + 1] == 0).all() and (types[seps[0] + 1: n] == 1).all() and (types[n:] == 0).all()
        a, b = restored[1: seps[0]], restored[seps[0] + 1: n - 1]
        first, second = (b, a) if s["is_random"] else (a, b)
        text = np.concatenate([first, second])
        target = int(ds.mapping[i][2])
        assert len(text) <= target  # a short sample is cut to its target (Megatron)
        if len(text) < target:  # not cut: in order one contiguous piece of a document, whole sentences
            assert np.all(np.diff(text) == 1), (i, text)
            assert int(first[0]) in sentence_starts and int(second[0]) in sentence_starts
        masked = int(lm.sum())
        # Megatron's budget (tokens counting [CLS]/[SEP]); single-token words (no ## ids here) fill its floor
        assert masked == int(min(0.15 * ds.mapping[i][2], max(1, round(0.15 * n))))
        randoms.append(int(s["is_random"]))
    assert 0.4 < np.mean(randoms) < 0.6


def test_deterministic_per_seed_and_index(tmp_path):
    docs = _consecutive_docs(np.random.RandomState(4), 30)
    a, b = _dataset(tmp_path, docs, name="a"), _dataset(tmp_path, docs, name="b")
    c = _dataset(tmp_path, docs, name="a", seed=4)
    for i in (0, 7, 123):
        sa, sb = a[i], b[i]
        assert all(torch.equal(sa[k], sb[k]) for k in sa) and all(torch.equal(sa[k], a[i][k]) for k in sa)
    assert any(not torch.equal(a[i]["tokens"], c[i]["tokens"]) for i in range(5))


def test_one_sequence_documents_use_token_spans_and_no_binary_head(tmp_path):
    docs = [[np.arange(10 + 200 * d, 10 + 200 * d + 150)] for d in range(6)]  # one sequence each
    ds = _write(tmp_path / "flat", docs)
    table = sentence_table(ds, np.arange(6), 15)
    assert table["bounds"].tolist() == [10 * d for d in range(7)] and (table["length"] == 15).all()
    one = BertDataset(ds, np.arange(6), 50, seq_length=64, seed=1, tokenizer=_Tok(), binary_head=False,
                      cache_dir=str(tmp_path / "c"))
    for i in range(20):
        s = one[i]
        n = int((~s["padding_mask"]).sum())
        restored = s["tokens"].clone()
        restored[s["loss_mask"].bool()] = s["labels"][s["loss_mask"].bool()]
        assert s["is_random"] == 0 and (s["tokentype_ids"] == 0).all() and restored[n - 1] == _Tok.sep
        assert (np.diff(restored[1: n - 1].numpy()) == 1).all() and n <= 64


def test_errors_name_the_fix(tmp_path):
    ds = _write(tmp_path / "x", [[np.arange(10, 20)]])
    with pytest.raises(ValueError, match="BertWordPieceLowerCase"):
        BertDataset(ds, np.arange(1), 4, seq_length=64, seed=1,
                    tokenizer=build_tokenizer("NullTokenizer", vocab_size=50),
                    cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="--no-bert-binary-head"):  # one 10-token sentence: no pair
        BertDataset(ds, np.arange(1), 4, seq_length=256, seed=1, tokenizer=_Tok(), cache_dir=str(tmp_path / "c"))


def test_wordpiece_tokenizer(tmp_path):
    texts = ["Call me Ishmael. Some years ago, never mind how long.", "The whale! The white whale?"] * 3
    vocab = build_wordpiece_vocab(texts, 200)
    assert vocab == build_wordpiece_vocab(list(reversed(texts)), 200)  # deterministic
    assert vocab[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] and "whale" in vocab and "##w" in vocab
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(vocab) + "\n")
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=str(path))
    assert (tok.pad, tok.cls, tok.sep, tok.mask, tok.eod) == (0, 2, 3, 4, 3) and tok.vocab_size == len(vocab)
    ids = tok.encode("The WHALE, shoal")
    assert tok.decode(ids) == "the whale, shoal" and vocab.index("whale") in ids
    assert tok.unk not in ids and "shoal" not in vocab  # unseen words of seen characters split into pieces
    bad = tmp_path / "bad.txt"
    bad.write_text("hello\nworld\n")
    with pytest.raises(TokenizerError, match="special tokens"):
        build_tokenizer("BertWordPieceCase", vocab_file=str(bad))
