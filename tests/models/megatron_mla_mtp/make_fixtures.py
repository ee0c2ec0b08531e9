"""Writes ``fixtures.pt`` beside this file WITH MEGATRON-LM'S OWN CODE: multi-latent attention and multi-token
prediction's losses and gradients that omnitron must reproduce (tests/models/test_mla_mtp_megatron.py).

Needs megatron-core (the Megatron-LM d98e8a6 snapshot was used; megatron-core 0.16.1 should do) and psutil on the
path; runs on CPU, offline, in float64. Run from the omnitron root:

    PYTHONPATH=/path/to/Megatron-LM python tests/models/megatron_mla_mtp/make_fixtures.py

omnitron is not imported. Each case of :data:`CASES` builds megatron-core's ``GPTModel`` (local spec, through
tests/checkpoint/megatron_core_moe_side.py's ``build`` and CPU stand-ins: MLA's core attention is a plain causal
softmax attention with MLA's softmax scale), gives every parameter seeded random values, runs one forward with
labels and a loss mask and the backward of the masked-mean LM loss (``MTPLossAutoScaler``'s backward scale 1, as
one micro-batch without loss scaling), and stores: the weights (bfloat16 values, omnitron's names: the MTP
depth's ``mtp_model_layer`` read as ``transformer_layer``, SequentialMLP's ``local_experts.E`` as ``experts.E``),
the inputs, megatron-core's per-token LM loss, the MTP losses it attaches (``process_mtp_loss``: lambda / D x
the depth's masked mean, summed over depths) and every parameter's gradient.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import typing

import torch
import torch.nn.functional as F

if not hasattr(typing, "override"):  # Megatron imports typing.override (Python >= 3.12)
    typing.override = lambda f: f

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "checkpoint"))
V, S, B = 53, 12, 2  # vocabulary, sequence, batch
BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, normalization="RMSNorm",
            q_lora_rank=12, kv_lora_rank=10, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=5, qk_layernorm=True,
            rotary_base=10000.0, rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0,
            original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, untie=True, mtp_num_layers=2,
            mtp_loss_scaling_factor=0.3, add_bias_linear=False, num_experts=None, moe_aux_loss_coeff=0.0)
CASES = {  # name -> (the fields that differ from BASE, seed)
    # YaRN x40 over 1024 original positions, the concentration m(0.8) / m(1); beta 16 / 2 ramp over rotated pairs
    # 2..4 of 8 (the defaults 32 / 1: 1..5; over 4096 positions: 2..6)
    "yarn_q_lora_untied_2_depths": (dict(rotary_scaling_factor=40.0, mscale=0.8, mscale_all_dim=1.0,
                                         qk_pos_emb_head_dim=16, original_max_position_embeddings=1024,
                                         beta_fast=16.0, beta_slow=2.0), 1),
    "rope_no_q_lora_tied_1_depth_biases": (dict(q_lora_rank=None, qk_layernorm=False, untie=False, mtp_num_layers=1,
                                                add_bias_linear=True, normalization="LayerNorm"), 2),
    # every layer (the MTP depth's too) MoE: 4 experts, top-2, a shared expert, the load-balancing loss
    "moe_aux_loss_yarn_2_depths": (dict(num_experts=4, moe_aux_loss_coeff=0.05, rotary_scaling_factor=8.0,
                                        mscale_all_dim=0.5), 3),
}


def _args(c: dict) -> argparse.Namespace:
    """The Megatron arguments tests/checkpoint/megatron_core_moe_side.py's ``build`` reads."""
    moe = bool(c["num_experts"])
    return argparse.Namespace(
        num_layers=c["num_layers"], hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
        ffn_hidden_size=c["ffn_hidden_size"], normalization=c["normalization"], norm_epsilon=1e-5,
        qk_layernorm=c["qk_layernorm"], num_experts=c["num_experts"], moe_router_topk=2 if moe else None,
        moe_ffn_hidden_size=16 if moe else None, moe_shared_expert_intermediate_size=16 if moe else None,
        moe_layer_freq=1,
        moe_router_enable_expert_bias=False, moe_router_score_function="softmax", moe_router_num_groups=None,
        moe_router_group_topk=None, moe_router_topk_scaling_factor=None, mtp_num_layers=c["mtp_num_layers"],
        multi_latent_attention=True, q_lora_rank=c["q_lora_rank"], kv_lora_rank=c["kv_lora_rank"],
        qk_head_dim=c["qk_head_dim"], qk_pos_emb_head_dim=c["qk_pos_emb_head_dim"], v_head_dim=c["v_head_dim"],
        rope_type="rope" if c["rotary_scaling_factor"] == 1.0 else "yarn", rotary_base=c["rotary_base"],
        rotary_scaling_factor=c["rotary_scaling_factor"], mscale=c["mscale"], mscale_all_dim=c["mscale_all_dim"],
        original_max_position_embeddings=c["original_max_position_embeddings"], beta_fast=c["beta_fast"],
        beta_slow=c["beta_slow"], padded_vocab_size=V, seq_length=S,
        untie_embeddings_and_output_weights=c["untie"])


def _omnitron_name(name: str) -> str:
    name = name.replace(".mtp_model_layer.", ".transformer_layer.")
    return re.sub(r"mlp\.experts\.local_experts\.(\d+)\.", r"mlp.experts.\1.", name)


def run_case(c: dict, seed: int) -> dict:
    """megatron-core's losses and gradients of case ``c`` (see the module docstring)."""
    from megatron.core.transformer import multi_token_prediction as mtp
    from megatron_core_moe_side import build

    model = build(_args(c), params_dtype=torch.float64, add_bias_linear=c["add_bias_linear"],
                  mtp_loss_scaling_factor=c["mtp_loss_scaling_factor"], moe_aux_loss_coeff=c["moe_aux_loss_coeff"],
                  moe_router_load_balancing_type="aux_loss" if c["moe_aux_loss_coeff"] else "none").double().train()
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():  # bfloat16 values, so the fixture's bfloat16 weights are exact
            p.copy_(((1.0 if p.dim() == 1 and "norm" in name else 0.0) + 0.3 * torch.randn(p.shape, generator=g))
                    .bfloat16())
    tokens, labels = torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)
    mask = (torch.rand(B, S, generator=g) > 0.3).double()
    attached, apply = [], mtp.MTPLossAutoScaler.apply

    def spy(hidden, loss):  # the scaled per-token MTP loss of each depth, as process_mtp_loss attaches it
        attached.append(loss.detach().sum())
        return apply(hidden, loss)

    mtp.MTPLossAutoScaler.apply = spy
    try:
        per_token = model(tokens, torch.arange(S)[None].expand(B, S), None, labels=labels, loss_mask=mask)
    finally:
        mtp.MTPLossAutoScaler.apply = apply
    ((per_token * mask).sum() / mask.sum()).backward()
    assert len(attached) == c["mtp_num_layers"], attached
    return {"config": c, "tokens": tokens, "labels": labels, "loss_mask": mask,
            "weights": {_omnitron_name(n): p.detach().bfloat16() for n, p in params.items()},
            "lm_loss": per_token.detach().double(), "mtp_loss": float(sum(attached)),
            "grads": {_omnitron_name(n): p.grad.float() for n, p in params.items()}}


def main() -> None:
    from megatron_core_moe_side import cpu_stand_ins

    cpu_stand_ins()
    out = {name: run_case({**BASE, **kw}, seed) for name, (kw, seed) in CASES.items()}
    torch.save(out, os.path.join(HERE, "fixtures.pt"))


if __name__ == "__main__":
    main()
