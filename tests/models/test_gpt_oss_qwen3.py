"""The gpt-oss and Qwen3-MoE presets: parameter counts equal the released models' as ``transformers`` builds them
(meta device) from their published config.json values; the gpt-oss settings' refusals. The layers themselves
(window, sinks, clamped GeGLU) are checked against plain float64 maths in test_gpt_reference.py and in cached
generation in tests/inference/test_batched.py."""
from __future__ import annotations

import pytest
import torch

from omnitron.core.config.parallel import ConfigError, ParallelConfig
from omnitron.core.models.family import get_family
from omnitron.core.models.gpt.config import num_parameters

transformers = pytest.importorskip("transformers")


def _hf_count(cls_name: str, config) -> int:
    with torch.device("meta"):
        model = getattr(transformers, cls_name)(config)
    return sum(p.numel() for p in model.parameters())


def test_gpt_oss_20b_counts_the_released_model():
    hf = transformers.GptOssConfig(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                                   num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                                   num_experts_per_tok=4, sliding_window=128, tie_word_embeddings=False)
    assert num_parameters(get_family("gpt").presets["gpt_oss_20b"]()) == _hf_count("GptOssForCausalLM", hf)


def test_qwen3_30b_a3b_counts_the_released_model():
    hf = transformers.Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                     moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                                     num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                     tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])
    assert num_parameters(get_family("gpt").presets["qwen3_30b_a3b"]()) == _hf_count("Qwen3MoeForCausalLM", hf)


def test_qwen2_5_7b_counts_the_released_model():
    hf = transformers.Qwen2Config(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                  num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072,
                                  rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                  use_sliding_window=False)
    assert num_parameters(get_family("gpt").presets["qwen2_5_7b"]()) == _hf_count("Qwen2ForCausalLM", hf)


@pytest.mark.parametrize("name", ["gpt_oss_20b", "qwen3_30b_a3b", "qwen2_5_7b"])
def test_meta_build_equals_the_formula(name):
    from omnitron.core.models.gpt import GPTModel
    from omnitron.core.parallel.groups import ParallelGroups

    cfg = get_family("gpt").presets[name]()
    with torch.device("meta"):
        model = GPTModel(cfg, ParallelGroups.single())
    assert sum(p.numel() for p in model.parameters()) == num_parameters(cfg)


def test_window_and_sink_settings_are_checked():
    from omnitron.core.models.gpt.config import validate_model
    from omnitron.core.models.gpt.presets import deepseek_v3_tiny, llama_tiny

    with pytest.raises(ConfigError, match="the right side is 0"):
        llama_tiny(window_size="4,2")
    with pytest.raises(ConfigError, match="--window-size 'x' is not two integers"):
        llama_tiny(window_size="x")
    with pytest.raises(ConfigError, match="--softmax-type 'soft'"):
        llama_tiny(softmax_type="soft")
    with pytest.raises(ConfigError, match="--window-attn-skip-freq"):
        llama_tiny(window_size="4,0", window_attn_skip_freq="[1,0]")  # 4 layers need 4 entries
    with pytest.raises(ConfigError, match="grouped-query attention only"):
        validate_model(deepseek_v3_tiny(softmax_type="learnable"), ParallelConfig())
    from omnitron.core.transformer.window import window_layers

    assert window_layers(llama_tiny(window_size="4,0", window_attn_skip_freq="2")) == [True, False, True, False]
    assert window_layers(llama_tiny(window_size="4,0", window_attn_skip_freq="[0,0,1,1]")) == [False, False, True,
                                                                                               True]
    assert llama_tiny(quick_geglu=True, swiglu=False).swiglu  # --quick-geglu is a gated MLP
