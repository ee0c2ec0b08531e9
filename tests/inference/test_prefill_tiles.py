"""The KV-cached prefill of a model with sliding windows and attention sinks (gpt-oss's attention) runs the training
path's blocks, not a masked softmax over ``[b, hq, s, s]`` scores: its logits equal the uncached forward of each
prompt alone (float64), and no tensor it makes is as large as those scores."""
from __future__ import annotations

import os

import torch

from omnitron.backends import get_backend
from omnitron.core.inference.generation import _left_pad
from omnitron.core.inference.kv_cache import KVCache
from omnitron.core.models.gpt.presets import llama_tiny
from omnitron.core.models.gpt.model import GPTModel
from omnitron.core.parallel.context.tiles import TILE_MIN
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.kernels.reference.attention_block import ROW_CHUNK
from omnitron.testing.ops import LargestTensor, OpCounter

V, HQ, D, WINDOW = 96, 4, 16, 40


def _model(seed: int) -> GPTModel:
    """gpt-oss's attention in a tiny float64 Llama: a WINDOW-key window on every other layer, learnable sinks
    (drawn at random, as large as the scores: a sink that takes visible mass)."""
    cfg = llama_tiny(num_layers=2, hidden_size=HQ * D, num_attention_heads=HQ, num_query_groups=2, ffn_hidden_size=96,
                     vocab_size=V, seq_length=512, max_position_embeddings=512, window_size=f"{WINDOW - 1},0",
                     window_attn_skip_freq="2", softmax_type="learnable", params_dtype=torch.float64)
    m = GPTModel(cfg, ParallelGroups.single(), backend=get_backend("cpu"), seed=seed).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in m.decoder.layers.values():
            layer.self_attention.softmax_offset.copy_(torch.randn(HQ, generator=g, dtype=torch.float64))
    return m


@torch.no_grad()
def test_cached_prefill_with_window_and_sinks_matches_the_uncached_forward_in_tiles():
    """Prompts of 512 and 389 tokens (the second left-padded by 123 slots), batched in one cached prefill.

    Values: each row's logits at its real slots against the uncached forward of that prompt alone. Both sum the
    same products (the blocks of one sequence; the padded row's on its real slots), at most in another order, so in
    float64 they differ by about layers x (s + d + ffn) x u x |logits| ~ 2 x 624 x 1.1e-16 ~ 1.4e-13 relative;
    bound 1e-11.

    Memory: the masked softmax made ``[b, hq, s, s + 1]`` scores (2.1M elements). The blocks make at most a row's
    ``[hq, s, d]`` outputs or ``[hq, t, t]`` tiles (t = max(TILE_MIN, WINDOW)) on window layers, the reference
    block's ``[hq, ROW_CHUNK, s]`` row chunk on the full-attention layer (the cpu flash kernel, where built, makes
    less); the rest of the model ``[s, b, max(V, 2 ffn, (hq + 2 g) d)]`` activations. That bound is 524K."""
    seed = int.from_bytes(os.urandom(4), "little")
    model, g = _model(seed), torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (512, 389)]
    ids, valid, pos = _left_pad(prompts, torch.device("cpu"))
    b, s = ids.shape
    with KVCache(model) as cache, LargestTensor() as largest:
        cache.valid = valid
        got = model(tokens=ids, position_ids=pos)  # [s, b, V]
    for r, p in enumerate(prompts):
        want = model(tokens=torch.tensor([p]))[:, 0, :V]  # the padded vocabulary's columns are -inf
        mine = got[s - len(p):, r, :V]
        err = ((mine - want).abs().max() / want.abs().max()).item()
        assert err < 1e-11, (r, err)
    ffn2 = 2 * model.config.ffn_hidden_size
    bound = max(HQ * s * D, HQ * max(TILE_MIN, WINDOW) ** 2, HQ * ROW_CHUNK * s, s * b * max(V, ffn2, 2 * HQ * D))
    assert bound < b * HQ * s * s
    assert largest.most <= bound, (largest.most, bound)


def _prefill(model, prompts) -> tuple[torch.Tensor, dict]:
    """The cached prefill's logits ``[s, b, V]`` of the left-padded ``prompts`` and the host syncs it made."""
    ids, valid, pos = _left_pad(prompts, torch.device("cpu"))
    with KVCache(model) as cache, OpCounter() as ops:
        cache.valid = valid
        logits = model(tokens=ids, position_ids=pos)
    return logits, ops.syncs


@torch.no_grad()
def test_left_padded_prefill_runs_the_batch_at_once_without_a_host_sync_per_row():
    """Eight prompts of random lengths (one of a single token, one of the full width) in one cached prefill.

    Values: each row's logits at its real slots against the uncached forward of that prompt alone; the same error
    analysis as above at s <= 160: 2 x (160 + 16 + 96) x 1.1e-16 ~ 6e-14 relative; bound 1e-11.

    Host syncs: the rows go through the tiles together (per-row offsets as index tensors), so the prefill of eight
    rows waits on the device as often as that of two (a loop over rows read each row's padding on the host)."""
    seed = int.from_bytes(os.urandom(4), "little")
    model, g = _model(seed), torch.Generator().manual_seed(seed)
    lengths = [1, 160] + torch.randint(2, 160, (6,), generator=g).tolist()
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in lengths]
    got, syncs8 = _prefill(model, prompts)
    s = got.shape[0]
    for r, p in enumerate(prompts):
        want = model(tokens=torch.tensor([p]))[:, 0, :V]
        err = ((got[s - len(p):, r, :V] - want).abs().max() / want.abs().max()).item()
        assert err < 1e-11, (r, len(p), err)
    assert torch.isfinite(got[:, :, :V]).all()  # padding slots' logits too: nothing non-finite reaches the cache
    _, syncs2 = _prefill(model, prompts[:2])
    assert sum(syncs8.values()) == sum(syncs2.values()), (syncs8, syncs2)


def _poisoned(model, prompts, slots: torch.Tensor | None):
    """Greedy generation of ``prompts`` (tokens, log-probs); ``slots [b, L]``: the prefill slots whose embeddings
    are replaced by noise of size 1e3, so every layer's keys and values there are garbage (None: none)."""
    from omnitron.core.inference.generation import generate_batch

    def hook(module, args, out):  # [s, b, h]; decoding steps hold one slot
        if slots is not None and out.shape[0] == slots.shape[1]:
            return torch.where(slots.T[:, :, None], 1e3 * torch.randn_like(out), out)
        return out

    handle = model.embedding.register_forward_hook(hook)
    try:
        out = generate_batch(model, prompts, 6, return_log_probs=True)
    finally:
        handle.remove()
    return out.tokens, out.log_probs


@torch.no_grad()
def test_padding_is_never_attended():
    """Left-padded prompts (1 to 70 tokens) generate bit for bit the same tokens and log-probs whatever the padding
    slots hold: their keys get exactly zero weight on both prefill paths (the masked softmax of a model without a
    window or sinks, the rotated tiles of one with them) and in every decoding step. The control: the same noise
    on one real slot (the first of the last row) changes that row's log-probs."""
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    plain = GPTModel(llama_tiny(num_layers=2, hidden_size=HQ * D, num_attention_heads=HQ, num_query_groups=2,
                                ffn_hidden_size=96, vocab_size=V, seq_length=128, params_dtype=torch.float64),
                     ParallelGroups.single(), backend=get_backend("cpu"), seed=seed).eval()
    for model in (plain, _model(seed)):
        prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (1, 9, 33, 70)]
        _, valid, _ = _left_pad(prompts, torch.device("cpu"))
        clean = _poisoned(model, prompts, None)
        assert _poisoned(model, prompts, ~valid) == clean
        one_real = torch.zeros_like(valid)
        one_real[-1, 0] = True  # the last row is the longest: no padding, slot 0 is its first token
        assert _poisoned(model, prompts, one_real)[1][-1] != clean[1][-1]
