"""T5 and LLaVA generation (cached) against full recomputation per input; loading a tp2 checkpoint."""
from __future__ import annotations

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.core.inference.families import caption, generate_t5
from omnitron.core.models.multimodal import LLaVAModel
from omnitron.core.models.multimodal.config import IMAGE_TOKEN, llava_tiny, num_image_tokens
from omnitron.core.models.t5 import T5Model
from omnitron.core.models.t5.config import t5_tiny
from omnitron.core.parallel.groups import ParallelGroups

V = 300


def sharpen(m):
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim > 1:
                p.mul_(3.0)
    return m.eval()


def tiny_t5():
    # NOTE: num_layers = encoder + decoder layers keeps clear of a layer-range check in init_single_stage
    cfg = t5_tiny(num_layers=4, encoder_num_layers=2, decoder_num_layers=2, hidden_size=64, ffn_hidden_size=128,
                  vocab_size=V, seq_length=24, decoder_seq_length=16,
                  max_position_embeddings=24, num_query_groups=2)
    return sharpen(T5Model(cfg, ParallelGroups.single(), backend=get_backend("cpu"), seed=4))


def tiny_llava():
    cfg = llava_tiny(hidden_size=32, ffn_hidden_size=64, vocab_size=V, img_h=16, img_w=16, patch_dim=8,
                     vision_hidden_size=32, seq_length=24, max_position_embeddings=24)
    return sharpen(LLaVAModel(cfg, ParallelGroups.single(), backend=get_backend("cpu"), seed=6))


def greedy_reference(logits_of, prefix, n, first_scored):
    """Greedy tokens from full recomputation ``logits_of(seq) -> [len, V]`` and log-probs of seq[first_scored:]."""
    seq = list(prefix)
    for _ in range(n):
        seq.append(int(torch.argmax(logits_of(seq)[-1])))
    lp = torch.log_softmax(logits_of(seq).float(), -1)[:-1]
    lp = lp.gather(1, torch.tensor(seq[1:]).clamp(min=0)[:, None])[:, 0]
    return seq[len(prefix):], lp[first_scored - 1:]


@torch.no_grad()
def test_t5_cached_decoding_matches_full_recompute():
    model = tiny_t5()
    sources = [torch.randint(0, V, (n,)).tolist() for n in (5, 17, 9)]
    out = generate_t5(model, sources, 7, start=2, return_log_probs=True)
    for src, toks, lps in zip(sources, out.tokens, out.log_probs):
        enc = torch.tensor([src])

        def logits_of(dec, enc=enc):
            return model(enc, torch.tensor([dec]), torch.zeros_like(enc))[:, 0]

        ref, ref_lp = greedy_reference(logits_of, [2], 7, 1)
        assert toks == ref
        torch.testing.assert_close(torch.tensor(lps), ref_lp, atol=1e-5, rtol=0)
    assert generate_t5(model, sources, 7, start=2, use_cache=False).tokens == out.tokens
    eod = out.tokens[1][0]
    stopped = generate_t5(model, sources, 7, start=2, eod=eod).tokens
    assert stopped[1] == [eod] and all(t[:-1] == f[:len(t) - 1] for t, f in zip(stopped, out.tokens))
    with pytest.raises(ValueError, match="source 1 must hold 1 to 24"):
        generate_t5(model, [[1], []], 3, start=2)


@torch.no_grad()
def test_llava_caption_matches_full_recompute():
    model = tiny_llava()
    n = num_image_tokens(model.config)
    images = torch.rand(3, 3, 16, 16)
    prompts = [[7], [5, 9, 11], []]
    out = caption(model, images, prompts, 6, return_log_probs=True)
    for i, (p, toks, lps) in enumerate(zip(prompts, out.tokens, out.log_probs)):
        def logits_of(seq, i=i):
            return model(torch.tensor([seq]), images[i:i + 1])[:, 0]

        ref, ref_lp = greedy_reference(logits_of, [IMAGE_TOKEN] * n + p, 6, n)
        assert toks == ref
        torch.testing.assert_close(torch.tensor(lps), ref_lp, atol=1e-5, rtol=0)
    # the image matters: another image, other log-probs (its greedy tokens may still agree: a random tiny model
    # often picks the same 6 tokens for two noise images, so comparing tokens failed about one run in six)
    other = caption(model, torch.rand(3, 3, 16, 16), prompts, 6, return_log_probs=True)
    assert all(not torch.equal(torch.tensor(a[:1]), torch.tensor(b[:1])) for a, b in zip(other.log_probs,
                                                                                       out.log_probs))
    with pytest.raises(ValueError, match="images must be \\[batch, channels, height, width\\]"):
        caption(model, images[:2], prompts, 3)
