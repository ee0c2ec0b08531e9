"""Multi-latent attention (transformer/mla.py): one process against its equations written out here in
float64 (YaRN included), tp2 / sequence-parallel parity with one process, and a short training run through
the CLI flags where the loss falls."""
from __future__ import annotations

import math

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.core.config.parallel import ConfigError, ParallelConfig
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.core.parallel.tensor import RNGTracker
from omnitron.testing.parity import reference_kernels

# float64 throughout; the module and the reference differ only in the order of sums (n <= 64 terms per
# dot product, a few chained GEMMs and a softmax of condition ~1): relative errors ~ sqrt(n) u * depth ~ 1e-14.
# A misplaced head split, rope channel or scale moves the output by O(1).
TOL = 1e-11


def _config(**kw):
    from omnitron.core.models.gpt import GPTConfig

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=97,
                make_vocab_size_divisible_by=1, hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm",
                swiglu=True, add_bias_linear=False, untie_embeddings_and_output_weights=True,
                position_embedding_type="rope", multi_latent_attention=True, q_lora_rank=12, kv_lora_rank=10,
                qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=5, qk_layernorm=True, params_dtype=torch.float64)
    base.update(kw)
    return GPTConfig(**base)


def _ref_inv_freq(c) -> torch.Tensor:
    """YaRN inverse frequencies written from the paper / Megatron's YarnRotaryEmbedding."""
    d, base, s = c.qk_pos_emb_head_dim, c.rotary_base, c.rotary_scaling_factor
    extra = torch.tensor([base ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    if s == 1.0:
        return extra
    orig = c.yarn_original_max_position_embeddings or 4096

    def dim_of(rot):
        return d * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = max(math.floor(dim_of(32.0)), 0), min(math.ceil(dim_of(1.0)), d - 1)
    out = []
    for i in range(d // 2):
        ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)  # 0: keep plain RoPE (fast channels), 1: interpolate
        out.append(extra[i] * (1 - ramp) + extra[i] / s * ramp)
    return torch.stack(out)


def _m(scale: float, a: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * a * math.log(scale) + 1.0


def _rms(x, w, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rot(t: torch.Tensor, ang: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (2i, 2i+1) of ``t [s, d]`` by ``ang [s, d/2]``."""
    x1, x2 = t[:, 0::2], t[:, 1::2]
    out = torch.empty_like(t)
    out[:, 0::2] = x1 * ang.cos() - x2 * ang.sin()
    out[:, 1::2] = x2 * ang.cos() + x1 * ang.sin()
    return out


def _reference(c, P: dict, x: torch.Tensor) -> torch.Tensor:
    """The MLA equations per batch row and head: ``x [s, b, h] -> [s, b, h]``."""
    s, b, _ = x.shape
    n, dn, dr, dv = c.num_attention_heads, c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim
    ang = torch.arange(s, dtype=torch.float64)[:, None] * _ref_inv_freq(c)[None, :]  # [s, dr/2]
    f = _m(c.rotary_scaling_factor, c.mscale) / _m(c.rotary_scaling_factor, c.mscale_all_dim)
    scale = _m(c.rotary_scaling_factor, c.mscale_all_dim) ** 2 / math.sqrt(dn + dr)
    eps, out = c.layernorm_epsilon, torch.zeros_like(x)
    for j in range(b):
        xj = x[:, j]
        if c.q_lora_rank is None:
            q = xj @ P["linear_q_proj.weight"].T
        else:
            cq = xj @ P["linear_q_down_proj.weight"].T
            if c.qk_layernorm:
                cq = _rms(cq, P["q_layernorm.weight"], eps)
            q = cq @ P["linear_q_up_proj.weight"].T
        ckv_kr = xj @ P["linear_kv_down_proj.weight"].T
        ckv, kr = ckv_kr[:, : c.kv_lora_rank], ckv_kr[:, c.kv_lora_rank:]
        if c.qk_layernorm:
            ckv = _rms(ckv, P["kv_layernorm.weight"], eps)
        kv = (ckv @ P["linear_kv_up_proj.weight"].T).view(s, n, dn + dv)
        q = q.view(s, n, dn + dr)
        k_rope = _rot(kr, ang) * f  # one rotated key part for every head
        heads = []
        for i in range(n):
            qi = torch.cat([q[:, i, :dn], _rot(q[:, i, dn:], ang) * f], -1)
            ki = torch.cat([kv[:, i, :dn], k_rope], -1)
            scores = (qi @ ki.T) * scale + torch.triu(torch.full((s, s), float("-inf"), dtype=x.dtype), 1)
            heads.append(torch.softmax(scores, -1) @ kv[:, i, dn:])
        out[:, j] = torch.cat(heads, -1) @ P["linear_proj.weight"].T
    return out


@pytest.mark.parametrize("variant", [
    dict(),
    dict(q_lora_rank=None, qk_layernorm=False),
    # YaRN with a ramp over channels 2..6 (default original context 4096) and 0..3 (64) of the 8 rotated pairs
    dict(rotary_scaling_factor=40.0, mscale=1.0, mscale_all_dim=1.0, qk_pos_emb_head_dim=16),
    dict(rotary_scaling_factor=8.0, mscale=0.707, mscale_all_dim=0.3, qk_pos_emb_head_dim=16,
         yarn_original_max_position_embeddings=64),
])
def test_mla_matches_its_equations_in_float64(variant):
    from omnitron.core.models.gpt.config import rope_inv_freq
    from omnitron.core.transformer.mla import MLASelfAttention

    c = _config(**variant)
    be, single = get_backend(), ParallelGroups.single()
    attn = MLASelfAttention(c, group=single.tp, sequence_parallel=False, tracker=RNGTracker(be), backend=be,
                            out_std=0.02)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
    s, b = 9, 2
    x = torch.randn(s, b, c.hidden_size, generator=gen, dtype=torch.float64)
    # the model stores the inverse frequencies in float32 (checked to float32's precision below); the
    # float64 comparison of the attention rotates by the reference's float64 angles
    freqs = (torch.arange(s, dtype=torch.float64)[:, None] * _ref_inv_freq(c))[:, None, None, :]
    with torch.no_grad(), reference_kernels():  # the fused CPU rope and norms compute in float32
        out, bias = attn(x, freqs)
        ref = _reference(c, dict(attn.named_parameters()), x)
    assert bias is None
    assert float((out - ref).norm() / ref.norm()) < TOL
    torch.testing.assert_close(rope_inv_freq(c).double(), _ref_inv_freq(c), rtol=2 ** -23, atol=0)


def test_mla_parameter_count_and_refusals():
    from omnitron.core.models.gpt import GPTModel, num_parameters
    from omnitron.core.models.gpt.config import validate_model

    for kw in (dict(), dict(q_lora_rank=None, qk_layernorm=False, add_bias_linear=True,
                            normalization="LayerNorm")):
        c = _config(**kw)
        model = GPTModel(c, ParallelGroups.single())
        assert sum(p.numel() for p in model.parameters()) == num_parameters(c)
    bad = ((dict(num_query_groups=2), "--num-query-groups"), (dict(qk_pos_emb_head_dim=3), "even"),
           (dict(rotary_percent=0.5), "--rotary-percent"), (dict(rotary_interleaved=True), "--rotary-interleaved"))
    for kw, word in bad:
        with pytest.raises(ConfigError, match=word):
            validate_model(_config(**kw), ParallelConfig())
    validate_model(_config(), ParallelConfig(context_parallel_size=2))  # runs under cp (test_cp_variants.py)


def _parity(tp: int) -> dict:
    """Max relative errors of an MLA GPT at tp (with and without sequence parallelism) against one process."""
    import sys

    sys.path.insert(0, "tests/parallel")
    from test_tensor_parity import _run_case

    torch.set_num_threads(1)
    be, single, out = get_backend(), ParallelGroups.single(), {}
    for sp in (False, True):
        groups = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp), backend=be)
        for name, kw in (("lora", dict()), ("no_q_lora", dict(q_lora_rank=None, qk_layernorm=False)),
                         ("yarn_selective", dict(rotary_scaling_factor=40.0, mscale_all_dim=1.0,
                                                 recompute_granularity="selective"))):
            out[(name, sp)] = _run_case(_config(**kw), groups, single)
    return out


def test_mla_tensor_parallel_parity_tp2():
    """Initial weights, logits, per-token losses, every gradient and 5 AdamW steps at tp2 (+sp) equal the
    one-process model (test_tensor_parity.TOL and its error analysis: only sum orders differ)."""
    from omnitron.testing.distributed import REFERENCE_KERNELS, run_distributed

    for results in run_distributed(_parity, 2, 2, env=REFERENCE_KERNELS):
        for key, err in results.items():
            assert err["init"] == 0.0 and err["loss_moved"] == 1.0, (key, err)
            for metric in ("logits", "token_loss", "grads", "step_losses"):
                assert err[metric] < 1e-12, (key, metric, err)


def test_mla_trains_through_the_cli(tmp_path):
    """`omnitron train` with Megatron's MLA flags (tiny sizes): the loss falls over a few steps."""
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    # the bundled Moby Dick corpus (real text; mock tokens are uniform, so no loss could fall below ln V)
    args = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", "omnitron/data/moby_dick_bpe/tokenizer.json",
            "--split", "969,30,1", "--num-workers", "0", "--micro-batch-size", "4", "--global-batch-size", "4",
            "--train-iters", "10", "--lr", "2e-2", "--lr-warmup-iters", "0", "--lr-decay-style", "constant",
            "--log-interval", "100", "--no-tensorboard", "--eval-interval", "0", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--log-dir", str(tmp_path), "--normalization", "RMSNorm", "--swiglu",
            "--position-embedding-type", "rope", "--qk-layernorm", "--disable-bias-linear",
            "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "8", "--qk-head-dim", "8",
            "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--rotary-scaling-factor", "4", "--mscale", "1",
            "--mscale-all-dim", "1"]
    settings = parse_settings(args, 1)
    assert settings.model.multi_latent_attention and settings.model.q_lora_rank == 16
    losses = train(settings, get_backend("cpu"))["losses"]
    first, last = losses[min(losses)], losses[max(losses)]
    # at initialisation every batch's loss is ln(4096) = 8.32 to ~0.01: a fall of 0.5 is learning
    assert last < first - 0.5, losses



def test_mla_generation_cache_matches_full_recompute():
    """The KV cache keeps MLA's latent and rotated shared key part and decodes with its YaRN softmax scale:
    greedy tokens equal re-running the whole sequence."""
    from omnitron.core.inference import generate
    from omnitron.core.models.gpt import GPTModel

    cfg = _config(params_dtype=torch.float32, vocab_size=300, seq_length=32, rotary_scaling_factor=40.0,
                  mscale_all_dim=1.0)
    model = GPTModel(cfg, ParallelGroups.single(), backend=get_backend("cpu"), seed=3)
    with torch.no_grad():  # sharpen the random model so greedy choices are well separated
        for p in model.parameters():
            if p.ndim > 1:
                p.mul_(4.0)
    prompt = torch.randint(0, 300, (5,)).tolist()
    cached = generate(model, prompt, 10)
    assert cached == generate(model, prompt, 10, use_cache=False) and len(cached) == 10


def test_latent_cache_holds_the_latent_and_matches_recompute():
    """Prefill then two single-token steps through the cache: the last logits equal the full forward (float64,
    same sums in another order: < 1e-10), and the cache holds per token and layer the kv_lora_rank latent plus the
    qk_pos_emb_head_dim rotated key part (10 + 4 numbers here), not heads x (dn + dr + dv) = 4 x 15."""
    from omnitron.core.inference.kv_cache import KVCache
    from omnitron.core.models.gpt import GPTModel

    cfg = _config(vocab_size=50, rotary_scaling_factor=4.0, mscale_all_dim=1.0)
    model = GPTModel(cfg, ParallelGroups.single(), backend=get_backend("cpu"), seed=5).eval()
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        full = model(tokens=tokens, position_ids=pos)
        with KVCache(model) as cache:
            model(tokens=tokens[:, :7], position_ids=pos[:, :7])
            model(tokens=tokens[:, 7:8], position_ids=pos[:, 7:8])
            last = model(tokens=tokens[:, 8:], position_ids=pos[:, 8:])
            assert cache.keys[0].shape == (9, 2, cfg.kv_lora_rank) and cache.values[0].shape == (9, 2, 1, 4)
            per_token = cache.bytes_per_token()
    torch.testing.assert_close(last[0], full[8], rtol=1e-10, atol=1e-12)
    assert per_token == cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim) * 8  # float64
