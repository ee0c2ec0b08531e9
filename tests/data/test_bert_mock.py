"""``--mock-data`` for BERT: synthetic samples with the real sample structure (checked longhand),
deterministic per (seed, index), built through ``build_bert_datasets``; a short BERT run trains on them."""
from __future__ import annotations

import numpy as np
import torch

from omnitron.core.data import DataConfig, build_tokenizer
from omnitron.core.data.bert_dataset import MockBertDataset, build_bert_datasets


def test_mock_bert_samples_are_well_formed_and_deterministic():
    tok = build_tokenizer("BertWordPieceLowerCase")
    seed = int(np.random.default_rng().integers(0, 2**20))  # fresh every run
    train, valid, test = build_bert_datasets(DataConfig(mock_data=True, seq_length=48, seed=seed), tok,
                                             train_samples=30, valid_samples=4, test_samples=0)
    assert isinstance(train, MockBertDataset) and len(train) == 30 and len(valid) == 4 and test is None
    special = set(tok.special_ids)
    swapped = 0
    for i in range(len(train)):
        x = train[i]
        n = int((~x["padding_mask"]).sum())
        toks, types = x["tokens"][:n].tolist(), x["tokentype_ids"][:n].tolist()
        seps = [j for j, t in enumerate(toks) if t == tok.sep]
        # [CLS] A [SEP] B [SEP], token types 0 then 1, padding after, at most seq_length
        assert toks[0] == tok.cls and len(seps) == 2 and seps[1] == n - 1 and 0 < seps[0] < n - 2
        assert types == [0] * (seps[0] + 1) + [1] * (n - seps[0] - 1)
        assert all(t == tok.pad for t in x["tokens"][n:].tolist()) and n <= 48
        # labels only where the loss mask is on, and there the original (non-special) ids
        on = x["loss_mask"].bool()
        # at most Megatron's budget min(p x target, round(p x tokens incl. [CLS]/[SEP])) (whole words may leave less)
        assert 0 < int(on.sum()) <= min(0.15 * (48 - 3), max(1, round(0.15 * n)))
        assert all(int(t) not in special for t in x["labels"][on])
        swapped += int(x["is_random"])
        again = MockBertDataset(30, seq_length=48, seed=seed, tokenizer=tok)[i]
        assert all(torch.equal(x[k], again[k]) for k in x)
    assert 0 < swapped < len(train)  # sentence-order swaps happen, not always
    other = MockBertDataset(30, seq_length=48, seed=seed + 1, tokenizer=tok)
    assert not all(torch.equal(train[i]["tokens"], other[i]["tokens"]) for i in range(5))


def test_bert_train_runs_on_mock_data(tmp_path):
    import math

    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    s = parse_settings(["--model", "bert_tiny", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads",
                        "2", "--ffn-hidden-size", "64", "--seq-length", "32", "--max-position-embeddings", "32",
                        "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "2", "--mock-data",
                        "--num-workers", "0", "--no-tensorboard", "--eval-interval", "0",
                        "--log-dir", str(tmp_path / "logs")], world_size=1)
    assert s.data.mock_data and s.model_type == "bert"
    losses = train(s, get_backend("cpu"))["losses"]
    # masked LM over ~8k WordPiece ids + sentence order: starts near uniform, log(V) + log(2)
    assert sorted(losses) == [1, 2] and all(math.isfinite(v) and 0.8 * math.log(8192) < v < 12.0
                                            for v in losses.values())
