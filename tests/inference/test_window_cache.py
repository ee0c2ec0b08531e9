"""Sliding-window layers' KV cache: a ring of the window's ``left + 1`` slots (kv_cache.RingBuffer) gives the tokens
and log-probs of the cache that keeps every slot, and of a per-prompt recomputation without a cache, in float64:
prompts longer than the window, generation past several wrap-arounds, left-padded batches."""
from __future__ import annotations

import pytest
import torch

import omnitron.core.inference.kv_cache as K
from omnitron.core.inference import generate_batch
from omnitron.core.models.gpt.presets import llama_tiny

from test_batched import reference, sharp_model

V = 300
WINDOWS = {
    # gpt-oss: the window on every other layer (from the first), learned sinks
    "gpt_oss": dict(window_size="4,0", window_attn_skip_freq="2", softmax_type="learnable"),
    # Mistral: every layer windowed (--window-size alone), plain softmax
    "mistral": dict(window_size="5,0"),
}
# Error analysis of the log-prob tolerance: the ring and the all-slots cache compute the same float64 softmax sums
# (the slots a window drops contribute exact zeros there) in another order of at most 40 terms, so they differ by
# at most ~40 * 2^-53 relative to the logits' magnitude (< 1e3 for these scaled-up weights): < 1e-11.
ATOL = 1e-11


def _model(name):
    cfg = llama_tiny(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=V,
                     seq_length=40, params_dtype=torch.float64, **WINDOWS[name])
    return sharp_model(cfg, seed=int(torch.randint(0, 1000, ())))


def _every_slot(model, prompts, n):
    """The same generation with every layer keeping every slot (the cache before rings)."""
    ring = K._buffer
    K._buffer = lambda module, dim, capacity: K.SlotBuffer(dim, capacity)
    try:
        return generate_batch(model, prompts, n, return_log_probs=True)
    finally:
        K._buffer = ring


@pytest.mark.parametrize("name", sorted(WINDOWS))
def test_ring_equals_every_slot_and_recompute(name):
    model = _model(name)
    prompts = [torch.randint(0, V, (n,)).tolist() for n in (13, 2, 9, 6)]  # longer and shorter than the window
    out = generate_batch(model, prompts, 16, return_log_probs=True)  # 29 slots: the 5-/6-slot rings wrap 4+ times
    full = _every_slot(model, prompts, 16)
    assert out.tokens == full.tokens
    for got, want in zip(out.log_probs, full.log_probs):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=ATOL, rtol=0)
    for p, toks, lps in zip(prompts, out.tokens, out.log_probs):
        ref, ref_lp = reference(model, p, 16)
        assert toks == ref
        # the no-cache recompute: float64 sums over at most 29 keys in another order, ATOL's analysis; 1e-9 leaves room
        torch.testing.assert_close(torch.tensor(lps, dtype=torch.float64), ref_lp.double(), atol=1e-9, rtol=0)


def test_window_layers_hold_only_the_window():
    """gpt-oss's pattern: layer 0 keeps its window's 5 slots per row, layer 1 (full attention) every slot."""
    model, seen, leave = _model("gpt_oss"), [], K.KVCache.__exit__

    def spy(self, *exc):
        seen.append([tuple(k.shape) for k in self.keys])
        return leave(self, *exc)

    K.KVCache.__exit__ = spy
    try:
        generate_batch(model, [[1] * 11, [2] * 7], 10)
    finally:
        K.KVCache.__exit__ = leave
    assert seen == [[(2, 2, 5, 16), (2, 2, 20, 16)]]  # 11 + 10 - 1 slots fed; the ring 4 + 1


def test_multi_token_steps_after_the_prefill():
    """Steps of several new slots after the prefill (the ring's held slots and the new ones) equal one forward of
    the whole sequence, for a window layer wrapped mid-step."""
    model = _model("mistral")
    tokens = torch.randint(0, V, (2, 20))
    pos = torch.arange(20).expand(2, 20)
    with torch.no_grad():
        whole = model(tokens=tokens, position_ids=pos)
        with K.KVCache(model):
            parts = [model(tokens=tokens[:, a:b], position_ids=pos[:, a:b])
                     for a, b in ((0, 7), (7, 10), (10, 11), (11, 19), (19, 20))]
    torch.testing.assert_close(torch.cat(parts), whole, atol=ATOL, rtol=0)


def test_ring_buffer_slot_numbers():
    """Every stored entry holds the slot its number says, and a single step's keys are the last ``size`` slots."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 1000, ())))
    ring, seq = K.RingBuffer(2, 4), None
    for n in (6, 1, 1, 3, 1, 1, 5, 1):
        new = torch.randn(2, 3, n, 8, generator=g, dtype=torch.float64)
        seq = new if seq is None else torch.cat([seq, new], 2)
        keys, slots = ring.append(new)
        assert torch.equal(keys, seq[:, :, slots])
        if n == 1:
            assert sorted(slots.tolist()) == list(range(seq.shape[2] - 4, seq.shape[2]))
        assert torch.equal(ring.held(), seq[:, :, ring.slot_numbers("cpu")])
