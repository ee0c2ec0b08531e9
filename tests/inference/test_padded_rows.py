"""Padded prompts on the backend under test (``--backend sim``: a device that is not the host), in float64, against each row run alone and unpadded
on the host (plain recomputation, no cache, same weights).

Left padding (GPT generation): a padding query's attention output is zero, as Megatron's padding-masked attention
gives (finite: it is cached as the next layer's input), every slot's logits are finite, and the real slots' logits,
greedy tokens and log-probs are the unpadded row's. Right padding (T5: encoder sources and decoder inputs padded at
the end, Megatron's layout): the real positions' logits are the unpadded row's, the padding positions finite. A fully
masked attention row (a left-padded causal padding mask: the first query sees only padding keys) gives zeros.

Error analysis: both sides are float64 (u = 1.1e-16) and differ in summation order and in the padding keys the
masked softmax skips (exact zeros): sums of at most 128 terms per GEMM, a few GEMMs per layer, two to four layers,
~sqrt(128) x 10 x 4 = 450 u relative to the logits' scale, ~5e-14; bound 1e-12 of the row's largest logit. A padding
key that leaks into a real row moves its logits by O(1e-2) (weights scaled up), a NaN anywhere fails the finiteness.
"""
from __future__ import annotations

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.core.inference import generate_batch
from omnitron.core.inference.kv_cache import KVCache
from omnitron.core.models.gpt.model import GPTModel
from omnitron.core.models.gpt.presets import llama_tiny
from omnitron.core.models.t5 import T5Model
from omnitron.core.models.t5.config import t5_tiny
from omnitron.core.parallel.groups import ParallelGroups

V, TOL = 300, 1e-12


@pytest.fixture(scope="module")
def sim(backend):
    """The backend under test: run with ``--backend sim`` for the device that is not the host (in a cpu session
    PrivateUse1 is the MUSA double's, so sim cannot join it; there the same checks run on the host)."""
    return backend


def _pair(make, sim):
    """The same float64 weights on the host (cpu backend) and on sim, eval mode, weights scaled up x4."""
    host = make(get_backend("cpu")).double().eval()
    with torch.no_grad():
        for p in host.parameters():
            if p.ndim > 1:
                p.mul_(4.0)
    dev = make(sim).double().eval()
    dev.load_state_dict(host.state_dict())
    return host, dev.to(sim.current_device())


def _close(got, want, what):
    """``got`` equals ``want`` (TOL's bound) over the real vocabulary columns, all finite (the padding columns past
    ``V`` are -inf on both sides)."""
    got, want = got.detach().cpu().double()[..., :V], want.detach().double()[..., :V]
    assert torch.isfinite(got).all(), what
    err = float((got - want).abs().max())
    assert err <= TOL * float(want.abs().max()), (what, err)


GPT_EXTRA = {"llama": {},  # the masked softmax over the cache (a padding query sees itself)
             # gpt-oss's attention: the window / sink path (a 4-token window on every other layer, sinks)
             "window_sinks": dict(window_size="3,0", window_attn_skip_freq="2", softmax_type="off-by-one")}


def _gpt(be, kind):
    cfg = llama_tiny(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=V,
                     seq_length=40, **GPT_EXTRA[kind])
    return GPTModel(cfg, ParallelGroups.single(), backend=be, seed=3)


@pytest.mark.parametrize("kind", sorted(GPT_EXTRA))
@torch.no_grad()
def test_left_padded_prompts_on_sim_equal_each_row_alone(sim, kind):
    host, dev = _pair(lambda be: _gpt(be, kind), sim)
    prompts = [torch.randint(0, V, (n,)).tolist() for n in (5, 1, 9, 3)]
    width, d = 9, sim.current_device()
    pad = torch.tensor([width - len(p) for p in prompts])[:, None]
    slots = torch.arange(width)[None]
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, int(pad[i]):] = torch.tensor(p)
    seen = []
    hooks = [layer.self_attention.linear_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().cpu()))
             for layer in dev.decoder.layers.values()]
    try:
        with KVCache(dev) as cache:
            cache.valid = (slots >= pad).to(d)
            logits = dev(tokens=ids.to(d), position_ids=(slots - pad).clamp(min=0).to(d))  # [s, b, V_pad]
    finally:
        for h in hooks:
            h.remove()
    for i, p in enumerate(prompts):
        want = host(tokens=torch.tensor([p]))[:, 0]  # [len, V_pad]
        _close(logits[int(pad[i]):, i], want, ("prefill row", i))
        assert torch.isfinite(logits[:int(pad[i]), i, :V]).all(), ("padding slots of row", i)
        for out in seen:  # [s, b, h]: each layer's attention output before its projection
            assert torch.equal(out[:int(pad[i]), i], torch.zeros_like(out[:int(pad[i]), i])), ("padding query", i)
    gen = generate_batch(dev, prompts, 4, return_log_probs=True)
    for i, p in enumerate(prompts):
        seq = list(p)
        for _ in range(4):  # greedy, whole-sequence recomputation of the row alone
            seq.append(int(torch.argmax(host(tokens=torch.tensor([seq]))[-1, 0])))
        assert gen.tokens[i] == seq[len(p):], ("tokens of row", i)
        lp = torch.log_softmax(host(tokens=torch.tensor([seq]))[:-1, 0], -1).gather(1, torch.tensor(seq[1:])[:, None])
        got = torch.tensor(gen.log_probs[i], dtype=torch.float64)
        assert float((got - lp[:, 0]).abs().max()) <= TOL * float(lp.abs().max()), ("log-probs of row", i)


def _t5(be):
    cfg = t5_tiny(num_layers=4, encoder_num_layers=2, decoder_num_layers=2, hidden_size=64, ffn_hidden_size=128,
                  vocab_size=V, seq_length=24, decoder_seq_length=16, max_position_embeddings=24, num_query_groups=2)
    return T5Model(cfg, ParallelGroups.single(), backend=be, seed=4)


@torch.no_grad()
def test_right_padded_t5_rows_on_sim_equal_each_row_alone(sim):
    host, dev = _pair(_t5, sim)
    d = sim.current_device()
    src_lens, dec_lens = (7, 12, 3), (5, 2, 9)
    srcs = [torch.randint(1, V, (n,)) for n in src_lens]
    decs = [torch.randint(1, V, (n,)) for n in dec_lens]
    enc = torch.zeros(3, max(src_lens), dtype=torch.long)
    dec = torch.zeros(3, max(dec_lens), dtype=torch.long)
    for i in range(3):
        enc[i, :src_lens[i]], dec[i, :dec_lens[i]] = srcs[i], decs[i]
    enc_pad = torch.arange(enc.shape[1])[None] >= torch.tensor(src_lens)[:, None]
    dec_pad = torch.arange(dec.shape[1])[None] >= torch.tensor(dec_lens)[:, None]
    logits = dev(enc.to(d), dec.to(d), enc_pad.to(d), decoder_padding_mask=dec_pad.to(d))  # [s_dec, b, V_pad]
    for i in range(3):
        want = host(srcs[i][None], decs[i][None], torch.zeros(1, src_lens[i], dtype=torch.bool))[:, 0]
        _close(logits[:dec_lens[i], i], want, ("t5 row", i))
        assert torch.isfinite(logits[dec_lens[i]:, i, :V]).all(), ("padding positions of t5 row", i)


@torch.no_grad()
def test_a_fully_masked_attention_row_on_sim_is_zero(sim):
    """A left-padded causal padding mask (T5's decoder mask with the padding first): the first query sees only
    padding keys. Its output is zero, the real queries' equal the unpadded row's (float64, TOL's analysis)."""
    host, dev = _pair(_t5, sim)
    attn_dev = dev.decoder.layers["0"].self_attention
    attn_host = host.decoder.layers["0"].self_attention
    s, b, h, npad = 6, 2, 64, 2
    x = torch.randn(s, b, h, dtype=torch.float64)
    mask = torch.zeros(b, s, dtype=torch.bool)
    mask[0, :npad] = True  # row 0: two padding slots first; row 1: none
    out = attn_dev(x.to(sim.current_device()), None, causal_padding_mask=mask.to(sim.current_device()))
    out = (out[0] if isinstance(out, tuple) else out).cpu()
    assert torch.isfinite(out).all()
    want_real = attn_host(x[npad:, :1], None)
    want_real = want_real[0] if isinstance(want_real, tuple) else want_real
    _close(out[npad:, :1], want_real, "real queries after the padding")
    bias = attn_host.linear_proj.bias if getattr(attn_host.linear_proj, "bias", None) is not None else None
    zero_row = torch.zeros(h, dtype=torch.float64) if bias is None else bias.detach().double().expand(h)
    assert torch.allclose(out[0, 0], zero_row, atol=0, rtol=0) or torch.equal(out[0, 0], zero_row)
