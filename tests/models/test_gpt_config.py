"""GPTConfig validation, presets, parameter and FLOP accounting."""
from __future__ import annotations

import pytest
import torch

from omnitron.core.config.parallel import ConfigError, ParallelConfig
from omnitron.core.models.gpt import (GPTConfig, GPTModel, flops_per_iteration, gpt2_tiny, gpt_1p3b, llama_tiny,
                                      num_parameters, padded_vocab_size, validate_model)
from omnitron.core.parallel.groups import ParallelGroups


def _pc(**kw):
    return ParallelConfig(**kw)


@pytest.mark.parametrize("cfg, parallel, words", [
    (gpt2_tiny(), _pc(tensor_model_parallel_size=3), ["--num-attention-heads 4", "--tensor-model-parallel-size 3"]),
    (llama_tiny(hidden_size=192, num_attention_heads=12, num_query_groups=3), _pc(tensor_model_parallel_size=4),
     ["--num-query-groups 3", "--tensor-model-parallel-size 4"]),
    (gpt2_tiny(ffn_hidden_size=510), _pc(tensor_model_parallel_size=4), ["--ffn-hidden-size 510"]),
    (gpt2_tiny(), _pc(pipeline_model_parallel_size=3), ["--num-layers 4", "--pipeline-model-parallel-size 3"]),
    (gpt2_tiny(seq_length=30), _pc(tensor_model_parallel_size=4, sequence_parallel=True),
     ["--seq-length 30", "--sequence-parallel"]),
    (gpt2_tiny(seq_length=256), _pc(), ["--max-position-embeddings 128"]),
    (gpt2_tiny(hidden_size=130), _pc(), ["--hidden-size 130", "--num-attention-heads 4"]),
    (gpt2_tiny(recompute_granularity="full"), _pc(), ["--recompute-method"]),
    # Megatron: a recompute chunk of 0 layers loops forever, below 0 this recomputed nothing (silently); with
    # selective recomputation TransformerConfig refuses any --recompute-num-layers
    (gpt2_tiny(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=-1), _pc(),
     ["--recompute-num-layers must be a positive integer", "-1"]),
    (gpt2_tiny(recompute_granularity="full", recompute_method="block", recompute_num_layers=0), _pc(),
     ["--recompute-num-layers must be a positive integer", "0"]),
    (gpt2_tiny(recompute_granularity="selective", recompute_num_layers=1), _pc(),
     ["--recompute-num-layers 1", "full only"]),
    # stopped with a traceback where the model was built (the offloader found no such module), not before any work
    (llama_tiny(num_query_groups=None, multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8,
                qk_pos_emb_head_dim=8, v_head_dim=8, fine_grained_activation_offloading=True,
                offload_modules=["attn_norm", "qkv_linear"]),
     _pc(), ["--offload-modules qkv_linear", "--multi-latent-attention", "drop qkv_linear"]),
    (gpt2_tiny(seq_length=30), _pc(context_parallel_size=2), ["--seq-length 30", "--context-parallel-size 2"]),
])
def test_validation_names_flag(cfg, parallel, words):
    with pytest.raises(ConfigError) as err:
        validate_model(cfg, parallel)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_field_errors():
    with pytest.raises(ConfigError, match="--normalization"):
        GPTConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="BatchNorm")
    with pytest.raises(ConfigError, match="--hidden-dropout"):
        GPTConfig(num_layers=1, hidden_size=8, num_attention_heads=2, hidden_dropout=1.5)
    with pytest.raises(TypeError):
        GPTConfig(1, 8, 2)  # keyword-only


def test_presets_valid_and_counted():
    for preset in (gpt2_tiny, llama_tiny):
        c = preset()
        validate_model(c, _pc(tensor_model_parallel_size=2))
        model = GPTModel(c, ParallelGroups.single())
        assert sum(p.numel() for p in model.parameters()) == num_parameters(c)
        assert 2e6 < num_parameters(c) < 2e7
    assert 1.2e9 < num_parameters(gpt_1p3b()) < 1.45e9


@pytest.mark.parametrize("kw", [dict(add_qkv_bias=True), dict(add_qkv_bias=True, num_query_groups=1),
                                dict(add_qkv_bias=True, add_bias_linear=True)])
def test_qkv_bias_is_counted(kw):
    """--add-qkv-bias: num_parameters and the planner's per-layer count equal the built model's numels, and the
    bias is on linear_qkv only (Megatron: linear_proj and the MLP keep --add-bias-linear)."""
    from omnitron.plan.work import layer_params

    c = llama_tiny(num_layers=2, hidden_size=64, vocab_size=1000, **kw)
    model = GPTModel(c, ParallelGroups.single())
    assert sum(p.numel() for p in model.parameters()) == num_parameters(c)
    layer = model.decoder.layers["0"]
    assert layer_params(c, 1) == sum(p.numel() for p in layer.parameters())
    assert layer.self_attention.linear_qkv.bias.shape == ((4 + 2 * (c.num_query_groups or 4)) * 16,)
    assert (layer.self_attention.linear_proj.bias is None) == (not c.add_bias_linear)
    assert num_parameters(c) - num_parameters(llama_tiny(num_layers=2, hidden_size=64, vocab_size=1000,
                                                         **{**kw, "add_qkv_bias": False})) == \
        (0 if c.add_bias_linear else 2 * (4 + 2 * (c.num_query_groups or 4)) * 16)


def test_qkv_bias_with_multi_latent_attention_is_refused():
    from omnitron.core.models.gpt.presets import deepseek_v3_tiny

    with pytest.raises(ConfigError, match="--add-qkv-bias .* --multi-latent-attention has no such bias"):
        validate_model(deepseek_v3_tiny(add_qkv_bias=True), _pc())


def test_padded_vocab():
    c = gpt2_tiny()
    assert padded_vocab_size(c, 1) == 50304 and padded_vocab_size(c, 2) == 50432 and padded_vocab_size(c, 8) == 51200
    assert padded_vocab_size(gpt2_tiny(vocab_size=255, make_vocab_size_divisible_by=1), 4) == 256


def test_flops_formula_by_hand():
    c = gpt_1p3b()
    B, s, L, h, V = 8, 2048, 24, 2048, 50304
    per_layer_fwd = 2 * B * s * (4 * h * h + 2 * h * 4 * h) + 2 * 2 * B * s * s * h  # GEMMs + QK^T and AV
    fwd = L * per_layer_fwd + 2 * B * s * h * V
    assert flops_per_iteration(c, B) == pytest.approx(3 * fwd, rel=1e-12)
    causal = fwd - L * 2 * B * s * s * h  # half the score term
    assert flops_per_iteration(c, B, causal=True) == pytest.approx(3 * causal, rel=1e-12)
    # GQA + SwiGLU: kv projections shrink, MLP has three matrices
    g = llama_tiny()
    h, f, hq, kv, d, L, s = 128, 352, 4, 2, 32, 4, 128
    V = padded_vocab_size(g, 1)
    per_layer = 2 * s * (h * hq * d * 2 + 2 * h * kv * d + 3 * h * f) + 4 * s * s * hq * d
    assert flops_per_iteration(g, 1) == pytest.approx(3 * (L * per_layer + 2 * s * h * V), rel=1e-12)


def test_stage_layer_range_checked():
    with pytest.raises(ValueError, match="outside"):
        GPTModel(gpt2_tiny(vocab_size=64), ParallelGroups.single(), layer_offset=3, num_layers=2)
