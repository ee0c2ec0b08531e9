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


def test_prompts_near_the_context_get_the_room_left_and_a_line_saying_so():
    """A batch whose prompts leave the context room for fewer tokens than asked: each row gets exactly the room
    left (a float64 full-recompute greedy loop, prompt alone, is the reference for the tokens), and the result's
    one line names those prompts and their room, none of the others (before: fewer tokens, no word)."""
    from omnitron.core.inference import generate_batch

    limit, want = 24, 6
    model = _model(gpt2_tiny(num_layers=1, hidden_size=64, vocab_size=300, seq_length=limit,
                             max_position_embeddings=limit)).double().eval()
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    lengths = [limit - want - 3, limit - 2, limit - want, limit - 5, limit, limit - want + 1]
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in lengths]
    out = generate_batch(model, prompts, want)
    for p, got in zip(prompts, out.tokens):
        ref = list(p)
        with torch.no_grad():
            while len(ref) < min(len(p) + want, limit):  # the reference: stop when the context is full
                ref.append(int(model(tokens=torch.tensor([ref]))[-1, 0].argmax()))
        assert got == ref[len(p):], (len(p), got, ref[len(p):])
    short = [i for i, n in enumerate(lengths) if limit - n < want]
    assert short == [1, 3, 4, 5]
    note = out.note
    assert note.startswith(f"the model's context is {limit} positions (--max-position-embeddings): ")
    assert "\n" not in note
    for i in range(len(lengths)):
        said = f"prompt {i} takes {lengths[i]} of them, leaving room for {limit - lengths[i]}"
        assert (said in note) == (i in short[:3]), (i, note)  # the first three named, the rest counted
    assert "(and 1 more prompts)" in note and note.endswith(f"of the {want} new tokens asked; generating that many "
                                                            "(shorten the prompt or ask for fewer tokens)")
    assert generate_batch(model, [prompts[0]], want).note is None  # room enough: no line
