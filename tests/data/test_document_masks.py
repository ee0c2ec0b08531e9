"""--eod-mask-loss / --reset-position-ids / --reset-attention-mask samples against Megatron's
``get_ltor_masks_and_position_ids`` written out as a longhand per-sample loop (fresh random tokens,
random eod placements), and the flags reaching every dataset kind through ``DataConfig``."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from omnitron.core.data import DataConfig, GPTDataset, IndexedDatasetBuilder, MockGPTDataset, build_gpt_datasets
from omnitron.core.data import build_tokenizer, make_sample
from omnitron.core.data.indexed import IndexedDataset


def megatron_ltor(tokens: list[int], eod: int, reset_position_ids: bool, reset_attention_mask: bool,
                  eod_mask_loss: bool):
    """Longhand Megatron: attention mask [s, s] (True = may attend), loss mask, position ids."""
    s = len(tokens)
    attend = [[j <= i for j in range(s)] for i in range(s)]
    loss_mask = [0.0 if (eod_mask_loss and t == eod) else 1.0 for t in tokens]
    position_ids = list(range(s))
    prev = 0
    for i in [i for i, t in enumerate(tokens) if t == eod]:
        if reset_attention_mask:  # attention_mask[b, 0, (i + 1):, :(i + 1)] = 0
            for r in range(i + 1, s):
                for col in range(i + 1):
                    attend[r][col] = False
        if reset_position_ids:  # position_ids[b, (i + 1):] -= (i + 1 - prev_index)
            for r in range(i + 1, s):
                position_ids[r] -= i + 1 - prev
            prev = i + 1
    return attend, loss_mask, position_ids


def _mask_from_document_ids(doc: torch.Tensor) -> torch.Tensor:
    """What attention builds from document ids: same document and causal."""
    s = doc.numel()
    return (doc[:, None] == doc[None, :]) & torch.ones(s, s, dtype=torch.bool).tril()


@pytest.mark.parametrize("flags", [(True, True, True), (False, True, False), (True, False, True)])
def test_sample_matches_megatron_loop(flags):
    reset_pos, reset_attn, eod_mask = flags
    rng = np.random.default_rng()  # fresh every run
    eod = 5
    for _ in range(40):
        s = int(rng.integers(1, 40))
        text = rng.integers(0, 5, s + 1)
        text[rng.random(s + 1) < rng.uniform(0.0, 0.5)] = eod  # 0 to many eods, adjacent ones too
        sample = make_sample(text, eod, eod_mask, reset_pos, reset_attn)
        attend, loss_mask, pos = megatron_ltor(text[:-1].tolist(), eod, reset_pos, reset_attn, eod_mask)
        assert sample["tokens"].tolist() == text[:-1].tolist() and sample["labels"].tolist() == text[1:].tolist()
        assert sample["position_ids"].tolist() == pos
        assert sample["loss_mask"].tolist() == loss_mask
        if reset_attn:
            assert sample["document_ids"].dtype == torch.int64
            assert _mask_from_document_ids(sample["document_ids"]).tolist() == attend
        else:
            assert "document_ids" not in sample and all(attend[i][j] == (j <= i) for i in range(s) for j in range(s))


def _write(prefix: str, rng, eod: int) -> IndexedDataset:
    builder = IndexedDatasetBuilder(prefix + ".bin", np.int32)
    for _ in range(40):
        doc = rng.integers(0, eod, int(rng.integers(3, 20)))
        builder.add_document(np.append(doc, eod))
    builder.finalize(prefix + ".idx")
    return IndexedDataset(prefix)


def test_flags_reach_every_dataset_kind(tmp_path):
    tok = build_tokenizer("NullTokenizer", vocab_size=50)
    prefix = str(tmp_path / "docs")
    _write(prefix, np.random.default_rng(), tok.eod)
    on = dict(eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True)
    kinds = {
        "file": DataConfig(data_path=[prefix], seq_length=32, data_cache_path=str(tmp_path / "c"), **on),
        "blend": DataConfig(data_path=["0.5", prefix, "0.5", prefix], seq_length=32,
                            data_cache_path=str(tmp_path / "c"), **on),
        "mock": DataConfig(mock_data=True, seq_length=32, **on),
    }
    for name, cfg in kinds.items():
        train, _, _ = build_gpt_datasets(cfg, tok, train_samples=6, valid_samples=0, test_samples=0)
        for i in range(6):
            x = train[i]
            attend, loss_mask, pos = megatron_ltor(x["tokens"].tolist(), tok.eod, True, True, True)
            assert x["position_ids"].tolist() == pos and x["loss_mask"].tolist() == loss_mask, name
            assert _mask_from_document_ids(x["document_ids"]).tolist() == attend, name
    off, _, _ = build_gpt_datasets(DataConfig(mock_data=True, seq_length=32), tok, train_samples=2, valid_samples=0,
                                   test_samples=0)
    assert "document_ids" not in off[0] and off[0]["position_ids"].tolist() == list(range(32))
    assert isinstance(MockGPTDataset(1, seq_length=8, vocab_size=9, eod=8, reset_attention_mask=True)[0]
                      ["document_ids"], torch.Tensor)
    assert GPTDataset.__init__.__kwdefaults__["reset_attention_mask"] is False


def test_cli_flags_parse_into_data_config():
    from omnitron.core.training.arguments import parse_settings

    args = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "20", "--micro-batch-size", "1",
            "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
    d = parse_settings(args, 1).data
    assert d.reset_attention_mask and d.reset_position_ids and d.eod_mask_loss
    assert not parse_settings(args[:-3], 1).data.reset_attention_mask
