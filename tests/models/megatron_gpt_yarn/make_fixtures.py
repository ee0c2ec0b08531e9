"""Writes ``fixtures.pt`` beside this file WITH MEGATRON-LM'S OWN CODE: megatron-core's ``GPTModel`` (local layer
spec, CPU, float64) with ``position_embedding_type="yarn"`` on grouped-query attention (gpt-oss's YaRN), whose
logits, per-token losses, gradients, rotary angles and concentration factor omnitron's GPT must reproduce
(tests/models/test_gpt_yarn_megatron.py).

Needs megatron-core (the Megatron-LM d98e8a6 snapshot was used) on the path; CPU, offline, one process, seconds:

    PYTHONPATH=/path/to/Megatron-LM python tests/models/megatron_gpt_yarn/make_fixtures.py

omnitron is not imported. Each case sets the ``yarn_*`` config attributes as Megatron's
``_apply_yarn_config_from_args`` (megatron/training/argument_utils.py) sets them from ``--rotary-scaling-factor``,
``--yarn-original-max-position-embeddings``, ``--yarn-beta-fast/-slow``, ``--mscale``, ``--mscale-all-dim`` and
``--[no-]yarn-correction-range-round-to-int`` (its defaults for the ones a case leaves out). The model, weights
and run are those of ../megatron_gpt_flags/make_fixtures.py (imported from there; 2 layers, hidden 16, 4 heads in
2 query groups, SwiGLU, RMSNorm), with ``kv_channels`` 16 so that 8 channel pairs span YaRN's ramp.
"""
from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "megatron_gpt_flags"))
import make_fixtures as flags_fixtures  # noqa: E402  (megatron-core's GPT of one flag set; no omnitron)

YARN_DEFAULTS = dict(yarn_rotary_scaling_factor=1.0, yarn_original_max_position_embeddings=4096, yarn_beta_fast=32.0,
                     yarn_beta_slow=1.0, yarn_mscale=1.0, yarn_mscale_all_dim=0.0,
                     yarn_correction_range_round_to_int=True)
"""``_apply_yarn_config_from_args``'s values when a flag is not given."""
MODEL = dict(flags_fixtures.LLAMA, position_embedding_type="yarn", kv_channels=16)
CASES = {  # name -> (yarn settings beyond the defaults, rotary base, seed)
    # base 1e4, 4096 positions: the ramp runs over pairs 2 .. 6 of 8; concentration 0.1 ln 4 + 1
    "factor_4_defaults": (dict(yarn_rotary_scaling_factor=4.0), 10000, 31),
    # gpt-oss's shape: fractional ramp ends (HF truncate false), its betas, a short original context
    "factor_32_orig_64_fractional": (dict(yarn_rotary_scaling_factor=32.0, yarn_original_max_position_embeddings=64,
                                          yarn_beta_fast=16.0, yarn_beta_slow=2.0,
                                          yarn_correction_range_round_to_int=False), 500, 32),
    # concentration m(8, 0.707) / m(8, 1) != 1 and != m(8, 1)
    "factor_8_mscale_0707_all_dim_1": (dict(yarn_rotary_scaling_factor=8.0, yarn_mscale=0.707,
                                            yarn_mscale_all_dim=1.0), 150000, 33),
    # concentration exactly 1 while m(40, mscale_all_dim)^2 = 1.87: the softmax scale must stay 1/sqrt(d)
    "factor_40_mscale_equal_all_dim": (dict(yarn_rotary_scaling_factor=40.0, yarn_mscale=1.0, yarn_mscale_all_dim=1.0,
                                            yarn_original_max_position_embeddings=256), 10000, 34),
    # both ramp ends clamp to the same pair (low == high): Megatron's +0.001 guard
    "factor_2_zero_width_ramp": (dict(yarn_rotary_scaling_factor=2.0, yarn_original_max_position_embeddings=4,
                                      yarn_beta_fast=2.0, yarn_beta_slow=1.0), 10000, 35),
    # factor 1: plain RoPE (inter == extra, concentration 1)
    "factor_1_is_plain_rope": (dict(yarn_beta_fast=8.0), 10000, 36),
}


def build(yarn: dict, base: float):
    """megatron-core's GPTModel of the case: the config with its ``yarn_*`` attributes, then the model."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cfg = flags_fixtures.config(MODEL)
    for k, v in {**YARN_DEFAULTS, **yarn}.items():
        setattr(cfg, k, v)
    spec = get_gpt_layer_local_spec(qk_layernorm=False, normalization=cfg.normalization)
    return GPTModel(cfg, spec, vocab_size=flags_fixtures.V, max_sequence_length=flags_fixtures.S,
                    position_embedding_type="yarn", rotary_base=base,
                    share_embeddings_and_output_weights=False).double()


def main() -> None:
    from megatron.core import parallel_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(20000 + os.getpid() % 20000))
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    flags_fixtures.cpu_stand_ins()
    parallel_state.initialize_model_parallel(1, 1)
    out = {}
    for name, (yarn, base, seed) in CASES.items():
        model = build(yarn, base).train()
        data = flags_fixtures.draw(model, MODEL, seed)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(data["weights"][n].double())
        emb, concentration = model.rotary_pos_emb(flags_fixtures.S)
        attention = model.decoder.layers[0].self_attention
        assert attention._yarn_concentration_factor == concentration
        out[name] = {"flags": dict(MODEL, rotary_base=base), "yarn": {**YARN_DEFAULTS, **yarn},
                     "base": flags_fixtures.BASE, **data, **flags_fixtures.run(model, data),
                     "angles": emb[:, 0, 0, : emb.shape[-1] // 2].double(), "concentration": float(concentration),
                     "softmax_scale": float(attention.core_attention.softmax_scale)}
    torch.save(out, os.path.join(HERE, "fixtures.pt"))


if __name__ == "__main__":
    main()
