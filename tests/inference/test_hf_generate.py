"""``omnitron generate`` on Hugging Face models against ``transformers``' own ``generate``.

Tiny random-weight Llama, Qwen2 and GPT-2 models (float32) are saved with ``save_pretrained`` beside a Llama-style
tokenizer (its post-processor puts ``<s>`` before every text; ``</s>`` is the eos) and imported with ``import_hf``.
Greedy text generation for a batch of prompts of different lengths (one left-padded batch in omnitron) must give
the tokens transformers gives for ``tokenizer(prompt).input_ids`` alone: the prompt with the tokenizer's BOS (as
Megatron's HuggingFaceTokenizer also encodes it), then the same greedy continuation, stopping at the eos.

Error analysis for comparing argmaxes: both sides compute the same float32 network in different orders; their
log-probs differ by about 1e-5 here (measured up to 1e-5 on these sizes), so a step whose two likeliest logits are
closer than ``GAP`` = 1e-3 could legitimately pick either. The comparison stops at the first such step of the
reference (the rest is then conditioned on a coin toss), and at least 8 steps must be compared.

A Qwen2 with a sliding window on two of its three layers, in float64, checks the window layers' ring-buffer cache
the same way over prompts longer than the window and generation that wraps the rings, with log-probs too
(``WINDOW_TOL``'s error analysis is beside it).
"""
from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from omnitron.core.checkpoint.hf import import_hf  # noqa: E402
from omnitron.core.checkpoint.reshard import Layout  # noqa: E402
from omnitron.core.inference.generation import generate_batch  # noqa: E402
from omnitron.core.inference.loader import load_for_inference  # noqa: E402
from omnitron.core.inference.sampling import GREEDY  # noqa: E402
from omnitron.core.inference.text import complete  # noqa: E402
from omnitron.testing.data import llama_style_tokenizer  # noqa: E402

GAP = 1e-3
NEW = 24
WINDOW = 4
WORDS = ["Call", "me", "Ishmael.", "The", "whale", "sea", "naïve", "🐋", "of", "ship"]


def _config(kind: str, vocab: int, bos: int, eos: int | None):
    common = dict(vocab_size=vocab, bos_token_id=bos, eos_token_id=eos)
    if kind == "qwen2_window":  # layer 0 attends fully, layers 1 and 2 see the last WINDOW keys (themselves too)
        return transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=True,
                                        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **common)
    if kind == "gpt2":
        return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **common)
    cls = transformers.LlamaConfig if kind == "llama" else transformers.Qwen2Config
    return cls(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64, tie_word_embeddings=kind == "qwen2", **common)


def _hf_model(kind: str, tmp_path, tok, dtype=torch.float32, eos: int | None = -1) -> str:
    """A random ``kind`` model saved beside ``tok`` (``eos``: the config's, default the tokenizer's; None: none)."""
    torch.manual_seed(random.randrange(1 << 30))
    eos = tok.eos_token_id if eos == -1 else eos
    model = transformers.AutoModelForCausalLM.from_config(_config(kind, len(tok), tok.bos_token_id, eos)).to(dtype)
    with torch.no_grad():  # matrices wide enough apart that greedy steps are well separated; norms, biases perturbed
        for p in model.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    hf_dir = tmp_path / f"hf_{kind}"
    model.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    return str(hf_dir)


def _reference(model, ids: list[int], eos: int) -> list[int]:
    """transformers' greedy continuation of ``ids`` (ending at ``eos``), cut at the first step whose top-2 logits
    are within GAP."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                         pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    for step, logits in enumerate(out.logits):
        top = torch.topk(logits[0].double(), 2).values
        if top[0] - top[1] < GAP:
            return tokens[:step]
    return tokens


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_greedy_text_generation_equals_transformers(tmp_path, kind, backend):
    tok = transformers.AutoTokenizer.from_pretrained(llama_style_tokenizer(tmp_path / "tok"))
    hf_dir = _hf_model(kind, tmp_path, tok)
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    import_hf(hf_dir, str(tmp_path / "omni"), Layout())
    loaded = load_for_inference(str(tmp_path / "omni"), backend)
    rng = random.Random()
    prompts = [" ".join(rng.choice(WORDS) for _ in range(n)) for n in (1, 4, 11)]
    encoded = [loaded.tokenizer.encode(p) for p in prompts]
    out = generate_batch(loaded.model, encoded, NEW, eod=loaded.tokenizer.eod)
    texts = complete(loaded, prompts, NEW, params=GREEDY)["text"]
    compared = 0
    for i, prompt in enumerate(prompts):
        ids = tok(prompt).input_ids
        assert ids[0] == tok.bos_token_id and encoded[i] == ids, "the prompt is not encoded as transformers does"
        want, got = _reference(reference, ids, tok.eos_token_id), out.tokens[i]
        assert got[:len(want)] == want
        compared += len(want)
        if len(want) == NEW or (want and want[-1] == tok.eos_token_id):
            assert got == want  # stopped at the eos or after NEW tokens
        shown = ids + [t for t in got if t != tok.eos_token_id]
        assert texts[i] == tok.decode(shown, skip_special_tokens=False)  # the command's text: those tokens
    assert compared >= 8, "too few well-separated greedy steps to compare; rerun"
    # a stop token the model does produce: the longest prompt's 4th greedy token, as the eos of both sides
    stop = out.tokens[-1][3]
    stopped = generate_batch(loaded.model, encoded, NEW, eod=stop)
    for ids, got in zip(encoded, stopped.tokens):
        want = _reference(reference, ids, stop)
        assert got[:len(want)] == want and (stop not in want or got == want)
    assert stopped.tokens[-1][-1] == stop and len(stopped.tokens[-1]) <= 4


# Error analysis of the window case's log-prob bound: every weight and activation is float64 on both sides except
# transformers' float32 parts, RoPE (Qwen2RotaryEmbedding forms position x inv_freq in float32: an angle error up
# to p u at position p <= 40, u = 2^-24, so 2.4e-6 rad) and RMSNorm (Qwen2RMSNorm normalises in float32: 6e-8
# relative on each norm's output). Those move an attention score of size O(5) by ~1e-5 at worst, a softmax weight
# by as much, and through three layers and the unembedding (gain ~3) a log-prob by ~3e-5 at worst (seen <= 5e-6).
# Bound 1e-4; a window one key wider, or none, moves the log-probs by O(0.1).
WINDOW_TOL = 1e-4


def _hf_log_probs(model, seq: list[int]) -> torch.Tensor:
    """``log p(seq[i + 1] | seq[:i + 1])`` of transformers' forward of the whole sequence (no cache)."""
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0].double()
    return logits[:-1].log_softmax(-1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]


def test_sliding_window_generation_equals_transformers(tmp_path, backend):
    """A Qwen2 whose last two of three layers see a window of 4 keys, in float64, imported and served through the
    ring buffer (kv_cache.RingBuffer): prompts longer and shorter than the window in one left-padded batch, 24 new
    tokens (the rings wrap 6+ times), give transformers' greedy tokens (its own sliding cache) and the log-probs of
    its forward of the whole sequence, and the window changes those log-probs."""
    tok = transformers.AutoTokenizer.from_pretrained(llama_style_tokenizer(tmp_path / "tok"))
    hf_dir = _hf_model("qwen2_window", tmp_path, tok, torch.float64, eos=None)  # no eos: every row runs NEW steps
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64).eval()
    import_hf(hf_dir, str(tmp_path / "omni"), Layout())
    loaded = load_for_inference(str(tmp_path / "omni"), backend, dtype=torch.float64)
    assert [getattr(layer.self_attention, "window", None) for layer in loaded.model.decoder.layers.values()] == [
        None, (WINDOW - 1, 0), (WINDOW - 1, 0)]
    rng = random.Random()
    prompts = [[tok.bos_token_id] + [rng.randrange(3, len(tok)) for _ in range(n)] for n in (13, 6, 2)]
    out = generate_batch(loaded.model, prompts, NEW, return_log_probs=True)
    unwindowed = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **{**reference.config.to_dict(), "use_sliding_window": False, "layer_types": None})).double().eval()
    unwindowed.load_state_dict(reference.state_dict())
    compared, moved = 0, 0.0
    for ids, got, got_lp in zip(prompts, out.tokens, out.log_probs):
        want = _reference(reference, ids, None)
        assert len(got) == NEW and got[:len(want)] == want
        compared += len(want)
        seq = ids + got
        torch.testing.assert_close(torch.tensor(got_lp, dtype=torch.float64), _hf_log_probs(reference, seq),
                                   atol=WINDOW_TOL, rtol=0)
        moved = max(moved, (_hf_log_probs(unwindowed, seq) - torch.tensor(got_lp)).abs().max().item())
    assert compared >= NEW, "too few well-separated greedy steps to compare; rerun"  # log-probs: every step
    assert moved > 100 * WINDOW_TOL  # the window matters to these sequences
