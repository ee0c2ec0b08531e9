"""``--mock-data`` samples mask the tokenizer's pad as every GPT sample does (Megatron's MockGPTDataset is a
GPTDataset, so its ``__getitem__`` applies the pad rule to the synthetic ids). Until 2026-12-07 omnitron's mock
samples ignored the pad: ``--null-tokenizer-pad-id`` was accepted and did nothing under ``--mock-data``."""
from __future__ import annotations

import random

import torch

from omnitron.core.data import DataConfig, build_gpt_datasets
from omnitron.core.data.config import tokenizer_from_config


def _mock(pad: int, seed: int, **flags):
    cfg = DataConfig(mock_data=True, seq_length=48, seed=seed, tokenizer_type="NullTokenizer", vocab_size=12,
                     null_tokenizer_pad_id=pad, **flags)
    train, _, _ = build_gpt_datasets(cfg, tokenizer_from_config(cfg), train_samples=24, valid_samples=0,
                                     test_samples=0)
    return train


def test_mock_samples_mask_the_null_tokenizers_pad():
    """Hand-derived from Megatron's GPTDataset rule over the raw synthetic ids: no loss where the label is the pad,
    the pad read as id 0 in tokens and labels; everything else as without a pad. A 13-id vocabulary over 24 x 49
    ids holds the pad about 90 times, so a rule that does nothing cannot pass."""
    seed, pad = random.randrange(1 << 16), random.randrange(12)  # 12 is the eod (NullTokenizer: V + 1 ids)
    plain, padded = _mock(-1, seed), _mock(pad, seed)
    seen = 0
    for i in range(len(padded)):
        raw = torch.as_tensor(padded.tokens(i))
        tokens, labels = raw[:-1], raw[1:]
        got, base = padded[i], plain[i]
        want_mask = base["loss_mask"].clone()
        want_mask[labels == pad] = 0.0
        assert torch.equal(got["loss_mask"], want_mask), f"seed {seed}, pad {pad}, sample {i}"
        assert torch.equal(got["tokens"], torch.where(tokens == pad, 0, tokens)), f"seed {seed}, sample {i}"
        assert torch.equal(got["labels"], torch.where(labels == pad, 0, labels)), f"seed {seed}, sample {i}"
        seen += int((labels == pad).sum())
    assert seen > 20, f"seed {seed}: the pad {pad} was drawn {seen} times"


def test_mock_samples_keep_an_ambiguous_pad_unless_allowed():
    """A pad equal to the eod is no pad (masking it would drop every document end), unless
    --allow-ambiguous-pad-tokens: then the eod labels take no loss."""
    seed = random.randrange(1 << 16)
    eod = 12  # NullTokenizer --vocab-size 12: ids 0..11, the eod 12
    same = _mock(eod, seed)
    allowed = _mock(eod, seed, allow_ambiguous_pad_tokens=True)
    plain = _mock(-1, seed)
    ends = 0
    for i in range(len(same)):
        assert torch.equal(same[i]["loss_mask"], plain[i]["loss_mask"]), f"seed {seed}, sample {i}"
        labels = torch.as_tensor(same.tokens(i))[1:]
        assert not allowed[i]["loss_mask"][labels == eod].any(), f"seed {seed}, sample {i}"
        ends += int((labels == eod).sum())
    assert ends > 0, f"seed {seed}: no document end drawn"
