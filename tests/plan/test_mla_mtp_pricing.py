"""`omnitron plan` prices multi-latent attention and multi-token prediction: its parameter counts equal the
model's own (a meta-device build through the plan's gradient buffers), its FLOPs Megatron's formula."""
from __future__ import annotations

import types

import pytest

from omnitron.core.models.gpt.config import flops_per_iteration
from omnitron.core.models.gpt.presets import deepseek_v3_tiny, llama_tiny, mixtral_8x7b


def _settings(tmp_path, extra):
    from omnitron.core.training.arguments import parse_settings

    return parse_settings(["--model", "deepseek_v3_tiny", "--micro-batch-size", "1", "--train-iters", "1",
                           "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000",
                           "--save", str(tmp_path), *extra], 2 if "2" in extra else 1)


@pytest.mark.parametrize("extra", [[], ["--mtp-num-layers", "2"],
                                   ["--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2"],
                                   ["--mtp-num-layers", "1", "--tensor-model-parallel-size", "2"]])
def test_plan_parameters_are_the_models(tmp_path, extra):
    """Every stage's parameters in the plan's count (speed model) equal the meta-device model's gradient buffers
    (fp32: 4 bytes each), MLA's replicated down-projections and the MTP depths on the last stage included."""
    from omnitron.core.models.gpt.config import num_parameters, padded_vocab_size
    from omnitron.plan.memory import model_config
    from omnitron.plan.speed import stage_params
    from omnitron.plan.stage_layers import stage_layers
    from omnitron.plan.state import state_bytes

    s = _settings(tmp_path, extra)
    cfg = model_config(s)
    layers = stage_layers(s, cfg)
    pp = s.parallel.pipeline_model_parallel_size
    for r in range(pp):
        assert stage_params(cfg, s, r, layers[(r, 0)]) * 4 == state_bytes(s, cfg, r).grads, (extra, r)
    if s.parallel.tensor_model_parallel_size == 1:  # the whole model once, plus the last stage's embedding copy
        copy = padded_vocab_size(cfg, 1) * cfg.hidden_size if pp > 1 else 0
        assert sum(stage_params(cfg, s, r, layers[(r, 0)]) for r in range(pp)) == num_parameters(cfg) + copy


def _megatron(args, batch: int, seq: int) -> float:
    """Megatron-LM d98e8a6 megatron/training/training.py, num_floating_point_operations -> transformer_flops,
    transcribed for the fields used here (no linear attention, no MoE latent, no output gate); the batch is
    ``batch`` sequences of ``seq`` tokens (total_real_tokens_in_batch, seqlen_squared_sum_in_batch)."""
    pattern = args.moe_layer_freq
    num_moe_layers = sum(pattern) if args.num_experts else 0
    num_dense_layers = args.num_layers - num_moe_layers
    num_experts_routed_to = args.moe_router_topk if args.num_experts else 0
    last_layer_is_moe = pattern[-1] if args.num_experts else 0
    mtp_num_layers = args.mtp_num_layers or 0
    num_moe_layers += last_layer_is_moe * mtp_num_layers
    num_dense_layers += (1 - last_layer_is_moe) * mtp_num_layers
    num_layers = args.num_layers + mtp_num_layers
    moe_ffn_hidden_size = args.moe_ffn_hidden_size or args.ffn_hidden_size
    shared = args.moe_shared_expert_intermediate_size or 0
    fb, fma, ffn_x = 3, 2, (3 if args.swiglu else 2)
    if args.multi_latent_attention:
        if args.q_lora_rank is None:
            q_term = args.hidden_size * args.num_attention_heads * (args.qk_head_dim + args.qk_pos_emb_head_dim)
        else:
            q_term = args.q_lora_rank * (args.hidden_size + args.num_attention_heads
                                         * (args.qk_head_dim + args.qk_pos_emb_head_dim) + 1)
        attn = fb * fma * (q_term + args.kv_lora_rank * (args.hidden_size + args.num_attention_heads
                                                         * (args.qk_head_dim + args.v_head_dim) + 1)
                           + args.hidden_size * args.qk_pos_emb_head_dim
                           + (args.num_attention_heads * args.v_head_dim) * args.hidden_size)
        core = fb * fma * (args.num_attention_heads * (args.qk_head_dim + args.qk_pos_emb_head_dim) / 2
                           + args.num_attention_heads * args.v_head_dim / 2)
    else:
        qp, kp = args.kv_channels * args.num_attention_heads, args.kv_channels * args.num_query_groups
        attn = fb * fma * (args.hidden_size * (qp + kp + kp) + qp * args.hidden_size)
        core = fb * fma * qp / 2 * 2
    tokens = batch * seq
    return (tokens * (fb * fma * args.hidden_size * (
        args.ffn_hidden_size * ffn_x * num_dense_layers
        + moe_ffn_hidden_size * num_experts_routed_to * ffn_x * num_moe_layers + shared * ffn_x * num_moe_layers)
        + attn * num_layers + fb * fma * mtp_num_layers * (3 * args.hidden_size + 2 * args.hidden_size ** 2)
        + fb * fma * args.hidden_size * args.padded_vocab_size * (mtp_num_layers + 1))
        + batch * seq * seq * core * num_layers)


def _args(c):
    from omnitron.core.models.gpt.config import head_dim, padded_vocab_size, query_groups
    from omnitron.core.transformer.moe.pattern import moe_layer_pattern

    fields = {k: getattr(c, k) for k in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                                         "swiglu", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
                                         "moe_shared_expert_intermediate_size", "multi_latent_attention",
                                         "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                                         "v_head_dim", "mtp_num_layers")}
    return types.SimpleNamespace(**fields, kv_channels=head_dim(c), num_query_groups=query_groups(c),
                                 padded_vocab_size=padded_vocab_size(c, 1),
                                 moe_layer_freq=[int(m) for m in moe_layer_pattern(c.moe_layer_freq, c.num_layers)])


@pytest.mark.parametrize("cfg", [deepseek_v3_tiny(), deepseek_v3_tiny(mtp_num_layers=2),
                                 deepseek_v3_tiny(q_lora_rank=None, moe_layer_freq="[1]*3+[0]", mtp_num_layers=1),
                                 mixtral_8x7b(), llama_tiny(mtp_num_layers=1)],
                         ids=["dsv3_tiny", "dsv3_tiny_mtp2", "no_q_rank_dense_last_mtp", "mixtral", "llama_mtp"])
def test_flops_are_megatrons(cfg):
    for batch, seq in ((1, cfg.seq_length), (3, 64)):
        assert flops_per_iteration(cfg, batch, seq) == pytest.approx(_megatron(_args(cfg), batch, seq), rel=1e-12)


@pytest.mark.parametrize("tp", [1, 2])
def test_plan_parameters_count_the_qkv_bias(tmp_path, tp):
    """--add-qkv-bias (Qwen2): the plan's per-rank parameters equal the meta-device model's gradient buffers,
    the linear_qkv bias split over tp with its rows."""
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.memory import model_config
    from omnitron.plan.speed import stage_params
    from omnitron.plan.stage_layers import stage_layers
    from omnitron.plan.state import state_bytes

    s = parse_settings(["--model", "llama_tiny", "--add-qkv-bias", "--micro-batch-size", "1", "--train-iters", "1",
                        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000",
                        "--tensor-model-parallel-size", str(tp), "--save", str(tmp_path)], tp)
    cfg = model_config(s)
    assert cfg.add_qkv_bias and not cfg.add_bias_linear
    assert stage_params(cfg, s, 0, stage_layers(s, cfg)[(0, 0)]) * 4 == state_bytes(s, cfg, 0).grads
