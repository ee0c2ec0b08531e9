"""T5 data: span-corruption statistics (15% of tokens, mean span 3, random positions), sample structure
(sentinels in order, [CLS]-shifted decoder input, masks, padding), exact reconstruction of the text
from the encoder input and the target, determinism per (seed, index), WordPiece sentinels, errors."""
from __future__ import annotations

import numpy as np
import pytest

from omnitron.core.data import build_tokenizer
from omnitron.core.data.t5_dataset import T5Dataset, random_spans_mask
from omnitron.core.data.tokenizers import TokenizerError
from omnitron.testing.data import write_documents as _write

V, SENTINELS = 1000, tuple(range(900, 1000))


class _Tok:
    """The ids a T5 dataset reads (a tokenizer stand-in over a synthetic vocabulary of ``V`` ids)."""

    name, vocab_size, pad, unk, cls, sep, mask = "synthetic", V, 0, 1, 2, 3, 4
    sentinels = SENTINELS
    special_ids = (0, 1, 2, 3, 4) + SENTINELS


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, length) of each run of True."""
    out, i = [], 0
    while i < len(mask):
        if mask[i]:
            j = i
            while j < len(mask) and mask[j]:
                j += 1
            out.append((i, j - i))
            i = j
        else:
            i += 1
    return out


def test_span_corruption_statistics():
    rng = np.random.RandomState(0)
    noised = total = spans = 0
    first = last = 0
    for _ in range(2000):
        n = int(rng.randint(20, 200))
        mask = random_spans_mask(n, rng)
        runs = _runs(mask)
        noised, total, spans = noised + int(mask.sum()), total + n, spans + len(runs)
        assert abs(mask.sum() - 0.15 * n) <= 0.5 + 1e-9 and len(runs) >= 1
        first, last = first + bool(mask[0]), last + bool(mask[-1])
    assert abs(noised / total - 0.15) < 0.002
    assert abs(noised / spans - 3.0) < 0.1
    assert 10 < first < 400 and 10 < last < 400  # spans may touch either end, but mostly sit inside


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


def _check_sample(s, text):
    """Structure of one sample and the exact text back from its encoder input and target."""
    s = {k: v.numpy() for k, v in s.items()}
    n, t = int((~s["padding_mask"]).sum()), int(s["loss_mask"].sum())
    enc, target = s["tokens"][:n].tolist(), s["labels"][:t].tolist()
    assert not s["padding_mask"][:n].any() and (s["tokens"][n:] == _Tok.pad).all()
    assert enc[-1] == _Tok.sep and target[-1] == _Tok.sep and (s["loss_mask"][:t] == 1).all()
    assert (s["labels"][t:] == _Tok.pad).all() and (s["loss_mask"][t:] == 0).all()
    assert s["decoder_tokens"][:t].tolist() == [_Tok.cls] + target[:-1]
    used = [x for x in enc if x in SENTINELS]
    assert used == list(SENTINELS[:len(used)]) == [x for x in target if x in SENTINELS]  # in order, once each
    assert _fill(enc[:-1], target) == text
    m = len(text)  # corrupted tokens: 15%, at least one (short texts too), none below two tokens
    assert len(target) - 1 - len(used) == (min(max(round(0.15 * m), 1), m - 1) if m >= 2 else 0)
    if m >= 20:  # at least one span, none adjacent: sentinels never neighbour in the input
        assert used and all(not (a in SENTINELS and b in SENTINELS) for a, b in zip(enc, enc[1:]))


def test_samples_structure_and_exact_reconstruction(tmp_path):
    # at seq 48 (text <= 46 tokens: 7 corrupted in 2 spans + end) the shortest allowed decoder is 10 tokens
    ds = _dataset(tmp_path, decoder_seq_length=10)
    for i in range(len(ds)):
        _check_sample(ds[i], np.concatenate(ds.sentences(i))[: ds.seq_length - 2].tolist())


def test_mock_data_samples(tmp_path):
    from omnitron.core.data.config import DataConfig
    from omnitron.core.data.t5_dataset import MockT5Dataset, build_t5_datasets

    cfg = DataConfig(mock_data=True, seq_length=48, seed=5)
    train, valid, test = build_t5_datasets(cfg, _Tok(), train_samples=40, valid_samples=8, test_samples=0,
                                           decoder_seq_length=10)
    assert isinstance(train, MockT5Dataset) and len(train) == 40 and len(valid) == 8 and test is None
    for i in range(len(train)):
        _check_sample(train[i], np.concatenate(train.sentences(i))[:46].tolist())
    again = build_t5_datasets(cfg, _Tok(), train_samples=40, valid_samples=0, test_samples=0, decoder_seq_length=10)
    assert all((train[7][k] == again[0][7][k]).all() for k in train[7])


def test_deterministic_per_seed_and_index(tmp_path):
    a, b = _dataset(tmp_path, name="a"), _dataset(tmp_path, name="b")
    c = _dataset(tmp_path, seed=4, name="c")
    for i in (0, 7, 55):
        x, y = a[i], b[i]
        assert all((x[k] == y[k]).all() for k in x)
    assert any(not (a[i]["tokens"] == c[i]["tokens"]).all() for i in range(10))


def test_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="--decoder-seq-length 8 is too short.*use at least 10"):
        _dataset(tmp_path, seq_length=48, decoder_seq_length=8)

    class NoSentinels(_Tok):
        sentinels = ()

    ds = _write(tmp_path / "x", _docs(np.random.RandomState(2)))
    with pytest.raises(ValueError, match="--vocab-extra-ids"):
        T5Dataset(ds, np.arange(3), 4, seq_length=48, decoder_seq_length=16, seed=1, tokenizer=NoSentinels(),
                  cache_dir=str(tmp_path / "c"))

    class FewSentinels(_Tok):
        sentinels = SENTINELS[:1]

    with pytest.raises(ValueError, match="--vocab-extra-ids 1: .* use at least 2"):
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
    with pytest.raises(TokenizerError, match="--vocab-extra-ids"):
        build_tokenizer("GPT2BPETokenizer", vocab_extra_ids=3)
