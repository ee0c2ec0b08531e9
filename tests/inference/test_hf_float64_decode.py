"""Every decoding step's logits against ``transformers`` in float64, its float32 steps made float64.

Tiny random Llama (GQA), DeepSeek-V3 (multi-latent attention, all layers dense so that no router runs: transformers
routes in float32) and gpt-oss (attention sinks, a 4-key window on alternate layers, 4 experts routed in float64 on
both sides) models are saved with ``save_pretrained``, imported with ``import_hf`` and loaded for serving in float64.
transformers computes two steps in float32 whatever the model's dtype: its RMSNorms normalise in float32, and its
RoPE forms position x inv_freq in float32 and takes cos/sin in float32. The reference here replaces both: the norm in
float64, and the angles formed as omnitron and Megatron form them (float32 inverse frequencies, the float64 formula
rounded, times float32 positions, rounded to float32; both sides' convention) with cos/sin in float64.

Checked: a left-padded batch of prompts of 3, 9, 1 and 6 tokens (the 1-token row: a padded query sees only
itself) greedily decoded 10 steps, each step's logits against transformers' forward of that row's whole sequence
(no cache); the prompt log-probs of the padded prefill; and multi-token steps after the prefill (3, 1, 2, 4 new
tokens) through the KV cache's validity mask. DeepSeek-V3 runs with the absorbed attention automatic (single-token
steps), forced on every cached step, and off (expanded latents). The prompts reach past gpt-oss's window.

Error analysis: both sides are float64 (u = 1.1e-16) and differ only in summation order: sums of at most 64 terms
(hidden 32, ffn 48, 19 positions) per GEMM, a few GEMMs per layer and two layers: ~sqrt(64) x 10 x 2 = 160 u
relative to the logits' scale, ~2e-14; softmax and the norms' rsqrt add a few u each. Bound 1e-12 relative to the
largest logit of the row (observed <= 7e-15). A float32 step anywhere (a float32 rope: 7e-7, a float32 norm
statistic: 1e-7) or a slot of the wrong row, position or window is 10^5 times over.
"""
from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from omnitron.core.checkpoint.hf import import_hf  # noqa: E402
from omnitron.core.checkpoint.reshard import Layout  # noqa: E402
from omnitron.core.inference.generation import generate_batch  # noqa: E402
from omnitron.core.inference.kv_cache import KVCache  # noqa: E402
from omnitron.core.inference.loader import load_for_inference  # noqa: E402

V = 96
TOL = 1e-12
LENGTHS = (3, 9, 1, 6)
STEPS = 10
CHUNKS = (3, 1, 2, 4)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=8, q_lora_rank=12, qk_rope_head_dim=4, v_head_dim=6, qk_nope_head_dim=6,
        first_k_dense_replace=2, num_hidden_layers=2, max_position_embeddings=64, tie_word_embeddings=False,
        num_nextn_predict_layers=0),
    "gpt_oss": lambda: transformers.GptOssConfig(
        vocab_size=V, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        tie_word_embeddings=False),
}


def _float64_norms(hf) -> None:
    for mod in hf.modules():
        if type(mod).__name__.endswith("RMSNorm"):
            mod.forward = lambda x, mod=mod: mod.weight * (
                x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + mod.variance_epsilon))


def _float64_rope(hf) -> None:
    rot = hf.model.rotary_emb
    theta, dim = hf.config.rope_parameters["rope_theta"], 2 * rot.inv_freq.numel()
    inv = (1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)).float()
    assert rot.attention_scaling == 1.0
    torch.testing.assert_close(inv, rot.inv_freq.float(), rtol=2.4e-7, atol=0)  # transformers' own, to 2 ulp
    width = rot(torch.zeros(1, dtype=torch.float64), torch.zeros(1, 1, dtype=torch.long))[0].shape[-1]

    def forward(x, position_ids):
        angles = (position_ids[..., None].float() * inv).double()
        angles = angles if width == angles.shape[-1] else torch.cat((angles, angles), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    rot.forward = forward


def _models(kind: str, tmp_path, backend):
    """(transformers' float64 model with the float64 norm and RoPE, omnitron's import of it served in float64)."""
    hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind](), dtype=torch.float64,
                                                       experts_implementation="eager").eval()
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    with torch.no_grad():  # std 0.3: logits of O(1-10), norms' weights around 1
        for n, p in hf.named_parameters():
            p.copy_((1.0 if "norm" in n and p.ndim == 1 else 0.0) + 0.3 * torch.randn(p.shape, generator=g,
                                                                                      dtype=torch.float64))
    hf.save_pretrained(tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "omni"), Layout())
    _float64_norms(hf)
    _float64_rope(hf)
    return hf, load_for_inference(str(tmp_path / "omni"), backend, dtype=torch.float64).model


def _hf_logits(hf, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([seq])).logits[0].double()


def _assert_close(got: torch.Tensor, want: torch.Tensor, label) -> None:
    err = float((got.cpu().double()[:V] - want).abs().max() / want.abs().max())
    assert err < TOL, (label, err)


def _absorb(model, absorb) -> None:
    for layer in model.decoder.layers.values():
        if hasattr(layer.self_attention, "absorb"):
            layer.self_attention.absorb = absorb


def _decoding_matches(hf, model, prompts, label) -> None:
    steps = []

    def forward(ids, pos, last):
        out = model(tokens=ids, position_ids=pos, last_position_only=last)
        steps.append(out[-1])
        return out

    gen = generate_batch(model, prompts, STEPS, forward=forward)
    for i, p in enumerate(prompts):
        assert len(gen.tokens[i]) == STEPS
        want = _hf_logits(hf, p + gen.tokens[i][:-1])
        for k in range(STEPS):
            _assert_close(steps[k][i], want[len(p) - 1 + k], (label, "row", i, "step", k))
    lps = generate_batch(model, prompts, 1, return_log_probs=True).log_probs  # the prompt's, then one more
    for i, p in enumerate(prompts):
        want = _hf_logits(hf, p + gen.tokens[i][:1]).log_softmax(-1)[:-1]
        want = want.gather(1, torch.tensor(p[1:] + gen.tokens[i][:1])[:, None])[:, 0]
        got = torch.tensor(lps[i], dtype=torch.float64)
        assert got.shape == want.shape and float((got - want).abs().max()) < TOL, (label, "row", i, got - want)


def _chunked_steps_match(hf, model, prompts, label, masked: bool = True) -> None:
    """Prefill, then steps of CHUNKS new tokens through the cache's validity mask (``KVCache.valid``; ``masked``
    False: no mask, the prompts of one length, as a speculative step or a chunked prefill of an unpadded batch)."""
    rng = random.Random()
    rows = [p + [rng.randrange(V) for _ in range(sum(CHUNKS))] for p in prompts]
    width = max(len(p) for p in prompts)
    pad = torch.tensor([width - len(p) for p in prompts])[:, None]
    slots = torch.arange(width + sum(CHUNKS))[None]
    ids = torch.zeros(len(rows), slots.shape[1], dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, int(pad[i]):] = torch.tensor(r)
    device = next(model.parameters()).device
    valid, pos = (slots >= pad).to(device), (slots - pad).clamp(min=0).to(device)
    ids = ids.to(device)
    wants = [_hf_logits(hf, r) for r in rows]
    start = 0
    with torch.no_grad(), KVCache(model) as cache:
        for n in (width, *CHUNKS):
            cache.valid = valid[:, :start + n] if masked else None
            out = model(tokens=ids[:, start:start + n], position_ids=pos[:, start:start + n])  # [n, b, V]
            for i in range(len(rows)):
                for j in range(max(start, int(pad[i])), start + n):  # this step's real query slots
                    _assert_close(out[j - start, i], wants[i][j - int(pad[i])], (label, "row", i, "slot", j))
            start += n


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_decoding_logits_equal_transformers_in_float64(kind, tmp_path, backend):
    hf, model = _models(kind, tmp_path, backend)
    rng = random.Random()
    prompts = [[rng.randrange(V) for _ in range(n)] for n in LENGTHS]
    for absorb in (None, True, False) if kind == "deepseek_v3" else (None,):
        _absorb(model, absorb)
        _decoding_matches(hf, model, prompts, (kind, absorb))
        _chunked_steps_match(hf, model, prompts, (kind, absorb))


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_multi_token_steps_without_padding_equal_transformers(kind, tmp_path, backend):
    """Steps of several new tokens after the prefill with no validity mask (``KVCache.valid`` None, an unpadded
    batch): each new query attends to the slots up to its own (before, the plain attention refused the step,
    "need a validity mask"; the fused kernel's own causal flag would align the mask top-left). TOL's analysis."""
    hf, model = _models(kind, tmp_path, backend)
    rng = random.Random()
    n = rng.randint(1, 9)
    prompts = [[rng.randrange(V) for _ in range(n)] for _ in range(3)]
    _chunked_steps_match(hf, model, prompts, (kind, "unpadded", n), masked=False)


def _tp2_rank(root: str, prompts: list[list[int]]):
    """This tp2 rank's greedy tokens and log-probs (prompt's then generated) of the float64 checkpoint at ``root``."""
    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.inference.loader import load_sharded
    from omnitron.core.parallel.groups import ParallelGroups

    torch.set_num_threads(1)
    be = get_backend()
    groups = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=2), backend=be)
    loaded = load_sharded(root, groups, be, dtype=torch.float64)
    out = generate_batch(loaded.model, prompts, STEPS, return_log_probs=True, **loaded.sharded.generate_kwargs())
    return out.tokens, out.log_probs


@pytest.mark.slow  # 31 s on cpu, 13 s under sim (loaded 2-core machine): two ranks load and decode
def test_tp2_log_probs_equal_transformers_in_float64(tmp_path, backend, backend_name):
    """MLA at tp2 (heads split, latents replicated; the vocabulary-parallel logits gathered on the last stage):
    every rank's greedy tokens agree, and the log-prob of every prompt and generated token equals transformers'
    forward of the whole sequence (TOL's analysis; seen 4e-15)."""
    from omnitron.testing.distributed import run_distributed

    hf, _ = _models("deepseek_v3", tmp_path, backend)
    rng = random.Random()
    prompts = [[rng.randrange(V) for _ in range(n)] for n in LENGTHS]
    ranks = run_distributed(_tp2_rank, 2, str(tmp_path / "omni"), prompts, backend=backend_name)
    for tokens, log_probs in ranks:
        assert tokens == ranks[0][0]
        for p, toks, lps in zip(prompts, tokens, log_probs, strict=True):
            seq = p + toks
            want = _hf_logits(hf, seq).log_softmax(-1)[:-1].gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
            assert float((torch.tensor(lps, dtype=torch.float64) - want).abs().max()) < TOL
