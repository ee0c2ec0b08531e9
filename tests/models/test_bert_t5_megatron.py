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


def _megatron_local_rows(monkeypatch, decoder_pad: torch.Tensor) -> None:
    """Megatron's local attention (``--transformer-impl local``, which the fixture ran): pretrain_t5's b1ss masks keep
    a (query, key) pair only when both tokens are not padding (``_build_b1ss_attention_mask``), the core attention
    fills the rest with -10000 before the softmax, so a padding query's row is uniform over every key. omnitron
    drops padding keys only. Patched into omnitron's T5: encoder and decoder self-attention, cross-attention."""
    from omnitron.core.transformer.attention import SelfAttention
    from omnitron.core.transformer.cross_attention import CrossAttention

    def rows(q, k, v, keep):
        scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        return torch.softmax(scores.masked_fill(~keep, -10000.0), dim=-1) @ v

    def self_attention(self, q, k, v, key_padding_mask, p, causal=False):
        real = ~key_padding_mask.to(torch.bool)
        keep = real[:, None, :, None] & real[:, None, None, :]
        if causal:
            keep = keep & torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
        return rows(q, k, v, keep)

    def cross_attention(self, q, k, v, memory_padding_mask):
        keep = ~decoder_pad[:, None, :, None] & ~memory_padding_mask.to(torch.bool)[:, None, None, :]
        return rows(q, k, v, keep)

    monkeypatch.setattr(SelfAttention, "_padded_attention", self_attention)
    monkeypatch.setattr(CrossAttention, "core_attention", cross_attention)


def _t5(dtype):
    from omnitron.core.models.t5.config import T5Config
    from omnitron.core.models.t5.model import T5Model

    case = FIXTURES["cases"]["t5_3_1"]
    c = T5Config(num_layers=case["encoder_num_layers"], encoder_num_layers=case["encoder_num_layers"],
                 decoder_num_layers=case["decoder_num_layers"], vocab_extra_ids=0, params_dtype=dtype,
                 decoder_seq_length=FIXTURES["meta"]["shape"]["decoder_seq_length"], **_shape())
    model = T5Model(c, ParallelGroups.single(), seed=1)
    _load(model, {k: v.to(dtype) if v.is_floating_point() else v for k, v in case["weights"].items()})
    return model


def _loss_and_grads(model, b, labels, mask):
    dec_pad = b["decoder_tokens"] == 0  # the family's decoder_padding_mask (Megatron's dec_mask: by id)
    lm = model(b["tokens"], b["decoder_tokens"], b["padding_mask"], labels=labels, decoder_padding_mask=dec_pad)
    loss = (lm * mask).sum() / mask.sum()  # pretrain_t5's loss_func
    model.zero_grad()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_t5_padding_decoder_rows_reach_neither_loss_nor_gradients(monkeypatch):
    """omnitron's rows at a [PAD] decoder position differ from Megatron's local path (uniform rows, emulated here and
    checked against Megatron's own per-token losses at every position, padding rows included). They reach no
    output that matters: the loss mask is 0 there (Megatron's dataset: 1 only before the padding), no other row
    attends to a padding position, so the loss and every gradient are the same either way.

    Not covered: a [PAD] id inside the target (a literal "[PAD]" in the raw text encodes to it, in Megatron and
    omnitron alike) is padding by id in the masks but keeps its loss; there the two rules give different losses,
    as Megatron's local and Transformer Engine paths do among themselves.

    Tolerance: float64 on both sides, the same weights and batch; the rows that count go through different but
    equivalent operations (SDPA against matmul-softmax-matmul, weights of masked keys exactly 0 in both since
    exp(-10000) underflows), each rounding at 2^-53 ~ 1.1e-16 relative over a few hundred sequential operations
    of values below 1e2: under 1e-11 absolute; 1e-10 bounds it. The check can fail: counting the padding positions
    in the loss moves it by far more than that bound (1e-6 asked, four orders above it; about 1e-3 on these
    near-uniform random weights)."""
    b = FIXTURES["cases"]["t5_3_1"]["batch"]
    dec_pad = b["decoder_tokens"] == 0
    assert dec_pad.any() and not (b["loss_mask"].bool() & dec_pad).any()  # padding only after the loss region
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    labels = torch.randint(1, FIXTURES["meta"]["shape"]["vocab_size"], b["labels"].shape, generator=g)
    ours = _loss_and_grads(_t5(torch.float64), b, labels, b["loss_mask"].double())
    everywhere = _loss_and_grads(_t5(torch.float64), b, labels, torch.ones_like(b["loss_mask"], dtype=torch.float64))

    _megatron_local_rows(monkeypatch, dec_pad)
    with torch.no_grad():  # the emulation is Megatron's: its per-token losses at every row, padding rows included
        lm = _t5(torch.float32).eval()(b["tokens"], b["decoder_tokens"], b["padding_mask"], labels=b["labels"],
                                       decoder_padding_mask=dec_pad)
    assert (lm - FIXTURES["cases"]["t5_3_1"]["lm"]).abs().max() < TOL
    theirs = _loss_and_grads(_t5(torch.float64), b, labels, b["loss_mask"].double())
    assert abs(ours[0] - theirs[0]) < 1e-10
    for name, grad in ours[1].items():
        assert (grad - theirs[1][name]).abs().max() < 1e-10, name
    counted = _loss_and_grads(_t5(torch.float64), b, labels, torch.ones_like(b["loss_mask"], dtype=torch.float64))
    assert abs(everywhere[0] - counted[0]) > 1e-6  # the padding rows do differ: a loss over them would see it
