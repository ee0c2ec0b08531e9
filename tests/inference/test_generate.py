"""KV-cache generation equals re-running the whole sequence; top-k sampling stays in the top k."""
from __future__ import annotations

import torch

from omnitron.backends import get_backend
from omnitron.core.inference import SamplingParams, generate
from omnitron.core.models.gpt.presets import gpt2_tiny, llama_tiny
from omnitron.core.models.gpt.model import GPTModel
from omnitron.core.parallel.groups import ParallelGroups


def _model(cfg):
    m = GPTModel(cfg, ParallelGroups.single(), backend=get_backend("cpu"), seed=3)
    with torch.no_grad():  # sharpen the random model so greedy choices are well separated
        for p in m.parameters():
            if p.ndim > 1:
                p.mul_(4.0)
    return m


def test_cache_matches_full_recompute():
    for cfg in (gpt2_tiny(num_layers=2, hidden_size=64, vocab_size=300, seq_length=48, max_position_embeddings=48),
                llama_tiny(num_layers=2, hidden_size=64, vocab_size=300, seq_length=48)):
        model = _model(cfg)
        prompt = torch.randint(0, 300, (7,)).tolist()
        cached = generate(model, prompt, 12)
        full = generate(model, prompt, 12, use_cache=False)
        assert cached == full and len(cached) == 12
        assert all(0 <= t < 300 for t in cached)  # padding columns never chosen
        # stops at the context limit
        assert len(generate(model, prompt, 100)) == 48 - len(prompt)


def test_top_k_sampling():
    model = _model(gpt2_tiny(num_layers=1, hidden_size=64, vocab_size=300, seq_length=32, max_position_embeddings=32))
    prompt = [1, 2, 3]
    a = generate(model, prompt, 10, params=SamplingParams(top_k=5, seed=0))
    b = generate(model, prompt, 10, params=SamplingParams(top_k=5, seed=0))
    assert a == b
    model.eval()
    with torch.no_grad():
        logits = model(tokens=torch.tensor([prompt]))[-1, 0]
    assert a[0] in torch.topk(logits, 5).indices.tolist()
