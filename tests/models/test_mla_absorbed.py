"""Absorbed multi-latent attention at decode (transformer/mla_absorbed.py): the single-token steps through the
latent KV cache equal the expanded path and MLA's equations written out in float64 (test_mla._reference), greedy
generation picks the same tokens both ways, and tp2 equals one process.

Tolerance of the float32 comparisons (u = 2**-24). Both paths, and the float64 reference, compute the same
function; float32 changes only the rounding of ~7 chained contractions (query down / up, latent down, scores,
the weighted sum over the cache, W_uv, the output projection), each of length K <= K_MAX (hidden, ranks, head
dims, cache slots, heads x dv: 40 here). One contraction's error is at most K u times the sum of its terms'
magnitudes, which exceeds the result's by ~sqrt(K) for terms of random sign: K**1.5 u relative per stage. The
absorbed path sums over kv_lora_rank where the expanded one sums over the head dims (the reassociation), the
same bound. The softmax turns an absolute score error into the same relative error of the weights, so the
scores' relative error is amplified by their magnitude: relative error of the output <= 7 K**1.5 u (1 + S),
S the largest |scaled score| (read from the float64 reference). A wrong head split, a missing scale or rope part
or a slot outside the mask moves the output by O(1).
"""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.core.parallel.tensor import RNGTracker
from omnitron.testing.parity import reference_kernels
from test_mla import _config, _ref_inv_freq, _reference

K_MAX, U = 40, 2.0 ** -24


def _tol(max_score: float) -> float:
    return 7 * K_MAX ** 1.5 * U * (1 + max_score)


def _set_absorb(model, value) -> None:
    from omnitron.core.transformer.mla import MLASelfAttention

    for m in model.modules():
        if isinstance(m, MLASelfAttention):
            m.absorb = value


def _attention(gen):
    from omnitron.core.transformer.mla import MLASelfAttention

    c = _config(params_dtype=torch.float32, kv_lora_rank=16, rotary_scaling_factor=4.0, mscale_all_dim=1.0)
    be = get_backend()
    attn = MLASelfAttention(c, group=ParallelGroups.single().tp, sequence_parallel=False, tracker=RNGTracker(be),
                            backend=be, out_std=0.02).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
    return c, attn


def _decode(attn, x, freqs, absorb):
    """The last position's output after the others went through the latent cache (prefill, then one step)."""
    from omnitron.core.inference.kv_cache import KVCache

    attn.absorb = absorb
    calls = []
    hook = attn.linear_kv_up_proj.register_forward_hook(lambda *a: calls.append(1))
    one_layer = SimpleNamespace(decoder=SimpleNamespace(layers={"0": SimpleNamespace(self_attention=attn)}))
    with torch.no_grad(), KVCache(one_layer):
        attn(x[:-1], freqs[:-1])
        out, _ = attn(x[-1:], freqs[-1:])
    hook.remove()
    return out[0].detach(), len(calls)


def test_absorbed_decode_step_equals_expanded_and_equations():
    """One layer, float32: the decode step's output absorbed (automatic) and expanded against the float64
    equations, within the bound of the module docstring; the automatic step never expands the cache."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    c, attn = _attention(gen)
    s, b = 13, 2  # 12 cached slots, then one step
    x = torch.randn(s, b, c.hidden_size, generator=gen)
    ang = torch.arange(s, dtype=torch.float64)[:, None] * _ref_inv_freq(c)
    absorbed, expansions = _decode(attn, x, ang[:, None, None, :].float(), None)
    expanded, expansions_off = _decode(attn, x, ang[:, None, None, :].float(), False)
    assert (expansions, expansions_off) == (1, 2)  # the prefill expands; the step only with absorb=False
    c64 = _config(kv_lora_rank=16, rotary_scaling_factor=4.0, mscale_all_dim=1.0)
    with torch.no_grad():
        ref = _reference(c64, {k: v.double() for k, v in attn.named_parameters()}, x.double())[-1]
    max_score = _max_score(attn, x, ang[:, None, None, :])
    tol = _tol(max_score)
    for out in (absorbed, expanded):
        assert float((out.double() - ref).norm() / ref.norm()) < tol, (tol, max_score)
    assert float((absorbed - expanded).norm() / expanded.norm()) < tol


def _max_score(attn, x, freqs) -> float:
    """Largest |scaled score| of ``attn`` on ``x`` (float64 copy, every query-key pair: the bound's scale)."""
    a = copy.deepcopy(attn).double()
    a.latent_cache = None
    with torch.no_grad(), reference_kernels():
        q, k, _ = a._project(x.double(), freqs.double())
    return float(torch.einsum("sbhd,tbhd->bhst", q, k).abs().max()) * a.softmax_scale


def _model_max_score(model, tokens, pos) -> float:
    """:func:`_max_score` over every MLA layer of ``model`` on this input (inputs caught by pre-hooks)."""
    from omnitron.core.transformer.mla import MLASelfAttention

    seen, hooks = [], []
    for m in model.modules():
        if isinstance(m, MLASelfAttention):
            hooks.append(m.register_forward_pre_hook(lambda mod, args: seen.append((mod, args[0], args[1]))))
    with torch.no_grad():
        model(tokens=tokens, position_ids=pos)
    for h in hooks:
        h.remove()
    return max(_max_score(m, x, f) for m, x, f in seen)


def _model(seed: int, **kw):
    from omnitron.core.models.gpt import GPTModel

    cfg = _config(params_dtype=torch.float32, vocab_size=300, seq_length=40, kv_lora_rank=16, **kw)
    return GPTModel(cfg, ParallelGroups.single(), backend=get_backend("cpu"), seed=seed).eval()


def test_absorbed_decode_logits_equal_expanded_and_float64():
    """Whole model: the decode step's logits absorbed and expanded (float32) against the float64 model's full
    forward (test_mla: its module equals the equations to 1e-11). The logits are a further contraction over
    the hidden size (32 < K_MAX) of the attention outputs through residual blocks of O(1) gain: the same bound
    with two more stages (9), S the largest over the layers."""
    model = _model(seed=torch.seed() % 2**31)
    tokens = torch.randint(0, 300, (2, 11))
    pos = torch.arange(11).expand(2, 11)
    from omnitron.core.inference.kv_cache import KVCache

    logits = {}
    for absorb in (None, False):
        _set_absorb(model, absorb)
        with torch.no_grad(), KVCache(model):
            model(tokens=tokens[:, :10], position_ids=pos[:, :10])
            logits[absorb] = model(tokens=tokens[:, 10:], position_ids=pos[:, 10:])[0]
    ref64 = copy.deepcopy(model).double()
    with torch.no_grad(), reference_kernels():
        ref = ref64(tokens=tokens, position_ids=pos)[-1]
    tol = 9 * K_MAX ** 1.5 * U * (1 + _model_max_score(model, tokens, pos))
    for got in logits.values():
        assert float((got.double() - ref).norm() / ref.norm()) < tol
    assert float((logits[None] - logits[False]).norm() / logits[False].norm()) < tol


def test_greedy_tokens_absorbed_equal_expanded():
    """16 greedy tokens for two prompts of different lengths (left padding: the cache's validity mask): the same
    tokens absorbed and expanded (sharpened weights: a top-2 gap under the float32
    bound above is improbable, a wrong mask or slot changes tokens)."""
    from omnitron.core.inference.generation import generate_batch

    model = _model(seed=3, rotary_scaling_factor=40.0, mscale_all_dim=1.0)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.mul_(4.0)
    prompts = [torch.randint(0, 300, (n,)).tolist() for n in (6, 3)]
    runs = {}
    for absorb in (None, False):
        _set_absorb(model, absorb)
        runs[absorb] = generate_batch(model, prompts, 16).tokens
    assert runs[None] == runs[False]
    assert [len(t) for t in runs[None]] == [16, 16]


def test_forced_absorb_covers_the_prefill_and_refuses_where_it_cannot_apply():
    """absorb=True: the prefill through the cache runs absorbed too (causal mask over the new slots), equal to the
    expanded prefill within the bound; under sequence parallelism it is refused with a one-line reason."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    c, attn = _attention(gen)
    x = torch.randn(9, 2, c.hidden_size, generator=gen)
    freqs = (torch.arange(9, dtype=torch.float64)[:, None] * _ref_inv_freq(c))[:, None, None, :].float()
    from omnitron.core.inference.kv_cache import KVCache

    outs = {}
    one_layer = SimpleNamespace(decoder=SimpleNamespace(layers={"0": SimpleNamespace(self_attention=attn)}))
    for absorb in (True, False):
        attn.absorb = absorb
        with torch.no_grad(), KVCache(one_layer):
            outs[absorb] = attn(x, freqs)[0]
    # every position is a decode step's function of its prefix: the bound of the module docstring
    assert float((outs[True] - outs[False]).norm() / outs[False].norm()) < _tol(_max_score(attn, x, freqs))
    attn.sp, attn.absorb = True, True
    with torch.no_grad(), KVCache(one_layer), pytest.raises(ValueError, match="sequence or context parallelism"):
        attn(x, freqs)


def _tp_logits(tp: int) -> dict:
    """The decode step's logits (absorbed and expanded) of the float64 model at ``tp`` and in one process."""
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.inference.kv_cache import KVCache
    from omnitron.core.models.gpt import GPTModel
    from omnitron.core.parallel.tensor.mappings import gather_last
    from omnitron.core.parallel.tensor.sharding import to_device

    torch.set_num_threads(1)
    be = get_backend()
    groups = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=tp), backend=be)
    cfg = _config(vocab_size=96, rotary_scaling_factor=4.0, mscale_all_dim=1.0)
    tokens = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(9).expand(2, 9)
    out = {}
    for name, g in (("tp", groups), ("one", ParallelGroups.single())):
        dev = g.backend.device() if name == "tp" else torch.device("cpu")
        model = to_device(GPTModel(cfg, g, seed=11), dev).eval()
        for absorb in (None, False):
            _set_absorb(model, absorb)
            with torch.no_grad(), KVCache(model):
                model(tokens=tokens[:, :8].to(dev), position_ids=pos[:, :8].to(dev))
                lg = model(tokens=tokens[:, 8:].to(dev), position_ids=pos[:, 8:].to(dev))
            out[(name, absorb)] = (gather_last(lg, g.tp) if name == "tp" else lg)[..., : cfg.vocab_size].cpu()
    return out


def test_absorbed_decode_tp2_equals_one_process():
    """tp2 (heads split, the latent replicated): the absorbed step's logits equal one process's, float64 with the
    reference kernels (test_mla's parity bound: only sum orders differ, ~1e-15 relative; 1e-12)."""
    from omnitron.testing.distributed import REFERENCE_KERNELS, run_distributed

    for out in run_distributed(_tp_logits, 2, 2, env=REFERENCE_KERNELS):
        ref = out[("one", False)]
        for key in (("tp", None), ("tp", False), ("one", None)):
            assert float((out[key] - ref).norm() / ref.norm()) < 1e-12, key
