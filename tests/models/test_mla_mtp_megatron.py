"""Multi-latent attention and multi-token prediction against megatron-core's own code: the losses and every gradient
megatron-core computed (tests/models/megatron_mla_mtp/fixtures.pt, written by its make_fixtures.py with the
Megatron-LM d98e8a6 snapshot, float64 on CPU) are omnitron's on the same weights, inputs and loss mask.

Cases: YaRN x40 (1024 original positions, beta 16 / 2: a ramp over rotated pairs 2..4 of 8; concentration
m(0.8) / m(1)) with a q rank and QK norms, untied, two MTP depths; plain RoPE without a q rank or QK norms,
LayerNorm, biases, tied embedding and output layer (the MTP embedding and head share it), one depth; every layer
MoE (4 experts, top-2, a shared expert, the load-balancing loss, the MTP depth's router included) with YaRN x8,
two depths. The loss mask holds zeros, so the shifted masks and each depth's own token count are exercised.

Tolerance: the weights (bfloat16 values) and inputs are the same and both sides run in float64, with the fused
kernels on their float64 references here; what stays float32 is the RoPE inverse frequencies (both sides round
them to float32: a difference of at most one ulp, 6e-8 relative, in angles up to 11 rad) and omnitron's
cross-entropy (float32, relative 6e-8 per token, ln V ~ 4). Through four layers (two decoder, two MTP) that is
~ 4 x 4 x 6e-8 ~ 1e-6 relative in the gradients (8e-7 the worst here); 1e-5 bounds it. A wrong shift, mask,
scale, rope channel or tied-weight gradient errs by 1e-2 or more.
"""
from __future__ import annotations

import os

import pytest
import torch

from omnitron.core.parallel.groups import ParallelGroups
from omnitron.testing.parity import reference_kernels

FIXTURES = torch.load(os.path.join(os.path.dirname(__file__), "megatron_mla_mtp", "fixtures.pt"), weights_only=True)
TOL = 1e-5


def _config(c: dict):
    """omnitron's GPTConfig of a fixture case (Megatron's names, written out here)."""
    from omnitron.core.models.gpt import GPTConfig

    moe = dict(num_experts=c["num_experts"], moe_router_topk=2, moe_ffn_hidden_size=16,
               moe_shared_expert_intermediate_size=16, moe_router_score_function="softmax",
               moe_aux_loss_coeff=c["moe_aux_loss_coeff"], moe_router_load_balancing_type="aux_loss")
    return GPTConfig(
        num_layers=c["num_layers"], hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
        ffn_hidden_size=c["ffn_hidden_size"], seq_length=12, vocab_size=53, make_vocab_size_divisible_by=1,
        hidden_dropout=0.0, attention_dropout=0.0, normalization=c["normalization"], swiglu=True,
        add_bias_linear=c["add_bias_linear"], untie_embeddings_and_output_weights=c["untie"],
        position_embedding_type="rope", multi_latent_attention=True, q_lora_rank=c["q_lora_rank"],
        kv_lora_rank=c["kv_lora_rank"], qk_head_dim=c["qk_head_dim"], qk_pos_emb_head_dim=c["qk_pos_emb_head_dim"],
        v_head_dim=c["v_head_dim"], qk_layernorm=c["qk_layernorm"], rotary_base=c["rotary_base"],
        rotary_scaling_factor=c["rotary_scaling_factor"], mscale=c["mscale"], mscale_all_dim=c["mscale_all_dim"],
        yarn_original_max_position_embeddings=c["original_max_position_embeddings"], yarn_beta_fast=c["beta_fast"],
        yarn_beta_slow=c["beta_slow"], mtp_num_layers=c["mtp_num_layers"],
        mtp_loss_scaling_factor=c["mtp_loss_scaling_factor"], params_dtype=torch.float64,
        **(moe if c["num_experts"] else {}))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("case", sorted(FIXTURES))
def test_mla_mtp_losses_and_gradients_equal_megatron_core(case):
    from omnitron.core.models.gpt import GPTModel

    fx = FIXTURES[case]
    cfg = _config(fx["config"])
    model = GPTModel(cfg, ParallelGroups.single()).double().train()
    missing = model.load_state_dict({n: t.double() for n, t in fx["weights"].items()}, strict=False)
    assert not missing.unexpected_keys and all(n.endswith("inv_freq") for n in missing.missing_keys), missing
    assert sorted(n for n, _ in model.named_parameters()) == sorted(fx["grads"])
    with reference_kernels():
        per_token = model(fx["tokens"], labels=fx["labels"], loss_mask=fx["loss_mask"])
        mask = fx["loss_mask"]
        ((per_token.double() * mask).sum() / mask.sum()).backward()
    assert _rel(per_token.detach(), fx["lm_loss"]) < TOL
    assert abs(float(model.mtp.loss_total) / fx["mtp_loss"] - 1) < TOL
    worst = {n: _rel(p.grad, fx["grads"][n]) for n, p in model.named_parameters()}
    assert max(worst.values()) < TOL, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
