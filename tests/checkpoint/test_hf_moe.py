"""Hugging Face DeepSeek-V3, gpt-oss and Qwen3-MoE layouts against ``transformers`` itself, both directions, in
float64 (Qwen3-MoE: QK-norm, a dense first layer, 4 softmax-routed experts).

Import: a tiny random ``DeepseekV3ForCausalLM`` (MLA with q and kv ranks, a dense first layer, 8 sigmoid-routed
experts in 4 groups with a shared expert, routed scaling 2.5; plain RoPE and YaRN) or ``GptOssForCausalLM`` (GQA
with biases, sinks, a 4-token window on alternate layers, 4 experts with the clamped GeGLU, router bias), every
weight random, is saved with ``save_pretrained`` and imported with ``import_hf``; omnitron's forward on the
imported checkpoint gives transformers' logits on random tokens. Export: an omnitron model of each layout, every
weight random, converted with ``config_to_hf`` / ``state_to_hf``, loads into the transformers class strictly and
gives omnitron's logits.

Tolerance: both routers compute their logits in float32 (HF gpt-oss's in float64), from float64 hidden states
that round to float32 independently: one ulp (6e-8 relative) of router logits of size O(3) moves a routing weight
by ~2e-7, times the routed scaling 2.5 and through two layers and the unembedding (gain ~3): ~1.5e-6 of the
logits' maximum at worst, observed 1.3e-6. Everything else is float64 (1e-14). Bound: 5e-6 (a wrong head split,
rope channel, gate/up order or clamp moves the logits by O(0.1)); a routing near-tie could flip a choice, so the
random weights are scaled up (std 0.3) to keep the routers' logits apart.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from omnitron.backends import get_backend  # noqa: E402
from omnitron.core.checkpoint.hf import config_from_hf, config_to_hf, import_hf, state_to_hf  # noqa: E402
from omnitron.core.checkpoint.reshard import Layout, read_full_state  # noqa: E402
from omnitron.core.models.gpt import GPTModel, gather_full_state  # noqa: E402
from omnitron.core.models.gpt.state import shard_full_state  # noqa: E402
from omnitron.core.parallel.groups import ParallelGroups  # noqa: E402

V = 96
TOL = 5e-6

HF_CONFIGS = {
    "deepseek_v3": lambda **kw: transformers.DeepseekV3Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
        kv_lora_rank=8, q_lora_rank=12, qk_rope_head_dim=4, v_head_dim=6, qk_nope_head_dim=6, n_group=4, topk_group=2,
        num_experts_per_tok=4, first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=64,
        tie_word_embeddings=False, num_nextn_predict_layers=0, **kw),
    "deepseek_v3_yarn": lambda: HF_CONFIGS["deepseek_v3"](rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0}),
    "gpt_oss": lambda: transformers.GptOssConfig(
        vocab_size=V, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        tie_word_embeddings=False),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0], max_position_embeddings=64,
        tie_word_embeddings=False),
    # the released config's YaRN (factor 32 over 4096, ramp ends not rounded), over a short original context so
    # that the 12 positions here reach the interpolated channels
    "gpt_oss_yarn": lambda: transformers.GptOssConfig(
        vocab_size=V, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=64, tie_word_embeddings=False, rope_parameters={
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 8}),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            base = 1.0 if "norm" in n and p.ndim == 1 else 0.0
            p.copy_(base + torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * 0.3)


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits.double()


def _omni_logits(model, tokens):
    with torch.no_grad():
        return model(tokens=tokens)[..., :V].transpose(0, 1).double()


def _close(a, b):
    err = ((a - b).abs().max() / b.abs().max()).item()
    assert err < TOL, err


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_import_gives_transformers_logits(name, tmp_path):
    hf_cfg = HF_CONFIGS[name]()
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float64, experts_implementation="eager").eval()
    _randomize(hf, 1)
    hf.save_pretrained(tmp_path / "hf")
    path = import_hf(str(tmp_path / "hf"), str(tmp_path / "omni"), Layout())
    full = read_full_state(path, with_optimizer=False)
    cfg = config_from_hf(hf.config.to_dict())
    model = GPTModel(cfg, ParallelGroups.single(), backend=get_backend("cpu")).eval()
    shard_full_state(model, full.model, ParallelGroups.single())
    tokens = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(2))
    _close(_omni_logits(model, tokens), _hf_logits(hf, tokens))


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_export_loads_in_transformers_with_the_same_logits(name, tmp_path):
    """The exported files (what export_hf writes: config.json, model.safetensors) load with from_pretrained,
    every tensor used (transformers reports none missing or unexpected)."""
    import json

    from safetensors.torch import save_file

    cfg = config_from_hf(HF_CONFIGS[name]().to_dict())
    model = GPTModel(cfg, ParallelGroups.single(), backend=get_backend("cpu")).eval()
    _randomize(model, 3)
    full = gather_full_state(model, ParallelGroups.single())
    save_file(state_to_hf(full, cfg), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(cfg)))
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float64, experts_implementation="eager", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    hf.eval()
    tokens = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(4))
    _close(_hf_logits(hf, tokens), _omni_logits(model, tokens))
