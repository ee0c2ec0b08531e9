"""BERT and T5 against megatron-core's own code: the per-token losses, sentence-order logits and the loss
pretrain_bert / pretrain_t5 compute (tests/models/megatron_bert_t5/fixtures.pt, written by its make_fixtures.py
with the Megatron-LM d98e8a6 snapshot, float32 on CPU) are omnitron's on the same weights and batch.

Cases: BERT with the binary head (masked-LM mean + sentence-order cross-entropy); BERT as pretrain_bert builds
it with ``--bert-no-binary-head`` (no token-type embedding, no pooler: omnitron's default must build the same
parameters); T5 with 3 encoder and 1 decoder layers.

Tolerance: both sides run float32 on the same weights; their operations differ in order (fused QKV splits, the
softmax and cross-entropy implementations), each rounding at 2^-24 ~ 6e-8 relative. Along the few dozen
sequential operations of 2-4 layers of width 32 that stays near 1e-6 relative; the measured worst is 1e-6
absolute on per-token losses near 5, and 1e-5 absolute bounds it. A missing token-type row, pooler or final norm,
or a wrong mask, moves the losses by 1e-2 or more.
"""
from __future__ import annotations

import os

import pytest
import torch

from omnitron.core.parallel.groups import ParallelGroups

FIXTURES = torch.load(os.path.join(os.path.dirname(__file__), "megatron_bert_t5", "fixtures.pt"), weights_only=True)
TOL = 1e-5


def _shape() -> dict:
    m = FIXTURES["meta"]["shape"]
    return dict(hidden_size=m["hidden_size"], num_attention_heads=4, vocab_size=m["vocab_size"],
                seq_length=m["seq_length"], max_position_embeddings=m["seq_length"], hidden_dropout=0.0,
                attention_dropout=0.0)


def _load(model, weights: dict) -> None:
    """Megatron's weights into ``model``: both must hold exactly the same parameters."""
    own = model.state_dict()
    assert sorted(own) == sorted(weights)
    model.load_state_dict(weights)


@pytest.mark.parametrize("name", ["bert_binary", "bert_no_binary_head"])
def test_bert_loss_is_megatrons(name):
    from omnitron.core.models.bert import BertConfig, BertModel, bert_loss

    case = FIXTURES["cases"][name]
    c = BertConfig(num_layers=2, bert_binary_head=case["binary"], **_shape())
    model = BertModel(c, ParallelGroups.single(), seed=1).eval()
    _load(model, case["weights"])
    b = case["batch"]
    with torch.no_grad():
        out = model(b["tokens"], b["padding_mask"], b["tokentype_ids"], labels=b["labels"])
        loss, _ = bert_loss(out, b)
    real = ~b["padding_mask"]
    assert ((out[0] - case["lm"]).abs() * real).max() < TOL
    assert abs(loss.item() - case["loss"]) < TOL
    if case["binary"]:
        assert (out[1] - case["sop_logits"]).abs().max() < TOL
    else:
        assert out[1] is None


def test_t5_loss_is_megatrons_with_unequal_layer_counts():
    from omnitron.core.models.t5.config import T5Config
    from omnitron.core.models.t5.model import T5Model

    case = FIXTURES["cases"]["t5_3_1"]
    c = T5Config(num_layers=case["encoder_num_layers"], encoder_num_layers=case["encoder_num_layers"],
                 decoder_num_layers=case["decoder_num_layers"], vocab_extra_ids=0,
                 decoder_seq_length=FIXTURES["meta"]["shape"]["decoder_seq_length"], **_shape())
    model = T5Model(c, ParallelGroups.single(), seed=1).eval()
    _load(model, case["weights"])
    b = case["batch"]
    with torch.no_grad():
        lm = model(b["tokens"], b["decoder_tokens"], b["padding_mask"], labels=b["labels"])
    mask = b["loss_mask"]
    assert ((lm - case["lm"]).abs() * mask).max() < TOL
    assert abs(((lm * mask).sum() / mask.sum()).item() - case["loss"]) < TOL
