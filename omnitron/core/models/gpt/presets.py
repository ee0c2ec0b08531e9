"""GPT presets: named model configurations (debug sizes, Llama 3, Mixtral, DeepSeek-V3, gpt-oss, Qwen, GPT-3), each a
function of overrides returning a :class:`~omnitron.core.models.gpt.config.GPTConfig` (``--model NAME``; the family's
table is :mod:`omnitron.core.models.gpt.family`). Moved out of config.py, which re-exports the old names."""
from __future__ import annotations

from dataclasses import replace

from omnitron.core.models.gpt.config import GPTConfig


def gpt2_tiny(**overrides) -> GPTConfig:
    """GPT-2 style debug model (~7M parameters with the GPT-2 vocabulary; fast on CPU)."""
    return replace(GPTConfig(num_layers=4, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512,
                             seq_length=128, max_position_embeddings=128, vocab_size=50257), **overrides)


def llama_tiny(**overrides) -> GPTConfig:
    """Llama style debug model: RMSNorm, SwiGLU, RoPE, GQA (4 heads, 2 groups), untied, no biases."""
    return replace(GPTConfig(num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                             ffn_hidden_size=352, seq_length=128, vocab_size=32000, normalization="RMSNorm",
                             swiglu=True, position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                             hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
                             layernorm_epsilon=1e-6), **overrides)


def gpt_1p3b(**overrides) -> GPTConfig:
    """GPT 1.3B (24 layers, hidden 2048, 16 heads, seq 2048), the standard MFU benchmark shape."""
    return replace(GPTConfig(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048,
                             max_position_embeddings=2048, vocab_size=50257), **overrides)


_LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
              untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
              add_bias_linear=False, layernorm_epsilon=1e-5)


def llama3_8b(**overrides) -> GPTConfig:
    """Llama 3 8B (Meta, 2024): 32 layers, hidden 4096, 32 heads / 8 KV groups, SwiGLU 14336, RoPE base 500000,
    vocabulary 128256, seq 8192; 8,030,261,248 parameters."""
    return replace(GPTConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                             ffn_hidden_size=14336, seq_length=8192, max_position_embeddings=8192, vocab_size=128256,
                             rotary_base=500000.0, **_LLAMA), **overrides)


def llama3_70b(**overrides) -> GPTConfig:
    """Llama 3 70B: 80 layers, hidden 8192, 64 heads / 8 KV groups, SwiGLU 28672; 70,553,706,496 parameters."""
    return replace(llama3_8b(num_layers=80, hidden_size=8192, num_attention_heads=64, ffn_hidden_size=28672),
                   **overrides)


def llama3_405b(**overrides) -> GPTConfig:
    """Llama 3 405B (Meta, 2024): 126 layers, hidden 16384, 128 heads / 8 KV groups, SwiGLU 53248;
    405,853,388,800 parameters."""
    return replace(llama3_8b(num_layers=126, hidden_size=16384, num_attention_heads=128, ffn_hidden_size=53248),
                   **overrides)


def mixtral_8x7b(**overrides) -> GPTConfig:
    """Mixtral 8x7B (Mistral AI, 2024): 32 layers of 8 SwiGLU experts (top-2 routing, softmax over the picks'
    logits), hidden 4096, 32 heads / 8 KV groups, RoPE base 1e6, vocabulary 32000; 46,702,792,704 parameters."""
    return replace(GPTConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                             ffn_hidden_size=14336, seq_length=4096, max_position_embeddings=32768, vocab_size=32000,
                             rotary_base=1e6, num_experts=8, moe_router_topk=2, **_LLAMA), **overrides)


_DEEPSEEK_ROUTING = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                        moe_router_bias_update_rate=1e-3, multi_latent_attention=True, qk_layernorm=True,
                        mscale=1.0, mscale_all_dim=1.0)


def deepseek_v3(**overrides) -> GPTConfig:
    """DeepSeek-V3 (DeepSeek-AI, 2024; its config.json): 61 layers (the first 3 dense, SwiGLU 18432), hidden 7168,
    MLA with 128 heads (q rank 1536, kv rank 512, head dims 128 + 64 rotated, values 128; YaRN x40 over 4096),
    256 routed experts of 2048 (top-8 of sigmoid scores within the best 4 of 8 groups, weights x 2.5, expert bias)
    plus one shared expert, vocabulary 129280, untied; 671,026,419,200 parameters (the model card's 671B). The
    checkpoint's 685B adds the multi-token-prediction module (``mtp_num_layers=1``: 682,636,487,424 with the
    biases; the checkpoint also stores copies of the embedding and the output head in it, and FP8 scales)."""
    return replace(GPTConfig(num_layers=61, hidden_size=7168, num_attention_heads=128, ffn_hidden_size=18432,
                             seq_length=4096, max_position_embeddings=163840, vocab_size=129280, q_lora_rank=1536,
                             kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
                             rotary_scaling_factor=40.0, yarn_original_max_position_embeddings=4096,
                             num_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048,
                             moe_shared_expert_intermediate_size=2048, moe_layer_freq="[0]*3+[1]*58",
                             moe_router_num_groups=8, moe_router_group_topk=4, moe_router_topk_scaling_factor=2.5,
                             **_DEEPSEEK_ROUTING, **{**_LLAMA, "layernorm_epsilon": 1e-6}), **overrides)


def deepseek_v3_tiny(**overrides) -> GPTConfig:
    """DeepSeek-V3's architecture at debug size: 4 layers (the first dense), hidden 64, MLA with 4 heads (ranks
    32 / 16, head dims 16 + 8 rotated, values 16; YaRN x40 over 32 positions), 8 experts of 32 (top-2 within the
    best 2 of 4 groups, x 2.5, expert bias) plus a shared expert of 32, vocabulary 32000."""
    return replace(GPTConfig(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                             seq_length=128, vocab_size=32000, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16,
                             qk_pos_emb_head_dim=8, v_head_dim=16, rotary_scaling_factor=40.0,
                             yarn_original_max_position_embeddings=32, num_experts=8, moe_router_topk=2,
                             moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32, moe_layer_freq="[0]+[1]*3",
                             moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
                             **_DEEPSEEK_ROUTING, **_LLAMA), **overrides)


def gpt_oss_20b(**overrides) -> GPTConfig:
    """gpt-oss-20b (OpenAI, 2025; its config.json): 24 layers, hidden 2880, 64 heads of 64 / 8 KV groups with
    biases and learned attention sinks, a 128-token sliding window on every other layer (from the first), 32
    experts of 2880 (top-4, softmax over the picks, router bias) with gpt-oss's clamped SwiGLU, vocabulary
    201088, untied; YaRN RoPE (base 150000, factor 32 over 4096, ramp ends not rounded)."""
    return replace(GPTConfig(num_layers=24, hidden_size=2880, num_attention_heads=64, num_query_groups=8,
                             kv_channels=64, ffn_hidden_size=2880, seq_length=4096, max_position_embeddings=131072,
                             vocab_size=201088, rotary_base=150000.0, rotary_scaling_factor=32.0,
                             yarn_original_max_position_embeddings=4096, mscale_all_dim=0.0,
                             yarn_correction_range_round_to_int=False, num_experts=32, moe_router_topk=4,
                             moe_ffn_hidden_size=2880, moe_router_bias=True, window_size="127,0",
                             window_attn_skip_freq="2", softmax_type="learnable", quick_geglu=True,
                             glu_linear_offset=1.0, activation_func_clamp_value=7.0,
                             moe_router_load_balancing_type="none",
                             **{**_LLAMA, "add_bias_linear": True, "position_embedding_type": "yarn"}), **overrides)


def qwen3_30b_a3b(**overrides) -> GPTConfig:
    """Qwen3-30B-A3B (Qwen, 2025; its config.json): 48 layers, hidden 2048, 32 heads of 128 / 4 KV groups with
    QK-norm, 128 experts of 768 (top-8, softmax over the picks), RoPE base 1e6, vocabulary 151936, untied."""
    return replace(GPTConfig(num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
                             kv_channels=128, ffn_hidden_size=6144, seq_length=4096, max_position_embeddings=40960,
                             vocab_size=151936, rotary_base=1e6, qk_layernorm=True, num_experts=128, moe_router_topk=8,
                             moe_ffn_hidden_size=768, **{**_LLAMA, "layernorm_epsilon": 1e-6}), **overrides)


def qwen2_5_7b(**overrides) -> GPTConfig:
    """Qwen2.5-7B (Qwen, 2024; its config.json): 28 layers, hidden 3584, 28 heads of 128 / 4 KV groups, a bias on
    the query/key/value projection only (Megatron's --disable-bias-linear --add-qkv-bias), SwiGLU of 18944, RoPE
    base 1e6, RMSNorm eps 1e-6, vocabulary 152064, untied; no sliding window (its use_sliding_window is false)."""
    return replace(GPTConfig(num_layers=28, hidden_size=3584, num_attention_heads=28, num_query_groups=4,
                             ffn_hidden_size=18944, seq_length=4096, max_position_embeddings=131072, vocab_size=152064,
                             rotary_base=1e6, add_qkv_bias=True, **{**_LLAMA, "layernorm_epsilon": 1e-6}),
                   **overrides)


GPT3_SIZES = {"125m": (12, 768, 12), "350m": (24, 1024, 16), "760m": (24, 1536, 16), "1p3b": (24, 2048, 16),
              "2p7b": (32, 2560, 32), "6p7b": (32, 4096, 32), "13b": (40, 5120, 40), "175b": (96, 12288, 96)}
"""GPT-3's sizes (Brown et al. 2020, Table 2.1): (layers, hidden, heads). NOTE: where the table's heads x head
width is not its hidden size, heads of 128 channels as Megatron's GPT-3 scripts: 1.3B has 16 heads (the table's
24 x 128 = 3072 would make it 1.5B) and 13B hidden 5120 (the table's 5140 is not a multiple of 40 heads)."""


def gpt3(size: str, **overrides) -> GPTConfig:
    """A GPT-3 size: LayerNorm, GELU MLP of 4x hidden, learned positions, tied embeddings, seq 2048."""
    layers, hidden, heads = GPT3_SIZES[size]
    return replace(GPTConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=2048,
                             max_position_embeddings=2048, vocab_size=50257), **overrides)
