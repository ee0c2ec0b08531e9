"""YaRN on grouped-query attention (gpt-oss's) under Megatron's spelling, against megatron-core's own ``GPTModel``
with ``position_embedding_type="yarn"`` (its ``YarnRotaryEmbedding``; tests/models/megatron_gpt_yarn/fixtures.pt,
written by its make_fixtures.py with the Megatron-LM d98e8a6 snapshot, local spec, float64 on CPU): omnitron's
model of the command line ``--position-embedding-type yarn --rotary-scaling-factor F
--yarn-original-max-position-embeddings N --yarn-beta-fast A --yarn-beta-slow B --mscale M --mscale-all-dim D
[--no-yarn-correction-range-round-to-int]`` has megatron-core's rotary angles, concentration factor (which
megatron-core folds into cos / sin, on q and k), softmax scale (1/sqrt(d): without MLA neither side scales it),
logits, per-token losses and gradients, over six settings (defaults at factor 4; gpt-oss's fractional ramp;
mscale != mscale_all_dim; mscale == mscale_all_dim at factor 40; a zero-width ramp; factor 1).

Megatron's ``rope`` without MLA ignores --rotary-scaling-factor (GPTModel builds the plain RotaryEmbedding), so
omnitron refuses that combination in one line naming ``yarn``; a Megatron checkpoint's args import as Megatron
built them; an omnitron checkpoint saved when ``rope`` + the factor meant YaRN still resumes and loads.

Tolerances: the model's (1e-5) is test_gpt_flags_megatron.py's error analysis (same weights, float64 kernels; not
float64: the rotary angles, omnitron's cross-entropy and the stored float32 outputs; 5e-7 the worst seen). The
angles: megatron-core's inverse frequencies are float32 (power, division by the factor, the ramp's blend: up to
5 roundings of 6e-8) times float32 positions (one more), omnitron's float64 rounded once to float32: 4e-7 bounds
their norm-wise relative difference (2e-8 seen). A wrong ramp end, factor or concentration moves them by 1e-3+.
"""
from __future__ import annotations

import dataclasses
import math
import os
import random

import pytest
import torch

from omnitron.core.config.parallel import ConfigError
from omnitron.core.training.arguments import parse_settings
from omnitron.testing.parity import relative_error
from tests.models.test_gpt_flags_megatron import TOL, config_of, run_omnitron

FIXTURES = torch.load(os.path.join(os.path.dirname(__file__), "megatron_gpt_yarn", "fixtures.pt"), weights_only=True)
BASE = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4", "--seq-length", "12",
        "--micro-batch-size", "1", "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "31"]
YARN = ("position_embedding_type", "rotary_base", "rotary_scaling_factor", "mscale", "mscale_all_dim",
        "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
        "yarn_correction_range_round_to_int")


def yarn_flags(fx: dict) -> list[str]:
    """The Megatron command line of a case's YaRN settings (the flags ``_apply_yarn_config_from_args`` reads)."""
    y = fx["yarn"]
    flags = ["--position-embedding-type", "yarn", "--rotary-base", str(fx["flags"]["rotary_base"]),
             "--rotary-scaling-factor", str(y["yarn_rotary_scaling_factor"]), "--mscale", str(y["yarn_mscale"]),
             "--mscale-all-dim", str(y["yarn_mscale_all_dim"]),
             "--yarn-original-max-position-embeddings", str(y["yarn_original_max_position_embeddings"]),
             "--yarn-beta-fast", str(y["yarn_beta_fast"]), "--yarn-beta-slow", str(y["yarn_beta_slow"])]
    return flags + ([] if y["yarn_correction_range_round_to_int"] else ["--no-yarn-correction-range-round-to-int"])


def config_of_case(fx: dict):
    """omnitron's GPTConfig of a case: its YaRN settings as the command line parses them, the rest as
    test_gpt_flags_megatron.py builds megatron-core's model shape."""
    V, S = fx["logits"].shape[-1], fx["tokens"].shape[1]
    cli = parse_settings(BASE + yarn_flags(fx), 1).model
    return dataclasses.replace(config_of(dict(fx["flags"], position_embedding_type="rope"), fx["base"], V, S),
                               **{k: getattr(cli, k) for k in YARN})


@pytest.mark.parametrize("case", sorted(FIXTURES))
def test_yarn_gqa_equals_megatron_core(case):
    fx = FIXTURES[case]
    cfg = config_of_case(fx)
    assert cfg.position_embedding_type == "yarn"
    out, grads = run_omnitron(fx, cfg)
    S = fx["tokens"].shape[1]
    angles = torch.arange(S, dtype=torch.float64)[:, None] * out["inv_freq"].double()
    assert relative_error(angles, fx["angles"]) < 4e-7  # float32 roundings (docstring)
    from omnitron.core.models.gpt import GPTModel
    from omnitron.core.parallel.groups import ParallelGroups

    attention = GPTModel(cfg, ParallelGroups.single()).decoder.layers["0"].self_attention
    assert attention.rope_factor == pytest.approx(fx["concentration"], rel=1e-15)
    assert fx["softmax_scale"] == 1 / math.sqrt(16)  # megatron-core's: m(s, mscale_all_dim) not applied
    errs = {"loss": relative_error(out["loss"], fx["loss"]), "logits": relative_error(out["logits"], fx["logits"])}
    errs.update({n: relative_error(g, fx["grads"][n]) for n, g in grads.items()})
    assert max(errs.values()) < TOL, sorted(errs.items(), key=lambda kv: -kv[1])[:3]


def test_rope_with_a_scaling_factor_is_refused_naming_yarn():
    """Megatron's rope (and learned_absolute, none) without MLA never reads --rotary-scaling-factor: refused in one
    line naming yarn, before any work; MLA's YaRN is its --rope-type, so MLA with yarn is refused too."""
    factor = random.choice([2.0, 4.0, 32.0])
    for kind in ("rope", "learned_absolute", "none"):
        with pytest.raises(ConfigError, match=f"--rotary-scaling-factor {factor} with --position-embedding-type "
                                              f"{kind}: .*give yarn for YaRN") as info:
            parse_settings(BASE + ["--position-embedding-type", kind, "--rotary-scaling-factor", str(factor)], 1)
        assert "\n" not in str(info.value)
    mla = ["--normalization", "RMSNorm", "--multi-latent-attention", "--kv-lora-rank", "8", "--qk-head-dim", "8",
           "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--rotary-scaling-factor", str(factor)]
    assert parse_settings(BASE + mla + ["--position-embedding-type", "rope"], 1).model.rotary_scaling_factor == factor
    with pytest.raises(ConfigError, match="yarn with --multi-latent-attention: MLA's YaRN is --rope-type yarn"):
        parse_settings(BASE + mla + ["--position-embedding-type", "yarn"], 1)
    plain = parse_settings(BASE + ["--position-embedding-type", "rope"], 1).model
    assert plain.rotary_scaling_factor == 1.0
    yarn = BASE + ["--position-embedding-type", "yarn", "--rotary-scaling-factor", str(factor)]
    for extra, flag in ((["--rotary-interleaved"], "--rotary-interleaved"), (["--rotary-percent", "0.5"],
                        "--rotary-percent"), (["--use-rope-scaling"], "--rope-scaling-factor")):
        with pytest.raises(ConfigError, match=f"yarn with {flag}: Megatron's YarnRotaryEmbedding .* drop {flag}$"):
            parse_settings(yarn + extra, 1)


def test_megatron_args_import_as_megatron_builds_them():
    """A Megatron run's args: ``yarn`` imports with its --rotary-scaling-factor / --mscale* / --yarn-* values;
    ``rope`` with a recorded --rotary-scaling-factor is the plain RoPE Megatron trained (the factor dropped)."""
    from omnitron.core.checkpoint.megatron import config_from_megatron
    from omnitron.core.models.gpt.config import rope_inv_freq

    fx = FIXTURES["factor_32_orig_64_fractional"]
    y = fx["yarn"]
    args = dict(num_layers=2, hidden_size=16, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
                kv_channels=16, seq_length=12, normalization="RMSNorm", swiglu=True, ffn_hidden_size=24,
                add_bias_linear=False,
                rotary_base=fx["flags"]["rotary_base"], rotary_scaling_factor=y["yarn_rotary_scaling_factor"],
                mscale=y["yarn_mscale"], mscale_all_dim=y["yarn_mscale_all_dim"],
                **{k: y[k] for k in ("yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
                                     "yarn_correction_range_round_to_int")})
    yarn = config_from_megatron(dict(args, position_embedding_type="yarn"), vocab_size=32, dtype=torch.float64)
    want = config_of_case(fx)
    assert {k: getattr(yarn, k) for k in YARN} == {k: getattr(want, k) for k in YARN}
    S = fx["tokens"].shape[1]
    assert relative_error(torch.arange(S)[:, None] * rope_inv_freq(yarn).double(), fx["angles"]) < 4e-7
    rope = config_from_megatron(dict(args, position_embedding_type="rope"), vocab_size=32, dtype=torch.float64)
    assert rope.position_embedding_type == "rope" and rope.rotary_scaling_factor == 1.0
    plain = 1.0 / fx["flags"]["rotary_base"] ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    assert relative_error(rope_inv_freq(rope).double(), plain) < 1e-7  # one float32 rounding (YaRN's: / 32)


def test_checkpoint_saved_with_rope_spelling_still_loads():
    """An omnitron checkpoint's metadata written when rope + --rotary-scaling-factor meant YaRN: the shape check
    and the settings check take it as this run's yarn; a plain rope run differs in the scaling factor."""
    from omnitron.core.checkpoint import CheckpointError
    from omnitron.core.checkpoint.io import check_compatible
    from omnitron.core.models.gpt.presets import gpt_oss_20b
    from omnitron.core.training.checkpoint_args import saved_position_type
    from omnitron.core.training.checkpointing import model_dict
    from omnitron.core.training.model_check import check_model_settings

    now = model_dict(gpt_oss_20b(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                 kv_channels=16, ffn_hidden_size=64, moe_ffn_hidden_size=64, num_experts=4))
    saved = dict(now, position_embedding_type="rope")
    assert now["position_embedding_type"] == "yarn" and saved_position_type(saved) == "yarn"
    layout = {"expert_tensor_parallel_size": 1}
    assert check_compatible({"model": saved, "layout": layout}, now, layout, "D") == []
    assert check_model_settings(saved, now, "D") == []
    plain = dict(now, position_embedding_type="rope", rotary_scaling_factor=1.0)
    with pytest.raises(CheckpointError, match="--rotary-scaling-factor checkpoint 1.0, this run 32.0"):
        check_model_settings(plain, now, "D")


def test_use_checkpoint_args_takes_an_old_rope_spelling_as_yarn(monkeypatch):
    """--use-checkpoint-args of a checkpoint whose metadata says rope + --rotary-scaling-factor 32 (omnitron's
    YaRN before ``yarn`` was taken) builds the yarn model it trained, not a refusal."""
    from omnitron.core.checkpoint import io
    from omnitron.core.training import checkpoint_args

    saved = dict(position_embedding_type="rope", rotary_scaling_factor=32.0, num_layers=2)
    monkeypatch.setattr(checkpoint_args, "_resumed", lambda merged: "D/iter_0000001")
    monkeypatch.setattr(io, "read_metadata", lambda path: {"model": saved})
    out = checkpoint_args.apply_checkpoint_args({"use_checkpoint_args": True, "load": "D"})
    assert out["position_embedding_type"] == "yarn" and out["rotary_scaling_factor"] == 32.0
    mla = dict(saved, multi_latent_attention=True)
    monkeypatch.setattr(io, "read_metadata", lambda path: {"model": mla})
    assert checkpoint_args.apply_checkpoint_args({"use_checkpoint_args": True, "load": "D"})[
        "position_embedding_type"] == "rope"  # MLA's YaRN is its own (--rope-type)


def test_export_to_megatron_writes_the_args_megatron_reads():
    """Megatron's args of a yarn model carry what ``_apply_yarn_config_from_args`` reads (position_embedding_type,
    rotary_scaling_factor, mscale, mscale_all_dim, yarn_original_max_position_embeddings, yarn_beta_fast,
    yarn_beta_slow, yarn_correction_range_round_to_int) with the model's values, and import back to the same model;
    the export is not refused (it was, when the args said plain RoPE)."""
    from omnitron.core.checkpoint.megatron import _check_exportable, args_for, config_from_megatron

    for fx in FIXTURES.values():
        cfg = dataclasses.replace(config_of_case(fx), vocab_size=64, params_dtype=torch.float32)
        _check_exportable(cfg, 1, 1, "local")
        args = vars(args_for(cfg, 1, 1, 0, {}, "local"))
        y = fx["yarn"]
        read = dict(position_embedding_type="yarn", rotary_scaling_factor=y["yarn_rotary_scaling_factor"],
                    mscale=y["yarn_mscale"], mscale_all_dim=y["yarn_mscale_all_dim"],
                    **{k: y[k] for k in ("yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
                                         "yarn_correction_range_round_to_int")})
        assert {k: args[k] for k in read} == read
        assert config_from_megatron(args, vocab_size=64, dtype=torch.float32) == cfg
