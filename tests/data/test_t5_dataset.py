"""T5 data: whole-word spans within the corruption budget, sample structure (sentinels in order, no end
token on the encoder input, [CLS]-shifted decoder input, masks, padding), exact reconstruction of the text
from the encoder input and the target, determinism per (seed, index), WordPiece sentinels, errors.
Megatron's own samples and span statistics: tests/data/test_t5_megatron_masking.py."""
from __future__ import annotations

import numpy as np
import pytest

from omnitron.core.data import build_tokenizer
from omnitron.core.data.t5_dataset import T5Dataset, masked_spans
from omnitron.core.data.tokenizers import TokenizerError
from omnitron.testing.data import write_documents as _write

V, SENTINELS = 1000, tuple(range(900, 1000))


class _Tok:
    """The ids a T5 dataset reads (a tokenizer stand-in over a synthetic vocabulary of ``V`` ids)."""

    name, vocab_size, pad, unk, cls, sep, mask = "synthetic", V, 0, 1, 2, 3, 4
    sentinels = SENTINELS
    special_ids = (0, 1, 2, 3, 4) + SENTINELS


def test_spans_are_whole_words_within_the_budget():
    """Spans cover whole words (a ``##`` piece never starts one), never overlap, and hold at most the budget
    ``min(0.15 target, max(1, round(0.15 n)))``; with one-token words the greedy fill reaches its floor."""
    rng = np.random.RandomState(0)
    pieces = np.arange(500, 600)
    for _ in range(500):
        n = int(rng.randint(1, 120))
        target = n if rng.random_sample() < 0.5 else n + int(rng.randint(0, 50))
        words = rng.random_sample() < 0.5
        text = np.where(words & (rng.random_sample(n) < 0.4), rng.choice(pieces, n), rng.randint(10, 500, n))
        spans = masked_spans(text, rng, subword_ids=tuple(pieces) if words else (), target_length=target)
        flat = [p for sp in spans for p in sp]
        budget = min(0.15 * target, max(1, round(0.15 * n)))
        assert len(flat) == len(set(flat)) <= budget and flat == sorted(flat)
        for sp in spans:
            assert sp == list(range(sp[0], sp[-1] + 1))
            assert sp[0] == 0 or not (words and text[sp[0]] in pieces)  # starts a word
            assert sp[-1] + 1 == n or not (words and text[sp[-1] + 1] in pieces)  # ends one
        if not words:
            assert len(flat) == min(n, int(np.floor(budget)))


def _docs(rng, n_docs=30):
    """Documents of consecutive ids (10..899), cut into sentences of 2-9 tokens."""
    docs, start = [], 10
    for _ in range(n_docs):
        n = int(rng.randint(6, 60))
        ids = np.arange(start, start + n) % 890 + 10
        start += n
        cuts = np.cumsum(rng.randint(2, 10, size=n))
        docs.append([s for s in np.split(ids, cuts[cuts < n]) if len(s)])
    return docs


def _dataset(tmp_path, n=200, seed=3, seq_length=48, decoder_seq_length=16, name="d", **kw):
    ds = _write(tmp_path / name, _docs(np.random.RandomState(1)))
    return T5Dataset(ds, np.arange(ds.num_documents), n, seq_length=seq_length,
                     decoder_seq_length=decoder_seq_length, seed=seed, tokenizer=_Tok(),
                     cache_dir=str(tmp_path / f"cache-{name}-{seed}"), **kw)


def _fill(encoder_tokens, target):
    """The text from the encoder input (no end token, no padding) with every sentinel replaced by
    the tokens that follow it in the target."""
    spans, current = {}, None
    for t in target[:-1]:
        if t in SENTINELS:
            current = spans.setdefault(t, [])
        else:
            current.append(t)
    return [x for t in encoder_tokens for x in (spans[t] if t in SENTINELS else [t])]


def _check_sample(s, text, target):
    """Structure of one sample and the exact text back from its encoder input and target."""
    s = {k: v.numpy() for k, v in s.items()}
    n, t = int((~s["padding_mask"]).sum()), int(s["loss_mask"].sum())
    enc, labels = s["tokens"][:n].tolist(), s["labels"][:t].tolist()
    assert not s["padding_mask"][:n].any() and (s["tokens"][n:] == _Tok.pad).all()
    assert labels[-1] == _Tok.sep and (s["loss_mask"][:t] == 1).all() and _Tok.sep not in enc  # no end token
    assert (s["labels"][t:] == _Tok.pad).all() and (s["loss_mask"][t:] == 0).all()
    assert s["decoder_tokens"][:t].tolist() == [_Tok.cls] + labels[:-1]
    used = [x for x in enc if x in SENTINELS]
    assert used == list(SENTINELS[:len(used)]) == [x for x in labels if x in SENTINELS]  # in order, once each
    assert _fill(enc, labels) == text
    m = len(text)  # one-token words: the greedy fill reaches the budget's floor
    assert len(labels) - 1 - len(used) == min(m, int(np.floor(min(0.15 * target, max(1, round(0.15 * m))))))


def test_samples_structure_and_exact_reconstruction(tmp_path):
    ds = _dataset(tmp_path, decoder_seq_length=16)  # text <= 46 tokens: <= 6 corrupted, <= 6 spans, the end
    for i in range(len(ds)):
        target = int(ds.mapping[i][2])
        _check_sample(ds[i], np.concatenate(ds.sentences(i))[:target].tolist(), target)


def test_mock_data_samples(tmp_path):
    from omnitron.core.data.config import DataConfig
    from omnitron.core.data.t5_dataset import MockT5Dataset, build_t5_datasets

    cfg = DataConfig(mock_data=True, seq_length=48, seed=5)
    train, valid, test = build_t5_datasets(cfg, _Tok(), train_samples=40, valid_samples=8, test_samples=0,
                                           decoder_seq_length=16)
    assert isinstance(train, MockT5Dataset) and len(train) == 40 and len(valid) == 8 and test is None
    for i in range(len(train)):
        _check_sample(train[i], np.concatenate(train.sentences(i))[:46].tolist(), 46)
    again = build_t5_datasets(cfg, _Tok(), train_samples=40, valid_samples=0, test_samples=0, decoder_seq_length=16)
    assert all((train[7][k] == again[0][7][k]).all() for k in train[7])


def test_deterministic_per_seed_and_index(tmp_path):
    a, b = _dataset(tmp_path, name="a"), _dataset(tmp_path, name="b")
    c = _dataset(tmp_path, seed=4, name="c")
    for i in (0, 7, 55):
        x, y = a[i], b[i]
        assert all((x[k] == y[k]).all() for k in x)
    assert any(not (a[i]["tokens"] == c[i]["tokens"]).all() for i in range(10))


def test_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="--decoder-seq-length 8 is too short.*use at least 9"):
        _dataset(tmp_path, seq_length=48, decoder_seq_length=8)

    class NoSentinels(_Tok):
        sentinels = ()

    ds = _write(tmp_path / "x", _docs(np.random.RandomState(2)))
    with pytest.raises(ValueError, match="--vocab-extra-ids"):
        T5Dataset(ds, np.arange(3), 4, seq_length=48, decoder_seq_length=16, seed=1, tokenizer=NoSentinels(),
                  cache_dir=str(tmp_path / "c"))

    class FewSentinels(_Tok):
        sentinels = SENTINELS[:1]

    with pytest.raises(ValueError, match="--vocab-extra-ids 1: .* use at least 7"):
        T5Dataset(ds, np.arange(3), 4, seq_length=48, decoder_seq_length=16, seed=1, tokenizer=FewSentinels(),
                  cache_dir=str(tmp_path / "c"))


def test_wordpiece_sentinels():
    plain = build_tokenizer("BertWordPieceLowerCase")
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_extra_ids=3)
    assert tok.sentinels == tuple(range(plain.vocab_size, plain.vocab_size + 3))
    assert tok.vocab_size == plain.vocab_size + 3 and set(tok.sentinels) <= set(tok.special_ids)
    text = "call me ishmael"
    assert tok.encode(text) == plain.encode(text)  # existing ids unchanged
    ids = tok.encode("call <extra_id_2> ishmael")
    assert ids == plain.encode("call") + [tok.sentinels[2]] + plain.encode("ishmael")
    assert "<extra_id_2>" in tok.decode(ids) and not getattr(plain, "sentinels", ())
    # "##" pieces: T5's whole words
    assert tok.continuation_ids and not set(tok.continuation_ids) & set(tok.special_ids)
    with pytest.raises(TokenizerError, match="--vocab-extra-ids"):
        build_tokenizer("GPT2BPETokenizer", vocab_extra_ids=3)


def test_target_too_long_for_the_decoder_keeps_its_last_spans_as_text():
    """Megatron asserts on a target longer than the decoder; here the last spans stay text until it fits: the
    sample equals the one built with a long decoder, the spans past the fit restored in the encoder input."""
    from omnitron.core.data.t5_dataset import build_sample

    ids, text = {"cls": _Tok.cls, "sep": _Tok.sep, "pad": _Tok.pad}, np.arange(10, 110)
    for seed in range(200):
        full = build_sample(text, np.random.RandomState(seed), seq_length=102, decoder_seq_length=64, ids=ids,
                            sentinels=SENTINELS)
        t = int(full["loss_mask"].sum())
        short = build_sample(text, np.random.RandomState(seed), seq_length=102, decoder_seq_length=17, ids=ids,
                             sentinels=SENTINELS)
        labels = full["labels"][:t].tolist()
        starts = [i for i, x in enumerate(labels) if x in SENTINELS] + [t - 1]
        keep = max(k for k in range(len(starts)) if starts[k] + 1 <= 17)  # spans whose target fits with the end
        assert short["labels"][: starts[keep] + 1].tolist() == labels[: starts[keep]] + [_Tok.sep]
        assert int(short["loss_mask"].sum()) == starts[keep] + 1
        enc = short["tokens"][~short["padding_mask"]].tolist()
        assert _fill(enc, short["labels"][: starts[keep] + 1].tolist()) == text.tolist()
