"""T5Model against an independent plain-torch float64 encoder-decoder (bidirectional padded encoder,
causal decoder with cross-attention, LM head tied to the word embedding with a bias), tensor-parallel
(+ sequence-parallel) parity with the one-process model in one spawned run, and the train command."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from omnitron.core.config.parallel import ConfigError, ParallelConfig
from omnitron.core.models.gpt import gather_full_state
from omnitron.core.models.t5 import T5Config, T5Model, num_parameters, validate_t5
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.testing.distributed import run_distributed
from omnitron.testing.parity import (assert_parity, on_groups_device, reference_kernels, relative_error as _rel,
                                     tp_sp_parity)

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, seq_length=12,
            decoder_seq_length=8, vocab_size=203, hidden_dropout=0.0, attention_dropout=0.0)
F64 = dict(params_dtype=torch.float64)  # the one-process checks run a float64 model against plain_t5
# F64_REL: a float64 T5Model (reference kernels) against plain_t5 on the same float64 weights is the same maths in
# another order (fused QKV and KV views, the layer norm, the softmax, the vocab-parallel cross-entropy's max-shifted
# logsumexp). u = 2**-53 = 1.1e-16, and reordering a sum of n terms moves it by <= n u of its terms' magnitudes.
# The longest path runs <= 4 layers (encoder then decoder, 3 decoder layers in one variant) of ~14 such sums of
# <= 48 terms (hidden 32, ffn 48, 12 keys), then the 32-term logits and the 203-term logsumexp: <= (4 x 14 x 48 +
# 235) u = 3.2e-13 relative at gain ~1 (layer norms and softmaxes well conditioned at these scales); the backward
# runs the chain again: <= ~7e-13 on a gradient, norm-wise. F64_REL = 1e-11 leaves a factor > 10 over that worst
# case (sqrt(n) u ~ 1e-15 is typical; 9e-16 measured). The float32 model needed 1e-5 / 1e-6, which a float32
# rounding of the softmax scale passed (planted: every float64 check here fails on it).
F64_REL = 1e-11


def _attention(W, c, name, xq, xk, keep, fused):
    """Multi-head attention from the maths: ``keep [b, sq, sk]`` True = attend; fused QKV or q + kv."""
    hq, h = c.num_attention_heads, c.hidden_size
    g, d = c.num_query_groups or hq, h // hq
    xk = xq if xk is None else xk
    b, sq, sk = xq.shape[0], xq.shape[1], xk.shape[1]
    lin = lambda t, n: t @ W[n + ".weight"].T + W[n + ".bias"]  # noqa: E731
    if fused:  # rows grouped per key/value head: [q heads of group, k, v] each d rows
        qkv = lin(xq, name + ".linear_qkv").view(b, sq, g, hq // g + 2, d)
        q, k, v = qkv[..., : hq // g, :].reshape(b, sq, hq, d), qkv[..., -2, :], qkv[..., -1, :]
    else:  # cross-attention: q from the decoder, [k, v] per group from the encoder
        q = lin(xq, name + ".linear_q").view(b, sq, hq, d)
        kv = lin(xk, name + ".linear_kv").view(b, sk, g, 2, d)
        k, v = kv[..., 0, :], kv[..., 1, :]
    k, v = k.repeat_interleave(hq // g, dim=2), v.repeat_interleave(hq // g, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(~keep[:, None], float("-inf"))
    att = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, sq, hq * d)
    return lin(att, name + ".linear_proj")


def plain_t5(W, c, tokens, dec_tokens, pad, labels, mask, dec_pad=None):
    """Batch-first float64 T5: (masked mean loss, logits [b, s_dec, V]); ``dec_pad [b, s_dec]``: decoder keys
    holding [PAD] are not attended (Megatron's dec_mask)."""
    h = c.hidden_size
    lin = lambda t, n: t @ W[n + ".weight"].T + W[n + ".bias"]  # noqa: E731
    ln = lambda t, n: F.layer_norm(t, (h,), W[n + ".weight"], W[n + ".bias"], c.layernorm_epsilon)  # noqa: E731
    mlp = lambda t, p: lin(F.gelu(lin(t, p + "mlp.linear_fc1"), approximate="tanh"), p + "mlp.linear_fc2")  # noqa
    emb = lambda t: W["embedding.word_embeddings.weight"][t] + W["embedding.position_embeddings.weight"][  # noqa
        :t.shape[1]]
    b, se, sd = tokens.shape[0], tokens.shape[1], dec_tokens.shape[1]
    x = emb(tokens)
    enc_keep = (~pad)[:, None, :].expand(b, se, se)  # bidirectional over real keys
    for i in range(c.encoder_num_layers or c.num_layers):
        p = f"encoder.layers.{i}."
        x = x + _attention(W, c, p + "self_attention", ln(x, p + "input_layernorm"), None, enc_keep, True)
        x = x + mlp(ln(x, p + "pre_mlp_layernorm"), p)
    memory = ln(x, "encoder.final_layernorm")
    y = emb(dec_tokens)
    causal = torch.ones(sd, sd, dtype=torch.bool).tril()[None].expand(b, sd, sd)
    if dec_pad is not None:
        causal = causal & ~dec_pad[:, None, :]
    cross_keep = (~pad)[:, None, :].expand(b, sd, se)
    for i in range(c.decoder_num_layers or c.num_layers):
        p = f"decoder.layers.{i}."
        y = y + _attention(W, c, p + "self_attention", ln(y, p + "input_layernorm"), None, causal, True)
        y = y + _attention(W, c, p + "cross_attention", ln(y, p + "pre_cross_attn_layernorm"), memory, cross_keep,
                           False)
        y = y + mlp(ln(y, p + "pre_mlp_layernorm"), p)
    logits = ln(y, "decoder.final_layernorm") @ W["embedding.word_embeddings.weight"].T + W["output_layer.bias"]
    token_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    return (token_loss * mask.reshape(-1)).sum() / mask.sum(), logits


def _batch(c, gen, b=3):
    se, sd = c.seq_length, c.decoder_seq_length
    lengths = torch.randint(se // 3, se + 1, (b,), generator=gen)
    lengths[0] = se  # one unpadded row
    dec_lengths = torch.randint(2, sd + 1, (b,), generator=gen)
    return {"tokens": torch.randint(0, c.vocab_size, (b, se), generator=gen),
            "padding_mask": torch.arange(se)[None] >= lengths[:, None],
            "decoder_tokens": torch.randint(0, c.vocab_size, (b, sd), generator=gen),
            "labels": torch.randint(0, c.vocab_size, (b, sd), generator=gen),
            "loss_mask": (torch.arange(sd)[None] < dec_lengths[:, None]).float()}


def _forward(model, batch, labels=True):
    return model(batch["tokens"], batch["decoder_tokens"], batch["padding_mask"],
                 labels=batch["labels"] if labels else None)


def _loss(token_loss, batch):
    mask = batch["loss_mask"]
    return (token_loss * mask).sum() / mask.sum()


VARIANTS = {"mha": {},
            "gqa_uneven_stacks_selective": dict(num_query_groups=2, encoder_num_layers=1, decoder_num_layers=3,
                                                              recompute_granularity="selective"),
            "full_recompute": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_t5_matches_plain_float64(variant):
    """A float64 T5Model's loss, logits and every gradient against plain_t5 within F64_REL."""
    c = T5Config(**BASE, **F64, **VARIANTS[variant])
    groups = ParallelGroups.single()
    with reference_kernels():
        model = T5Model(c, groups, seed=11)
        batch = _batch(c, torch.Generator().manual_seed(5 + len(variant)))
        loss = _loss(_forward(model, batch), batch)
        loss.backward()
        with torch.no_grad():
            logits = _forward(model, batch, labels=False)
    assert loss.dtype == logits.dtype == torch.float64
    W = {k: v.detach().clone().requires_grad_() for k, v in gather_full_state(model, groups).items()}
    assert W["output_layer.bias"].shape == (c.vocab_size,)  # padding columns dropped from the full view
    ref, ref_logits = plain_t5(W, c, batch["tokens"], batch["decoder_tokens"], batch["padding_mask"],
                               batch["labels"], batch["loss_mask"].double())
    ref.backward()
    assert abs(loss.item() - ref.item()) / ref.item() < F64_REL
    assert torch.isinf(logits[..., c.vocab_size:]).all()
    assert _rel(logits[..., :c.vocab_size].transpose(0, 1), ref_logits) < F64_REL
    grads = gather_full_state(model, groups, grads=True)
    assert grads.keys() == W.keys()
    for k, w in W.items():
        assert w.grad is not None and _rel(grads[k], w.grad) < F64_REL, k


def test_decoder_padding_mask_matches_plain_float64():
    """[PAD] inside decoder inputs (Megatron's dec_mask: decoder keys equal to [PAD] unattended): loss, logits and
    every gradient equal the float64 reference with that mask; ignoring the mask moves the logits (checked)."""
    c = T5Config(**BASE, **F64)
    groups = ParallelGroups.single()
    batch = _batch(c, torch.Generator().manual_seed(int(torch.randint(0, 2**20, ()))))
    dec_pad = torch.rand(batch["decoder_tokens"].shape) < 0.3
    dec_pad[:, 0] = False  # the start token
    dec_pad[0, 2] = True  # at least one [PAD] with real keys after it
    batch["decoder_padding_mask"] = dec_pad
    with reference_kernels():
        model = T5Model(c, groups, seed=int(torch.randint(0, 2**20, ())))
        loss = _loss(model(batch["tokens"], batch["decoder_tokens"], batch["padding_mask"], labels=batch["labels"],
                           decoder_padding_mask=dec_pad), batch)
        loss.backward()
        with torch.no_grad():
            logits = model(batch["tokens"], batch["decoder_tokens"], batch["padding_mask"],
                           decoder_padding_mask=dec_pad)[..., :c.vocab_size].transpose(0, 1)
    W = {k: v.detach().clone().requires_grad_() for k, v in gather_full_state(model, groups).items()}
    args = (W, c, batch["tokens"], batch["decoder_tokens"], batch["padding_mask"], batch["labels"],
            batch["loss_mask"].double())
    ref, ref_logits = plain_t5(*args, dec_pad=dec_pad)
    ref.backward()
    assert abs(loss.item() - ref.item()) / ref.item() < F64_REL  # float64 on both sides, as the test above
    assert _rel(logits, ref_logits) < F64_REL
    with torch.no_grad():
        assert _rel(plain_t5(*args)[1], ref_logits) > 1e-3  # the mask matters on this batch
    grads = gather_full_state(model, groups, grads=True)
    for k, w in W.items():
        assert _rel(grads[k], w.grad) < F64_REL, k


def test_masks_padding_causality_and_cross_attention():
    """Encoder padding is invisible; the decoder never sees later decoder tokens; it does see the encoder."""
    c = T5Config(**BASE)
    model = T5Model(c, ParallelGroups.single(), seed=2).eval()
    batch = _batch(c, torch.Generator().manual_seed(9))
    batch["padding_mask"][1, 7:] = True

    def logits(**change):
        b = {k: v.clone() for k, v in batch.items()}
        for key, (row, cols) in change.items():
            b[key][row, cols] = (b[key][row, cols] + 1) % c.vocab_size
        with torch.no_grad():
            return _forward(model, b, labels=False)[..., :c.vocab_size]

    base = logits()
    assert torch.allclose(base, logits(tokens=(1, slice(7, None))), atol=1e-6, rtol=0)  # padded encoder tokens
    later = logits(decoder_tokens=(2, slice(5, None)))
    assert torch.allclose(base[:5], later[:5], atol=1e-6, rtol=0)  # causal decoder
    assert not torch.allclose(base[5, 2], later[5, 2], atol=1e-4, rtol=0)
    enc = logits(tokens=(0, slice(11, None)))  # the last encoder token reaches every decoder position
    assert not torch.allclose(base[0, 0], enc[0, 0], atol=1e-4, rtol=0)


def test_parameter_count_and_unsupported_layouts():
    for extra in ({}, dict(num_query_groups=2, encoder_num_layers=3, decoder_num_layers=1, add_bias_linear=False)):
        c = T5Config(**BASE, **extra)
        assert num_parameters(c) == sum(p.numel() for p in T5Model(c, ParallelGroups.single(), seed=1).parameters())
    c = T5Config(**BASE)
    bad = [(c, ParallelConfig(pipeline_model_parallel_size=2), "--pipeline-model-parallel-size"),
           (c, ParallelConfig(context_parallel_size=2), "--context-parallel-size"),
           (dataclasses.replace(c, num_query_groups=1), ParallelConfig(tensor_model_parallel_size=2),
            "--num-query-groups 1"),
           (dataclasses.replace(c, decoder_seq_length=13), ParallelConfig(), "--decoder-seq-length 13 exceeds"),
           (dataclasses.replace(c, decoder_seq_length=7),
            ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), "--decoder-seq-length 7 is not"),
           (dataclasses.replace(c, position_embedding_type="rope"), ParallelConfig(), "learned_absolute")]
    for cfg, parallel, message in bad:
        with pytest.raises(ConfigError, match=message):
            validate_t5(cfg, parallel)
    with pytest.raises(ConfigError, match="--encoder-seq-length 16 and --seq-length 12"):
        T5Config(**BASE, encoder_seq_length=16)
    with pytest.raises(ConfigError, match="--vocab-extra-ids"):
        T5Config(**BASE, vocab_extra_ids=-1)


# ---- tensor / sequence parallel parity (one spawn) ----------------------------------------------
def _parity_step(c, g):
    from omnitron.core.models.gpt import allreduce_sequence_parallel_grads

    batch = _batch(c, torch.Generator().manual_seed(4))
    model = T5Model(c, g, seed=8)
    model, batch = on_groups_device(g, model, batch)  # the backend under test (the host for one process)
    token_loss = _forward(model, batch)
    _loss(token_loss, batch).backward()
    allreduce_sequence_parallel_grads(model, g)
    return {"token_loss": token_loss, "grads": gather_full_state(model, g, grads=True)}


def _parity_worker(tp: int) -> dict:
    cfgs = {"mha": T5Config(**{**BASE, "vocab_size": 251, "make_vocab_size_divisible_by": 1}),
            "gqa_recompute": T5Config(**{**BASE, "num_query_groups": 2, "recompute_granularity": "full",
                                         "recompute_method": "uniform", "decoder_num_layers": 1})}
    return tp_sp_parity(tp, cfgs, _parity_step)


def test_tensor_and_sequence_parallel_parity_tp2():
    assert_parity(run_distributed(_parity_worker, 2, 2))


# ---- the train command ----------------------------------------------------------------------------
def _train_args(tmp_path, *extra):
    return ["--model", "t5_tiny", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
            "--encoder-seq-length", "48", "--decoder-seq-length", "16", "--max-position-embeddings", "48",
            "--micro-batch-size", "8", "--global-batch-size", "16", "--lr", "3e-3", "--min-lr", "3e-3",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0", "--log-interval", "5",
            "--no-tensorboard", "--data-cache-path", str(tmp_path / "cache"), "--log-dir", str(tmp_path / "logs"),
            *extra]


def test_train_settings_for_t5(tmp_path):
    from omnitron.core.training.arguments import parse_settings

    s = parse_settings(_train_args(tmp_path, "--encoder-num-layers", "3", "--vocab-extra-ids", "20"), world_size=2)
    assert s.model_type == "t5" and isinstance(s.model, T5Config) and s.data.tokenizer_type == "BertWordPieceLowerCase"
    assert (s.model.seq_length, s.data.seq_length, s.model.decoder_seq_length) == (48, 48, 16)
    assert (s.model.encoder_num_layers, s.model.decoder_num_layers, s.model.vocab_extra_ids) == (3, None, 20)
    bad = [(["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size 2: T5"),
           (["--tokenizer-type", "GPT2BPETokenizer"], "BertWordPieceLowerCase"),
           (["--prompt", "hi"], "--prompt"),
           (["--decoder-seq-length", "64"], "--decoder-seq-length 64 exceeds")]
    for extra, message in bad:
        with pytest.raises(ConfigError, match=message):
            parse_settings(_train_args(tmp_path, *extra), world_size=2)
    with pytest.raises(ConfigError, match="add --model-type t5"):
        parse_settings(["--model", "gpt2_tiny", "--decoder-seq-length", "32"], world_size=1)
    # Megatron's T5 scripts give --encoder-num-layers / --decoder-num-layers and no --num-layers
    shape = ["--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32", "--mock-data"]
    s = parse_settings(["--model-type", "t5", "--encoder-num-layers", "3", "--decoder-num-layers", "2", *shape], 1)
    assert (s.model.num_layers, s.model.encoder_num_layers, s.model.decoder_num_layers) == (3, 3, 2)


def test_train_command_loss_drops_and_checkpoint_reshards(tmp_path):
    """`omnitron train --model t5_tiny` on the bundled corpus (WordPiece + 100 sentinels, span corruption)
    through the real loop, optimizer and checkpointing: the loss falls; the checkpoint reshards to tp2."""
    from omnitron.backends import get_backend
    from omnitron.core.checkpoint.reshard import Layout, convert, read_full_state
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    torch.manual_seed(0)
    s = parse_settings(_train_args(tmp_path, "--train-iters", "30", "--eval-interval", "30", "--eval-iters", "1",
                                   "--save", str(tmp_path / "ckpt")), world_size=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine: one thread does not spin against other jobs
    try:
        res = train(s, get_backend("cpu"))
    finally:
        torch.set_num_threads(threads)
    losses = [res["losses"][i] for i in sorted(res["losses"])]
    assert len(losses) == 30 and all(math.isfinite(v) for v in losses)
    first, last = sum(losses[:3]) / 3, sum(losses[-5:]) / 5
    assert first > math.log(8192) * 0.9 and last < first - 1.5, losses  # starts near uniform, then learns
    assert res["validation"] and math.isfinite(res["validation"][0]["val_loss"])
    src = sorted((tmp_path / "ckpt").glob("iter_*"))[-1]
    tp2 = convert(str(src), str(tmp_path / "tp2"), Layout(tp=2))
    a, b = read_full_state(str(src)), read_full_state(tp2)
    assert a.model.keys() == b.model.keys() and "decoder.layers.1.cross_attention.linear_kv.weight" in a.model
    assert all(torch.equal(a.model[k], b.model[k]) for k in a.model)
    assert a.model["output_layer.bias"].shape == (8192 + 100,)  # the vocabulary includes the sentinels
