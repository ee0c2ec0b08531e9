"""GPTModel (tp=1, fp32) against an independent plain-PyTorch GPT in float64 built from the same
full weights: logits, loss and every gradient. Also checks the padded vocabulary is invisible."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from omnitron.core.models.gpt import GPTConfig, GPTModel, gather_full_state
from omnitron.core.parallel.groups import ParallelGroups


def _norm(x, W, name, c):
    if c.normalization == "RMSNorm":
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.layernorm_epsilon) * W[name + ".weight"]
    return F.layer_norm(x, x.shape[-1:], W[name + ".weight"], W[name + ".bias"], c.layernorm_epsilon)


def _inv_freq(c, d):
    rot = int(d * c.rotary_percent) // 2 * 2
    inv = [1.0 / c.rotary_base ** (2 * i / rot) for i in range(rot // 2)]
    if c.rope_scaling_factor != 1.0:  # Llama-3.1 rule, written per frequency
        out = []
        for f in inv:
            wl = 2 * math.pi / f
            if wl < 8192 / 4.0:
                out.append(f)
            elif wl > 8192 / 1.0:
                out.append(f / c.rope_scaling_factor)
            else:
                sm = (8192 / wl - 1.0) / (4.0 - 1.0)
                out.append((1 - sm) * f / c.rope_scaling_factor + sm * f)
        inv = out
    return torch.tensor(inv, dtype=torch.float64)


def _rope(t, c):  # t [b, s, h, d]
    s, d = t.shape[1], t.shape[-1]
    inv = _inv_freq(c, d)
    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv[None]  # [s, r/2]
    cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
    r = 2 * inv.numel()
    rot, rest = t[..., :r], t[..., r:]
    if c.rotary_interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
    else:
        a, b = rot[..., : r // 2], rot[..., r // 2:]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    return torch.cat([out, rest], -1)


def plain_gpt_loss(W, c, tokens, labels):
    """Batch-first float64 GPT written from the maths: per-token loss [b, s] and logits [b, s, V]."""
    b, s = tokens.shape
    hq = c.num_attention_heads
    g = c.num_query_groups or hq
    d = c.kv_channels or c.hidden_size // hq
    x = W["embedding.word_embeddings.weight"][tokens]
    if c.position_embedding_type == "learned_absolute":
        x = x + W["embedding.position_embeddings.weight"][:s]
    lin = lambda t, n: t @ W[n + ".weight"].T + (W[n + ".bias"] if n + ".bias" in W else 0.0)  # noqa: E731
    for i in range(c.num_layers):
        p = f"decoder.layers.{i}."
        h = _norm(x, W, p + "input_layernorm", c)
        qkv = lin(h, p + "self_attention.linear_qkv").view(b, s, g, hq // g + 2, d)
        q, k, v = qkv[..., : hq // g, :].reshape(b, s, hq, d), qkv[..., -2, :], qkv[..., -1, :]
        if c.qk_layernorm:
            q, k = _norm(q, W, p + "self_attention.q_layernorm", c), _norm(k, W, p + "self_attention.k_layernorm", c)
        if c.position_embedding_type == "rope":
            q, k = _rope(q, c), _rope(k, c)
        k, v = k.repeat_interleave(hq // g, dim=2), v.repeat_interleave(hq // g, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        masked = torch.ones(s, s, dtype=torch.bool).triu(1)
        if c.window_size is not None and (i + 1) % int(c.window_attn_skip_freq or c.num_layers + 1) != 0:
            left = int(c.window_size.split(",")[0])  # query q sees keys q - left .. q
            masked |= torch.ones(s, s, dtype=torch.bool).tril(-left - 1)
        scores = scores.masked_fill(masked, float("-inf"))
        if c.softmax_type == "vanilla":
            probs = scores.softmax(-1)
        else:  # one extra logit per head in the denominator (a sink): learned, or 0 (off-by-one)
            sink = W[p + "self_attention.softmax_offset"] if c.softmax_type == "learnable" else torch.zeros(hq)
            e = (scores - scores.amax(-1, keepdim=True)).exp()
            probs = e / (e.sum(-1, keepdim=True) + (sink.view(1, hq, 1, 1) - scores.amax(-1, keepdim=True)).exp())
        att = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, hq * d)
        x = x + lin(att, p + "self_attention.linear_proj")
        h = lin(_norm(x, W, p + "pre_mlp_layernorm", c), p + "mlp.linear_fc1")
        if c.quick_geglu:  # gpt-oss: x sigmoid(1.702 x) on the clamped gate, times (clamped up + offset)
            gate, up = h.chunk(2, -1)
            lim = c.activation_func_clamp_value
            gate, up = torch.minimum(gate, torch.tensor(lim)), torch.clamp(up, -lim, lim)
            h = gate * torch.sigmoid(1.702 * gate) * (up + c.glu_linear_offset)
        elif c.swiglu:
            gate, up = h.chunk(2, -1)
            h = F.silu(gate) * up
        elif c.bias_gelu_fusion and c.add_bias_linear:  # Megatron-Core: tanh only in its fused bias-GeLU kernel
            h = F.gelu(h, approximate="tanh")
        else:  # --no-bias-gelu-fusion or --disable-bias-linear: F.gelu, exact
            h = F.gelu(h)
        x = x + lin(h, p + "mlp.linear_fc2")
    x = _norm(x, W, "decoder.final_layernorm", c)
    out_w = W["output_layer.weight"] if c.untie_embeddings_and_output_weights else W["embedding.word_embeddings.weight"]
    logits = x @ out_w.T
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view(b, s)
    return loss, logits


def _rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


BASE = dict(num_layers=2, seq_length=12, vocab_size=203, hidden_dropout=0.0, attention_dropout=0.0)
CASES = {
    "gpt2": GPTConfig(hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, **BASE),
    "llama_gqa": GPTConfig(hidden_size=48, num_attention_heads=6, num_query_groups=2, ffn_hidden_size=40,
                           normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                           untie_embeddings_and_output_weights=True, add_bias_linear=False, **BASE),
}
CASES["llama_variants"] = dataclasses.replace(CASES["llama_gqa"], qk_layernorm=True, rotary_percent=0.5,
                                              rotary_interleaved=True, rope_scaling_factor=8.0, rotary_base=500.0,
                                              kv_channels=16)
# exact (erf) GeLU as Megatron runs it: --no-bias-gelu-fusion, or no biases (tanh vs erf differ by up to 1e-3,
# far above the 1e-5 bound below)
CASES["gpt_exact_gelu"] = dataclasses.replace(CASES["gpt2"], bias_gelu_fusion=False)
CASES["gpt_no_bias_gelu"] = dataclasses.replace(CASES["gpt2"], add_bias_linear=False)
# --apply-layernorm-1p: the engine holds w - 1 for every norm's scale w (the reference gets w itself)
CASES["gpt2_1p"] = dataclasses.replace(CASES["gpt2"], apply_layernorm_1p=True)
CASES["llama_qk_1p"] = dataclasses.replace(CASES["llama_gqa"], apply_layernorm_1p=True, qk_layernorm=True)
# gpt-oss: a 4-key window on layer 0 (every 2nd layer full), learned sinks, the clamped quick-GeGLU (clamp 0.05:
# below the fc1 outputs' spread at this init, so both sides of the clamp are exercised), with biases
CASES["gpt_oss_features"] = dataclasses.replace(CASES["llama_gqa"], window_size="3,0", window_attn_skip_freq="2",
                                                softmax_type="learnable", quick_geglu=True, glu_linear_offset=1.0,
                                                activation_func_clamp_value=0.05, add_bias_linear=True)
# Qwen2 / Qwen2.5 (Megatron's --disable-bias-linear --add-qkv-bias): biases on q, k and v only
CASES["qwen2_qkv_bias"] = dataclasses.replace(CASES["llama_gqa"], add_qkv_bias=True)
CASES["off_by_one_window_all"] = dataclasses.replace(CASES["llama_gqa"], window_size="2,0", softmax_type="off-by-one")


@pytest.mark.parametrize("name", sorted(CASES))
def test_engine_matches_plain_float64(name):
    c = CASES[name]
    groups = ParallelGroups.single()
    model = GPTModel(c, groups, seed=3)
    assert model.output_layer.weight is None or c.untie_embeddings_and_output_weights
    gen = torch.Generator().manual_seed(0)
    norms = [n for n, _ in model.named_parameters() if n.endswith("layernorm.weight")]
    if c.apply_layernorm_1p:
        assert all(float(model.get_parameter(n).detach().abs().max()) == 0 for n in norms), "1p norms start at 0"
        with torch.no_grad():  # away from 0, so that a missing or doubled + 1 shows
            for n in norms:
                model.get_parameter(n).normal_(0.0, 0.2, generator=gen)
    with torch.no_grad():  # sinks far from their small init, so a sign or head mix-up shows
        for n, p in model.named_parameters():
            if n.endswith("softmax_offset"):
                p.normal_(0.0, 1.0, generator=gen)
            if c.add_qkv_bias and n.endswith("linear_qkv.bias"):  # away from its zero init: a dropped bias shows
                p.normal_(0.0, 0.5, generator=gen)
    tokens = torch.randint(0, c.vocab_size, (2, c.seq_length), generator=gen)
    labels = torch.randint(0, c.vocab_size, (2, c.seq_length), generator=gen)
    loss = model(tokens, labels=labels)
    loss.mean().backward()
    state = gather_full_state(model, groups)
    shift = {n: 1.0 if c.apply_layernorm_1p and n in norms else 0.0 for n in state}
    W = {k: (v.double() + shift[k]).requires_grad_() for k, v in state.items()}
    ref_loss, ref_logits = plain_gpt_loss(W, dataclasses.replace(c, apply_layernorm_1p=False), tokens, labels)
    ref_loss.mean().backward()
    assert loss.dtype == torch.float32 and loss.shape == tokens.shape
    assert _rel(loss, ref_loss) < 1e-5
    with torch.no_grad():
        logits = model(tokens)  # [s, b, V_pad], padding at -inf
    V = c.vocab_size
    assert logits.shape[-1] == 256 and torch.isinf(logits[..., V:]).all()  # 203 padded to 128-multiple
    assert _rel(logits[..., :V].transpose(0, 1), ref_logits) < 1e-5
    grads = gather_full_state(model, groups, grads=True)
    for k, w in W.items():
        assert _rel(grads[k], w.grad) < 1e-5, k


def test_padding_rows_stay_zero_and_unused():
    c = CASES["gpt2"]
    model = GPTModel(c, ParallelGroups.single(), seed=1)
    emb = model.embedding.word_embeddings.weight
    assert emb.shape[0] == 256 and emb[c.vocab_size:].abs().sum() == 0
    tokens = torch.randint(0, c.vocab_size, (2, c.seq_length))
    model(tokens, labels=tokens).mean().backward()
    assert emb.grad[c.vocab_size:].abs().sum() == 0


def test_init_is_seed_and_name_determined():
    c = CASES["llama_gqa"]
    g = ParallelGroups.single()
    a, b, other = GPTModel(c, g, seed=5), GPTModel(c, g, seed=5), GPTModel(c, g, seed=6)
    sa, sb, so = (gather_full_state(m, g) for m in (a, b, other))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["decoder.layers.0.mlp.linear_fc1.weight"], so["decoder.layers.0.mlp.linear_fc1.weight"])
    # a pipeline stage holding layers [1, 2) draws layer 1 exactly as the whole model does
    stage = GPTModel(c, g, seed=5, pre_process=False, layer_offset=1, num_layers=1)
    ss = gather_full_state(stage, g)
    assert ("decoder.layers.1.self_attention.linear_qkv.weight" in ss
            and "decoder.layers.0.mlp.linear_fc2.weight" not in ss)
    assert all(torch.equal(ss[k], sa[k]) for k in ss)
    # scaled init of output projections: std / sqrt(2 L)
    fc2 = sa["decoder.layers.0.mlp.linear_fc2.weight"]
    assert abs(fc2.std().item() - 0.02 / math.sqrt(2 * c.num_layers)) < 0.003


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa"])
def test_two_stages_chain_to_the_whole_model(name):
    """Pipeline stages are GPTModels with layer ranges: stage 1's hidden fed to stage 2 gives the
    whole model's loss; with tied embeddings the two copies' grads sum to the whole model's grad."""
    c = dataclasses.replace(CASES[name], num_layers=4)
    g = ParallelGroups.single()
    whole = GPTModel(c, g, seed=2)
    first = GPTModel(c, g, seed=2, post_process=False, layer_offset=0, num_layers=1)
    last = GPTModel(c, g, seed=2, pre_process=False, layer_offset=1, num_layers=3)
    tokens = torch.randint(0, c.vocab_size, (2, c.seq_length))
    ref = whole(tokens, labels=tokens)
    ref.mean().backward()
    h = first(tokens)
    assert h.shape == (c.seq_length, 2, c.hidden_size)
    h_in = h.detach().requires_grad_()
    loss = last(hidden=h_in, labels=tokens)
    loss.mean().backward()
    h.backward(h_in.grad)
    assert _rel(loss, ref) < 1e-6
    W = dict(whole.named_parameters())
    shared = [p for m in (first, last) for p in m.shared_embedding_parameters()]
    if c.untie_embeddings_and_output_weights:
        assert shared == []
    else:
        assert len(shared) == 2 and torch.equal(shared[0], shared[1])  # the copy starts equal
        assert _rel(shared[0].grad + shared[1].grad, W["embedding.word_embeddings.weight"].grad) < 1e-5
    for m in (first, last):
        for k, p in m.named_parameters():
            if not getattr(p, "shared_embedding", False) and not (k.startswith("embedding.word") and not
                                                                   c.untie_embeddings_and_output_weights):
                assert _rel(p.grad, W[k].grad) < 1e-5, k
