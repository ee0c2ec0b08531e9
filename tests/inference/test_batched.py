"""Batched generation (left-padded prompts, KV cache) against a per-prompt full recomputation in plain torch."""
from __future__ import annotations

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.core.inference import SamplingParams, generate_batch
from omnitron.core.inference.sampling import filter_logits, sample_next
from omnitron.core.models.gpt.presets import gpt2_tiny, llama_tiny
from omnitron.core.models.gpt.model import GPTModel
from omnitron.core.parallel.groups import ParallelGroups

V = 300


def sharp_model(cfg, seed=3):
    """A random tiny GPT with weights scaled up, so greedy choices are well separated."""
    m = GPTModel(cfg, ParallelGroups.single(), backend=get_backend("cpu"), seed=seed).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim > 1:
                p.mul_(4.0)
    return m


CONFIGS = {
    "gpt2": lambda: gpt2_tiny(num_layers=2, hidden_size=64, vocab_size=V, seq_length=40, max_position_embeddings=40),
    "llama_gqa": lambda: llama_tiny(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                    vocab_size=V, seq_length=40),
    # gpt-oss's attention: a 4-token window on every other layer and sinks; the window is shorter than the
    # generated rows, so cached decoding must drop keys that fell out of it
    "gpt_oss_window_sinks": lambda: llama_tiny(num_layers=2, hidden_size=64, num_attention_heads=4,
                                               num_query_groups=2, vocab_size=V, seq_length=40, window_size="3,0",
                                               window_attn_skip_freq="2", softmax_type="off-by-one"),
}


@torch.no_grad()
def full_logits(model, seq):
    """Plain recomputation: logits [len, V] of one unpadded sequence (positions 0..len-1), in fp32 or the model's
    dtype where wider (as generation's log-probs)."""
    out = model(tokens=torch.tensor([seq]))[:, 0]
    return out.to(torch.promote_types(out.dtype, torch.float32))


def reference(model, prompt, n, eod=None, limit=40):
    """Greedy continuation and log-probs of every token after the first, no cache, one prompt at a time."""
    seq = list(prompt)
    while len(seq) - len(prompt) < n and len(seq) < limit:
        seq.append(int(torch.argmax(full_logits(model, seq)[-1])))
        if seq[-1] == eod:
            break
    lp = torch.log_softmax(full_logits(model, seq), -1)[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
    return seq[len(prompt):], lp


def random_prompts(lengths):
    return [torch.randint(0, V, (n,)).tolist() for n in lengths]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_batch_matches_per_prompt_recompute(name):
    model = sharp_model(CONFIGS[name]())
    prompts = random_prompts([1, 9, 4, 6])
    out = generate_batch(model, prompts, 8, return_log_probs=True)
    for p, toks, lps in zip(prompts, out.tokens, out.log_probs):
        ref, ref_lp = reference(model, p, 8)
        assert toks == ref and len(toks) == 8
        assert len(lps) == len(p) - 1 + 8
        torch.testing.assert_close(torch.tensor(lps), ref_lp, atol=1e-5, rtol=0)
    # the no-cache path (whole padded sequence each step) agrees too
    assert generate_batch(model, prompts, 8, use_cache=False).tokens == out.tokens


def test_eod_stops_each_row_and_context_limit():
    model = sharp_model(CONFIGS["gpt2"]())
    prompts = random_prompts([3, 7, 5])
    free = generate_batch(model, prompts, 6).tokens
    j = max(k for k, t in enumerate(free[0]) if t not in free[0][:k])  # row 0 first meets it at step j + 1
    eod = free[0][j]  # other rows stop wherever they meet it
    out = generate_batch(model, prompts, 6, eod=eod)
    for p, toks in zip(prompts, out.tokens):
        assert toks == reference(model, p, 6, eod=eod)[0]
    assert out.tokens[0] == free[0][:j + 1]
    # rows stop at the 40-position context, each at its own length
    long = generate_batch(model, random_prompts([30, 12]), 100).tokens
    assert [len(t) for t in long] == [10, 28]


def test_sampling_is_per_row_seeded_and_cache_independent():
    model = sharp_model(CONFIGS["llama_gqa"](), seed=5)
    with torch.no_grad():  # soften so sampling has real choices
        model.output_layer.weight.mul_(0.1) if model.output_layer.weight is not None else None
    prompts = random_prompts([2, 8, 5])
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=11)
    batch = generate_batch(model, prompts, 10, params=params)
    for i, p in enumerate(prompts):
        alone = SamplingParams(temperature=0.9, top_p=0.9, seed=11 + i)
        assert generate_batch(model, [p], 10, params=alone).tokens[0] == batch.tokens[i]
        assert generate_batch(model, [p], 10, params=alone, use_cache=False).tokens[0] == batch.tokens[i]
    assert generate_batch(model, prompts, 10, params=params).tokens == batch.tokens
    other = generate_batch(model, prompts, 10, params=SamplingParams(temperature=0.9, top_p=0.9, seed=12))
    assert other.tokens != batch.tokens


def test_filters_against_plain_torch():
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    # top-k keeps exactly the k largest
    kept = torch.isfinite(filter_logits(logits, SamplingParams(top_k=5)))
    assert torch.equal(kept.sum(1), torch.full((4,), 5))
    assert torch.equal(kept, torch.zeros_like(kept).scatter(1, torch.topk(logits, 5).indices, True))
    # top-p keeps the smallest likeliest prefix whose mass reaches p, the mass of the tempered distribution
    # (Megatron divides the logits by the temperature before filtering)
    for temperature in (1.0, 0.5, 2.0):
        p = torch.softmax(logits.double() / temperature, -1)
        kept = torch.isfinite(filter_logits(logits, SamplingParams(top_p=0.7, temperature=temperature)))
        for row in range(4):
            order = torch.argsort(p[row], descending=True)
            n = int((torch.cumsum(p[row][order], 0) <= 0.7).sum()) + 1
            assert set(torch.nonzero(kept[row])[:, 0].tolist()) == set(order[:n].tolist()), temperature
    # a likelier prefix whose mass is exactly p keeps the next token too (Megatron's rule: a token is dropped
    # once the tokens before it hold more than p); k equal logits give probabilities 1/k, exact in binary for
    # k = 2, 4, so the running sums are exact and the tie is a real tie
    for k, top_p, want in ((2, 0.5, 2), (4, 0.25, 2), (4, 0.5, 3)):
        kept = torch.isfinite(filter_logits(torch.zeros(1, k), SamplingParams(top_p=top_p)))
        assert int(kept.sum()) == want, (k, top_p)
    # draws follow the filtered, tempered distribution
    params = SamplingParams(temperature=0.7, top_k=6, seed=0)
    gens = [torch.Generator().manual_seed(i) for i in range(4000)]
    draws = sample_next(logits[:1].expand(4000, -1), params, gens)
    # the reference from the definition, not filter_logits: softmax(logits / T) over the top 6, renormalised
    tempered = torch.softmax(logits[0].double() / 0.7, -1)
    top = torch.zeros_like(tempered).scatter(0, torch.topk(logits[0], 6).indices, 1.0)
    want = (tempered * top / (tempered * top).sum()).float()
    freq = torch.bincount(draws, minlength=50).float() / 4000
    assert torch.all(freq[want == 0] == 0)
    # each frequency is a mean of 4000 Bernoulli draws: std sqrt(p (1 - p) / 4000) <= 0.0079, so 0.03 is 3.8
    # std; temperature misapplied (e.g. sqrt(T)) moves the likeliest token's probability by 0.07
    assert torch.allclose(freq, want, atol=0.03)


@pytest.mark.parametrize("temperature", [1e-320, 1e-300, 1e-45, 1e-30])
def test_tiny_temperatures_are_greedy_and_padding_is_never_drawn(temperature):
    """A temperature in the documented range but tiny enough that logits / T overflow: the draw is the argmax
    (plain torch) of the real columns, never a vocabulary-padding column (-inf logits); a row whose logits
    hold a NaN falls back to its argmax of the rest."""
    real, padded, rows = 32, 40, 8
    logits = torch.randn(rows, padded) * 3
    logits[:, real:] = float("-inf")
    logits[0, 5] = float("nan")
    gens = [torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())) + i) for i in range(rows)]
    got = sample_next(logits, SamplingParams(temperature=temperature), gens)
    want = torch.argmax(torch.nan_to_num(logits, nan=float("-inf")), dim=-1)
    assert torch.equal(got, want) and int(got.max()) < real



def test_a_nan_logit_is_never_the_draw():
    """A row whose logits hold a NaN draws the argmax of its other logits (plain torch over the rest), also where
    every real logit is negative (a NaN read as 0 would then win), at any temperature."""
    rows, vocab = 6, 24
    logits = torch.randn(rows, vocab) - 10.0
    where = torch.randint(0, vocab, (rows,))
    logits[torch.arange(rows), where] = float("nan")
    want = logits.masked_fill(logits.isnan(), float("-inf")).argmax(-1)
    for temperature in (1.0, 1e-30):
        gens = [torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())) + i) for i in range(rows)]
        assert torch.equal(sample_next(logits, SamplingParams(temperature=temperature), gens), want)

def test_bad_input_is_named():
    model = sharp_model(CONFIGS["gpt2"]())
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate_batch(model, [[1], []], 3)
    with pytest.raises(ValueError, match="more than the model's context of 40"):
        generate_batch(model, [list(range(41))], 3)
    with pytest.raises(ValueError, match="outside \\[0, 300\\)"):
        generate_batch(model, [[1, 300]], 3)
    for bad in (dict(top_k=-1), dict(top_p=1.5), dict(temperature=-0.1), dict(seed=-2), dict(seed=2**63)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


def megatron_refuses(top_k: int, top_p: float) -> bool:
    """Megatron-LM d98e8a6, transcribed: megatron/core/inference/sampling/torch_sampling.py (the default sampling
    backend's ``sample_from_logits``, before its greedy shortcut) ``assert not (top_k > 0 and top_p > 0.0)``;
    text_generation_server.py (``/api``) ``if top_p > 0.0 and top_k > 0.0: "cannot set both top-k and top-p"``."""
    return top_k > 0 and top_p > 0.0


@pytest.mark.parametrize("top_k", [0, 1, 5, 20])
@pytest.mark.parametrize("top_p", [0.0, 0.5, 1.0])
def test_top_k_with_top_p_is_refused_where_megatron_refuses_it(top_k, top_p):
    """omnitron's library takes the requests its server (and Megatron's library and server) take."""
    if megatron_refuses(top_k, top_p):
        with pytest.raises(ValueError, match="top_k and top_p together"):
            SamplingParams(top_k=top_k, top_p=top_p)
    else:
        SamplingParams(top_k=top_k, top_p=top_p)


@pytest.mark.parametrize("params", [SamplingParams(top_p=0.7), SamplingParams(top_k=5), SamplingParams()],
                         ids=("top_p", "top_k", "plain"))
def test_the_largest_draw_never_passes_the_last_kept_token(params, monkeypatch):
    """torch.rand's largest float32 draw, 1 - 2**-24, picks a kept token (plain float64 top-k / nucleus sets),
    never a filtered or vocabulary-padding column after the last kept one: u * total rounds below total for any
    total, so no clamp is needed. It stops short of the last kept token only where the kept mass after its pick
    is below the draw's resolution: the pick is the first cdf entry above fl(u * total) >= total (1 - 2u), so
    the mass after it is < 2u of the total, plus the float32 rounding of the cdf and the softmax (<= 2u): 4u."""
    rows, real, padded = 64, 37, 48
    logits = torch.randn(rows, padded) * 3
    logits[:, real:] = float("-inf")
    top = 1.0 - 2.0 ** -24
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.full((1,), top))
    got = sample_next(logits, params, [torch.Generator() for _ in range(rows)])
    x = logits[:, :real].double()
    order = torch.argsort(x, dim=-1, descending=True)
    if params.top_k:
        kept_sorted = torch.arange(real)[None, :] < params.top_k
    elif params.top_p:
        mass_before = torch.cumsum(torch.softmax(x, -1).gather(1, order), -1) - torch.softmax(x, -1).gather(1, order)
        kept_sorted = mass_before <= params.top_p
    else:
        kept_sorted = torch.ones(rows, real, dtype=torch.bool)
    kept = torch.zeros(rows, real, dtype=torch.bool).scatter(1, order, kept_sorted.expand(rows, real))
    assert bool(kept.gather(1, got[:, None].clamp(max=real - 1)).all()) and int(got.max()) < real, got
    probs = torch.softmax(x.masked_fill(~kept, float("-inf")), -1)
    after = (probs * (torch.arange(real)[None, :] > got[:, None])).sum(-1)
    assert float(after.max()) <= 4 * 2.0 ** -24, after.max()
