"""BERT / T5 data rules taken from Megatron's code: ``--mask-prob`` (pretrain_bert / pretrain_t5 pass it as
``masking_probability``) reaches both datasets, and a BERT sample holds at most ``seq_length - 3`` text tokens
with or without the binary head (``BERTMaskedWordPieceDataset`` builds its index at ``sequence_length - 3``;
T5's at ``sequence_length - 2``)."""
from __future__ import annotations

import numpy as np
import pytest

from omnitron.core.config.parallel import ConfigError
from omnitron.core.data import DataConfig, build_tokenizer
from omnitron.core.data.bert_dataset import BertDataset, MockBertDataset, build_bert_datasets, mask_count
from omnitron.core.data.t5_dataset import T5Dataset, build_t5_datasets
from omnitron.testing.data import write_documents


class _Tok:
    """The ids a BERT dataset reads, over a synthetic vocabulary of 1000 ids (0-4 special)."""

    name, vocab_size, pad, unk, cls, sep, mask = "synthetic", 1000, 0, 1, 2, 3, 4
    special_ids = (0, 1, 2, 3, 4)


@pytest.mark.parametrize("name, default, value", [("mask_prob", 0.15, 0.4), ("short_seq_prob", 0.1, 0.3)])
def test_masking_flags_are_parsed_and_checked(name, default, value):
    """--mask-prob and --short-seq-prob: Megatron's defaults, the value given, and a probability or one line."""
    from omnitron.core.training.arguments import parse_settings

    flag = "--" + name.replace("_", "-")
    base = ["--model", "bert_tiny", "--mock-data", "--train-iters", "1"]
    assert getattr(parse_settings(base, world_size=1).data, name) == default  # Megatron's default
    assert getattr(parse_settings(base + [flag, str(value)], world_size=1).data, name) == value
    with pytest.raises(ConfigError, match=f"{flag} 1.5"):
        DataConfig(**{name: 1.5})


def _masked_counts(dataset, key: str = "loss_mask") -> list[tuple[int, int]]:
    """(masked tokens, sample tokens) of every sample."""
    out = []
    for i in range(len(dataset)):
        x = dataset[i]
        out.append((int(x[key].sum()), int((~x["padding_mask"]).sum())))
    return out


def test_mask_prob_reaches_bert_and_t5_mock_data():
    """At --mask-prob 0.4 every sample masks at most Megatron's budget ``min(p target, round(p n))`` and,
    over 40 samples, more tokens than 0.15's budget allows any sample (so the flag is not dropped)."""
    p, seq = 0.4, 64
    seed = int(np.random.default_rng().integers(0, 2**20))  # fresh every run
    data = DataConfig(mock_data=True, seq_length=seq, seed=seed, mask_prob=p)
    bert = build_bert_datasets(data, build_tokenizer("BertWordPieceLowerCase"), train_samples=40, valid_samples=0,
                               test_samples=0)[0]
    counts = _masked_counts(bert)
    assert all(m <= mask_count(n, seq - 3, p) for m, n in counts)
    assert max(m for m, _ in counts) > max(mask_count(n, seq - 3, 0.15) for _, n in counts)
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_extra_ids=30)
    t5 = build_t5_datasets(data, tok, train_samples=40, valid_samples=0, test_samples=0, decoder_seq_length=48)[0]
    assert t5.masked_lm_prob == p
    # a T5 target is the corrupted tokens, one sentinel per span and the end token: corrupted = targets - spans - 1
    corrupted = []
    for i in range(len(t5)):
        labels = t5[i]["labels"][t5[i]["loss_mask"].bool()].tolist()
        corrupted.append(len(labels) - sum(t in tok.sentinels for t in labels) - 1)
    assert max(corrupted) <= round(p * (seq - 2)) and max(corrupted) > round(0.15 * (seq - 2))


def test_one_segment_bert_sample_holds_seq_minus_3_text_tokens(tmp_path):
    """--no-bert-binary-head: the mapping's targets and the samples' text reach ``seq_length - 3``, never more
    (Megatron: ``_build_sample_index(sequence_length - 3, 1)``; [CLS] text [SEP] then leaves one pad at least)."""
    seq = 32
    docs = [[np.arange(10 + 300 * d, 10 + 300 * d + 250)] for d in range(4)]  # long one-sequence documents
    ds = write_documents(tmp_path / "flat", docs)
    one = BertDataset(ds, np.arange(4), 60, seq_length=seq, seed=5, tokenizer=_Tok(), binary_head=False,
                      cache_dir=str(tmp_path / "c"))
    assert one.mapping[:, 2].max() == seq - 3
    texts = [int((~one[i]["padding_mask"]).sum()) - 2 for i in range(len(one))]
    assert max(texts) == seq - 3
    mock = MockBertDataset(40, seq_length=seq, seed=5, tokenizer=_Tok(), binary_head=False)
    texts = [int((~mock[i]["padding_mask"]).sum()) - 2 for i in range(len(mock))]
    assert max(texts) == seq - 3


def test_t5_text_still_reaches_seq_minus_2(tmp_path):
    """T5 keeps Megatron's ``sequence_length - 2`` index (it adds no [CLS] / [SEP] to the encoder input)."""
    seq = 32
    docs = [[np.arange(10 + 300 * d, 10 + 300 * d + 250)] for d in range(4)]
    ds = write_documents(tmp_path / "flat", docs)
    tok = _Tok()
    tok.sentinels = tuple(range(990, 1000))
    t5 = T5Dataset(ds, np.arange(4), 60, seq_length=seq, decoder_seq_length=16, seed=5, tokenizer=tok,
                   cache_dir=str(tmp_path / "c"))
    assert t5.mapping[:, 2].max() == seq - 2


def test_t5_mask_prob_too_large_for_the_decoder_is_one_line_at_parse():
    """t5_tiny: --seq-length 128, --decoder-seq-length 32. At --mask-prob p a sample corrupts up to
    round(126 p) tokens and its target needs that plus a sentinel and the end: 0.6 -> 76 + 2 > 32."""
    from omnitron.core.training.arguments import parse_settings

    base = ["--model", "t5_tiny", "--mock-data", "--train-iters", "1"]
    assert parse_settings(base + ["--mask-prob", "0.2"], world_size=1).data.mask_prob == 0.2  # 25 + 2 <= 32
    with pytest.raises(ConfigError, match="--decoder-seq-length 32 is too short .* at --mask-prob 0.6: .* 76 "
                                          "corrupted tokens.* at least 78"):
        parse_settings(base + ["--mask-prob", "0.6"], world_size=1)


def _special_corpus(tmp_path, rng):
    """Documents of 2-4 sentences of 3-9 text ids (10-899), each id a special one ([UNK] 1, [SEP] 3, [PAD] 0) with
    probability 0.2: what an out-of-vocabulary word, an appended eod (= [SEP]) or a pre-tokenized corpus leaves."""
    def sentence():
        ids = rng.integers(10, 900, int(rng.integers(3, 10)))
        return np.where(rng.random(len(ids)) < 0.2, rng.choice([0, 1, 3], len(ids)), ids)
    docs = [[sentence() for _ in range(int(rng.integers(2, 5)))] for _ in range(20)]
    return write_documents(tmp_path / "special", docs)


def test_special_ids_in_the_text_are_kept_as_megatron_reads_them(tmp_path):
    """Megatron's BERT / T5 datasets read a sample's sentences as the file holds them (``self.dataset[i]``), special
    ids included: each sample's sentences are the file's sequences of its mapping row (here one sequence a
    sentence), and the [UNK]s of the file reach the samples (the masking then follows Megatron draw for draw:
    tests/data/test_bert_masking_megatron.py, tests/data/test_t5_megatron_masking.py)."""
    rng = np.random.default_rng()
    ds, tok = _special_corpus(tmp_path, rng), _Tok()
    tok.sentinels = tuple(range(990, 1000))
    seed = int(rng.integers(1, 2**20))
    t5 = T5Dataset(ds, np.arange(20), 40, seq_length=64, decoder_seq_length=40, seed=seed, tokenizer=tok,
                   cache_dir=str(tmp_path / "c"))
    bert = BertDataset(ds, np.arange(20), 40, seq_length=64, seed=seed, tokenizer=tok, cache_dir=str(tmp_path / "c"))
    for data in (t5, bert):
        unk = 0
        for i in range(len(data)):
            first, end, _ = (int(v) for v in data.mapping[i])
            got = data.sentences(i)
            assert [s.tolist() for s in got] == [ds[j].tolist() for j in range(first, end)], i
            x = data[i]
            m = x["loss_mask"].bool()
            text = x["tokens"] if data is t5 else x["tokens"][~m]  # BERT: a masked position may hold a random id
            unk += int((text == 1).sum() + (x["labels"][m] == 1).sum())
        assert unk > 0
