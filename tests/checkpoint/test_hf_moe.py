"""Hugging Face DeepSeek-V3, gpt-oss and Qwen3-MoE layouts against ``transformers`` itself, both directions, in
float64 (Qwen3-MoE: QK-norm, a dense first layer, 4 softmax-routed experts).

Import: a tiny random ``DeepseekV3ForCausalLM`` (MLA with q and kv ranks, a dense first layer, 8 sigmoid-routed
experts in 4 groups with a shared expert, routed scaling 2.5; plain RoPE and YaRN with each way transformers
derives its scales; top-1 routing on the raw score; no shared expert) or ``GptOssForCausalLM`` (GQA
with biases, sinks, a 4-token window on alternate layers, 4 experts with the clamped GeGLU, router bias), every
weight random, is saved with ``save_pretrained`` and imported with ``import_hf``; omnitron's forward on the
imported checkpoint gives transformers' logits on random tokens. Export: an omnitron model of each layout, every
weight random, converted with ``config_to_hf`` / ``state_to_hf``, loads into the transformers class strictly and
gives omnitron's logits. Qwen3-MoE with YaRN likewise. What omnitron cannot build is refused in one line.

Tolerance: both routers compute their logits in float32 (HF gpt-oss's in float64), from float64 hidden states
that round to float32 independently: one ulp (6e-8 relative) of router logits of size O(3) moves a routing weight
by ~2e-7, times the routed scaling 2.5 and through two layers and the unembedding (gain ~3): ~1.5e-6 of the
logits' maximum at worst, observed 1.3e-6 (a top-1 pick's raw sigmoid weight moves by the same ~2e-7). YaRN's
--mscale where transformers derives it otherwise is solved from its scales in float64: 1e-16. Everything else is
float64 (1e-14). Bound: 5e-6 (a wrong head split, rope channel, gate/up order, clamp, YaRN scale or top-1 weight
moves the logits by O(0.1)); a routing near-tie could flip a choice, so the
random weights are scaled up (std 0.3) to keep the routers' logits apart.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from omnitron.backends import get_backend  # noqa: E402
from omnitron.core.checkpoint.hf import (HFConversionError, config_from_hf, config_to_hf, import_hf,  # noqa: E402
                                         state_to_hf)
from omnitron.core.checkpoint.reshard import Layout, model_config, read_full_state  # noqa: E402
from omnitron.core.models.gpt import GPTModel, gather_full_state  # noqa: E402
from omnitron.core.models.gpt.state import shard_full_state  # noqa: E402
from omnitron.core.parallel.groups import ParallelGroups  # noqa: E402

V = 96
TOL = 5e-6

def _yarn(**kw) -> dict:
    """YaRN over a 16-position original context (the 12 test positions reach its interpolated channels)."""
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, **kw}


HF_CONFIGS = {
    "deepseek_v3": lambda **kw: transformers.DeepseekV3Config(**{
        "vocab_size": V, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
        "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 8,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 8, "q_lora_rank": 12, "qk_rope_head_dim": 4, "v_head_dim": 6,
        "qk_nope_head_dim": 6, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4, "first_k_dense_replace": 1,
        "norm_topk_prob": True, "max_position_embeddings": 64, "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0, "num_hidden_layers": 2, **kw}),
    "deepseek_v3_yarn": lambda: HF_CONFIGS["deepseek_v3"](rope_parameters=_yarn(mscale=1.0, mscale_all_dim=1.0)),
    # transformers takes mscale / mscale_all_dim's ratio only when both are set, else m(factor, 1); MLA's softmax
    # scale still takes mscale_all_dim; an explicit attention_factor replaces the ratio
    "deepseek_v3_yarn_mscale_all_dim_only": lambda: HF_CONFIGS["deepseek_v3"](
        rope_parameters=_yarn(mscale_all_dim=1.0)),
    "deepseek_v3_yarn_mscale_only": lambda: HF_CONFIGS["deepseek_v3"](rope_parameters=_yarn(mscale=0.707)),
    "deepseek_v3_yarn_attention_factor": lambda: HF_CONFIGS["deepseek_v3"](
        rope_parameters=_yarn(attention_factor=1.3, mscale_all_dim=0.5)),
    # top-1: the pick weighted by its raw score (transformers' norm_topk_prob=false is omnitron's top-1 routing)
    "deepseek_v3_top1": lambda: HF_CONFIGS["deepseek_v3"](num_experts_per_tok=1, n_group=1, topk_group=1,
                                                          norm_topk_prob=False),
    # no shared experts (transformers saves zero-size shared-expert tensors)
    "deepseek_v3_no_shared": lambda: HF_CONFIGS["deepseek_v3"](n_shared_experts=0),
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
    "qwen3_moe_yarn": lambda: transformers.Qwen3MoeConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[0], max_position_embeddings=64, tie_word_embeddings=False,
        rope_parameters=_yarn(mscale_all_dim=1.0)),
    "qwen3_moe_window": lambda: transformers.Qwen3MoeConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[0], max_position_embeddings=64, tie_word_embeddings=False,
        use_sliding_window=True, sliding_window=4),
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
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float64,
                                                       experts_implementation="eager").eval()
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
    _check_export(config_from_hf(HF_CONFIGS[name]().to_dict()), tmp_path)


@pytest.mark.parametrize("name, scales", [("deepseek_v3_yarn", dict(mscale=0.707, mscale_all_dim=0.0)),
                                          ("deepseek_v3_yarn", dict(mscale=0.0, mscale_all_dim=1.0)),
                                          ("qwen3_moe_yarn", dict(mscale=0.707, mscale_all_dim=0.0))])
def test_export_of_yarn_scales_transformers_does_not_derive(name, scales, tmp_path):
    """--mscale without --mscale-all-dim (or the reverse) scales omnitron's rotated parts by m(mscale) /
    m(mscale_all_dim); transformers would take m(factor, 1) from those fields, so the export writes the factor as
    attention_factor: the same logits, MLA (whose softmax scale keeps mscale_all_dim) and grouped-query attention."""
    import dataclasses

    cfg = dataclasses.replace(config_from_hf(HF_CONFIGS[name]().to_dict()), **scales)
    _check_export(cfg, tmp_path)


def _check_export(cfg, tmp_path) -> None:
    """A random omnitron model of ``cfg`` exported (config_to_hf, state_to_hf) loads strictly in transformers and
    gives omnitron's logits."""
    import json

    from safetensors.torch import save_file

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


# DeepSeek-V3's MTP layer and a trained routing bias. transformers builds no MTP module (it ignores layer 61 of the
# released checkpoint), so the MTP layer's tensors are made by transformers' own DeepseekV3DecoderLayer and RMSNorm
# (layer index num_hidden_layers, as the released files name it) and appended to the saved weights; the reference
# MTP loss runs those modules on transformers' final hidden states. Tolerance: the routers' float32 logits as
# above (the MTP layer adds one MoE layer and one head: the same bound).
def _hf_mtp_modules(hf, seed: int, tmp):
    """transformers' modules of one MTP depth and their tensors under the released names: the decoder layer is
    layer ``num_hidden_layers`` of a one-layer-deeper model of the same config, saved by ``save_pretrained``
    (its own expert layout)."""
    from safetensors.torch import load_file
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    c, h = hf.config, hf.config.hidden_size
    deeper = transformers.AutoModelForCausalLM.from_config(
        HF_CONFIGS["deepseek_v3"](num_hidden_layers=c.num_hidden_layers + 1), dtype=torch.float64,
        experts_implementation="eager").eval()
    _randomize(deeper, seed)
    L = f"model.layers.{c.num_hidden_layers}."
    with torch.no_grad():
        deeper.model.layers[-1].mlp.gate.e_score_correction_bias.copy_(torch.randn(c.n_routed_experts) * 0.1)
    deeper.save_pretrained(tmp)
    state = {k: t for k, t in load_file(str(tmp / "model.safetensors")).items() if k.startswith(L)}
    mods = torch.nn.ModuleDict({"enorm": DeepseekV3RMSNorm(h, c.rms_norm_eps),
                                "hnorm": DeepseekV3RMSNorm(h, c.rms_norm_eps),
                                "eh_proj": torch.nn.Linear(2 * h, h, bias=False),
                                "norm": DeepseekV3RMSNorm(h, c.rms_norm_eps)}).double()
    _randomize(mods, seed + 1)
    mods["layer"] = deeper.model.layers[-1]
    state.update({L + "enorm.weight": mods["enorm"].weight, L + "hnorm.weight": mods["hnorm"].weight,
                  L + "eh_proj.weight": mods["eh_proj"].weight, L + "shared_head.norm.weight": mods["norm"].weight,
                  L + "embed_tokens.weight": hf.model.embed_tokens.weight,
                  L + "shared_head.head.weight": hf.lm_head.weight})
    return mods, {k: t.detach().clone().contiguous() for k, t in state.items()}


def _hf_mtp_loss(hf, mods, tokens, lam: float) -> torch.Tensor:
    """lambda x the depth-1 loss: eh_proj([enorm(Emb(t_{i+1})) ; hnorm(h_i)]) through the layer and the head,
    CE against t_{i+2}, the last two positions masked (omnitron's labels are the tokens shifted by one)."""
    b, s = tokens.shape
    with torch.no_grad():
        hidden = hf.model(tokens).last_hidden_state
        nxt = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], 1)
        x = mods["eh_proj"](torch.cat([mods["enorm"](hf.model.embed_tokens(nxt)), mods["hnorm"](hidden)], -1))
        pos = torch.arange(s).expand(b, s)
        mask = torch.full((s, s), float("-inf"), dtype=torch.float64).triu(1).expand(b, 1, s, s)
        y = mods["layer"](x, attention_mask=mask, position_ids=pos, position_embeddings=hf.model.rotary_emb(x, pos))
        y = y[0] if isinstance(y, tuple) else y
        logits = hf.lm_head(mods["norm"](y))[:, : s - 2]
        return lam * torch.nn.functional.cross_entropy(logits.reshape(-1, V), tokens[:, 2:].reshape(-1))


def test_deepseek_mtp_layer_and_routing_bias_import(tmp_path):
    """The MTP layer (enorm, hnorm, eh_proj, its decoder layer, shared_head) and non-zero
    e_score_correction_bias in every MoE layer import: the logits and the MTP loss are transformers'."""
    from safetensors.torch import load_file, save_file

    from omnitron.core.checkpoint.io import read_shard

    hf = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS["deepseek_v3"](num_nextn_predict_layers=1),
                                                       dtype=torch.float64, experts_implementation="eager").eval()
    _randomize(hf, 5)
    with torch.no_grad():
        hf.model.layers[1].mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.1)
    hf.save_pretrained(tmp_path / "hf")
    mods, mtp_state = _hf_mtp_modules(hf, 6, tmp_path / "deeper")
    weights = tmp_path / "hf" / "model.safetensors"
    save_file({**load_file(str(weights)), **mtp_state}, str(weights), metadata={"format": "pt"})
    path = import_hf(str(tmp_path / "hf"), str(tmp_path / "omni"), Layout())
    cfg = config_from_hf(hf.config.to_dict())
    assert cfg.mtp_num_layers == 1
    model = GPTModel(cfg, ParallelGroups.single(), backend=get_backend("cpu"))
    model.load_state_dict(read_shard(path, 0)["model"][0])
    biases = {n: b for n, b in model.named_buffers() if n.endswith("expert_bias")}
    assert sorted(biases) == ["decoder.layers.1.mlp.router.expert_bias",
                              "mtp.layers.0.transformer_layer.mlp.router.expert_bias"]
    assert all(b.abs().min() > 0 for b in biases.values())
    from omnitron.core.checkpoint.reshard import read_full_state

    full = read_full_state(path, with_optimizer=False)  # what export-hf / export-megatron read back from disk
    assert all(torch.equal(full.model[n], b) for n, b in biases.items())
    back = state_to_hf(full.model, cfg)["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert torch.equal(back.to(torch.float64), hf.model.layers[1].mlp.gate.e_score_correction_bias.double())
    tokens = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(7))
    _close(_omni_logits(model.eval(), tokens), _hf_logits(hf, tokens))
    labels = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], 1)
    mask = torch.ones_like(tokens, dtype=torch.float64)
    mask[:, -1] = 0
    model(tokens=tokens, labels=labels, loss_mask=mask)  # grad enabled: the MTP loss is computed and kept
    ref = _hf_mtp_loss(hf, mods, tokens, cfg.mtp_loss_scaling_factor)
    assert abs(model.mtp.loss_total.item() - ref.item()) < TOL * ref.item(), (model.mtp.loss_total, ref)
    with torch.no_grad():  # the MTP copies of the embedding and head must be the shared ones
        hf.lm_head.weight.add_(1.0)
    hf.save_pretrained(tmp_path / "hf2")
    save_file({**load_file(str(tmp_path / "hf2" / "model.safetensors")), **mtp_state},
              str(tmp_path / "hf2" / "model.safetensors"), metadata={"format": "pt"})
    from omnitron.core.checkpoint.hf import HFConversionError

    with pytest.raises(HFConversionError, match="shared_head.head.weight differs from lm_head.weight"):
        import_hf(str(tmp_path / "hf2"), str(tmp_path / "omni2"), Layout())


def test_deepseek_mtp_layer_and_routing_bias_export(tmp_path):
    """The export writes the MTP layer under the released names and the routers' expert bias: transformers
    loads the main model (logits equal; only layer num_hidden_layers is left unused, which it builds no module
    for) and the import of the exported files gives back every tensor and buffer exactly."""
    import json

    from safetensors.torch import save_file

    from omnitron.core.checkpoint.io import read_shard

    cfg = config_from_hf(HF_CONFIGS["deepseek_v3"](num_nextn_predict_layers=1).to_dict())
    model = GPTModel(cfg, ParallelGroups.single(), backend=get_backend("cpu")).eval()
    _randomize(model, 8)
    full = gather_full_state(model, ParallelGroups.single())
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("expert_bias"):
                b.copy_(torch.randn(b.shape) * 0.1)
                full[n] = b.clone()
    save_file(state_to_hf(full, cfg), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(cfg)))
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float64, experts_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert info["unexpected_keys"] and all(k.startswith("model.layers.2.") for k in info["unexpected_keys"])
    tokens = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(9))
    _close(_hf_logits(hf.eval(), tokens), _omni_logits(model, tokens))
    back = read_shard(import_hf(str(tmp_path), str(tmp_path / "omni"), Layout()), 0)["model"][0]
    ours = model.state_dict()
    assert sorted(back) == sorted(ours)
    for n, t in ours.items():  # the vocabulary's padding rows are not exported (zeros on import)
        rows = V if n in ("embedding.word_embeddings.weight", "output_layer.weight") else None
        assert torch.equal(back[n][:rows], t[:rows]), n


def _saved(name: str, tmp_path, **kw):
    """A random float64 transformers model of HF_CONFIGS[name] (``kw`` over its fields), saved under tmp/hf."""
    hf = transformers.AutoModelForCausalLM.from_config(HF_CONFIGS[name](**kw) if kw else HF_CONFIGS[name](),
                                                       dtype=torch.float64, experts_implementation="eager").eval()
    _randomize(hf, 11)
    hf.save_pretrained(tmp_path / "hf")
    return hf


_REFUSED = {
    "deepseek_top1_norm": (lambda: HF_CONFIGS["deepseek_v3"](num_experts_per_tok=1, n_group=1, topk_group=1,
                                                             norm_topk_prob=True),
     r"norm_topk_prob=True with num_experts_per_tok=1 is not supported: transformers then weights the one pick by "
                           r"routed_scaling_factor alone"),
    "deepseek_top1_norm_default": (  # DeepseekV3Config's default norm_topk_prob is true
        lambda: {k: v for k, v in HF_CONFIGS["deepseek_v3_top1"]().to_dict().items() if k != "norm_topk_prob"},
        r"norm_topk_prob=True with num_experts_per_tok=1"),
    "deepseek_eps": (lambda: HF_CONFIGS["deepseek_v3"](rms_norm_eps=1e-5),
                     r"rms_norm_eps=1e-05 is not supported: transformers builds DeepSeek-V3's latent norms .* "
                     r"eps 1e-6"),
    "qwen3_moe_attention_bias": (lambda: {**HF_CONFIGS["qwen3_moe"]().to_dict(), "attention_bias": True},
                                 r"attention_bias=True is not supported: Qwen3-MoE then biases q, k, v and o_proj but "
                                 r"not its MLPs"),
}


@pytest.mark.parametrize("name", sorted(_REFUSED))
def test_configs_omnitron_cannot_build_are_refused_in_one_line(name):
    """What omnitron's model cannot compute is refused with the reason, before any weight is read: transformers'
    top-1 routing with norm_topk_prob (a constant weight), DeepSeek-V3's latent norms at eps 1e-6 while the others
    use another rms_norm_eps, Qwen3-MoE's attention biases (q, k, v and o_proj; no MLP bias)."""
    hf_config, match = _REFUSED[name]
    cfg = hf_config()
    with pytest.raises(HFConversionError, match=match) as err:
        config_from_hf(cfg if isinstance(cfg, dict) else cfg.to_dict())
    assert "\n" not in str(err.value)


def test_deepseek_mtp_layers_without_weights_import_the_main_model(tmp_path, capsys):
    """DeepseekV3Config names one MTP layer by default, but transformers saves none: the import takes the main
    model, says so in one line, and gives transformers' logits."""
    from omnitron.cli import main as cli

    hf = _saved("deepseek_v3", tmp_path, num_nextn_predict_layers=1)
    assert hf.config.num_nextn_predict_layers == 1
    assert cli(["checkpoint", "import-hf", "--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "omni")]) == 0
    notes = [x for x in capsys.readouterr().out.splitlines() if x.startswith("note:")]
    assert len(notes) == 1 and "num_nextn_predict_layers" in notes[0] and "without MTP" in notes[0], notes
    full = read_full_state(str(tmp_path / "omni" / "iter_0000000"), with_optimizer=False)
    cfg = model_config(full.meta["model"])
    assert not cfg.mtp_num_layers and not any(n.startswith("mtp.") for n in full.model)
    model = GPTModel(cfg, ParallelGroups.single(), backend=get_backend("cpu")).eval()
    shard_full_state(model, full.model, ParallelGroups.single())
    tokens = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(12))
    _close(_omni_logits(model, tokens), _hf_logits(hf, tokens))


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_no_shared"])
def test_deepseek_import_then_export_gives_back_the_saved_file(name, tmp_path):
    """Every tensor transformers saved comes back with its dtype and value: the router's ``gate.weight`` in
    float32 (transformers keeps it so), the zero-size shared experts of ``n_shared_experts`` 0."""
    from safetensors.torch import load_file

    from omnitron.core.checkpoint.hf import export_hf

    _saved(name, tmp_path)
    export_hf(import_hf(str(tmp_path / "hf"), str(tmp_path / "omni"), Layout()), str(tmp_path / "out"))
    a, b = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    assert a["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    for n, t in a.items():
        assert b[n].dtype == t.dtype and torch.equal(b[n], t), n


@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_deepseek_export_warns_of_the_latent_norms_epsilon(eps, tmp_path, capsys):
    """transformers gives DeepSeek-V3's latent norms eps 1e-6 whatever rms_norm_eps says: an MLA model with
    another --norm-epsilon is exported (rms_norm_eps is its epsilon) with one warning line on stderr naming both."""
    import dataclasses
    import json

    from omnitron.cli import main as cli
    from omnitron.core.checkpoint.hf import write_weights_checkpoint

    cfg = dataclasses.replace(config_from_hf(HF_CONFIGS["deepseek_v3"]().to_dict()), layernorm_epsilon=eps)
    model = GPTModel(cfg, ParallelGroups.single(), backend=get_backend("cpu"))
    write_weights_checkpoint(gather_full_state(model, ParallelGroups.single()), cfg, str(tmp_path / "ck"), Layout(),
                             config={"tokenizer_type": "NullTokenizer", "vocab_size": V - 1})
    assert cli(["checkpoint", "export-hf", "--load", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]) == 0
    warnings = [x for x in capsys.readouterr().err.splitlines() if "warning:" in x]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["rms_norm_eps"] == eps
    if eps == 1e-6:
        assert not warnings
        return
    assert len(warnings) == 1 and "--norm-epsilon 1e-05" in warnings[0] and "eps 1e-6" in warnings[0], warnings
    assert "q_a_layernorm" in warnings[0] and "kv_a_layernorm" in warnings[0]


def test_gpt_oss_experts_stack_in_numeric_order():
    """Ten or more experts: stacking follows the expert number (0, 1, 2, ..., 10, 11), not its text, and
    unstacking gives each expert's own tensor back (reference: torch.stack of the per-expert tensors in order)."""
    from omnitron.core.checkpoint.hf_moe import stack_gpt_oss_experts, unstack_gpt_oss_experts

    per = {e: torch.randn(2, 3, dtype=torch.float64) for e in range(12)}
    name = "model.layers.0.mlp.experts.{}.down_proj"
    stacked = stack_gpt_oss_experts({name.format(e): t for e, t in sorted(per.items(), key=lambda kv: -kv[0])})
    assert torch.equal(stacked["model.layers.0.mlp.experts.down_proj"], torch.stack([per[e] for e in range(12)]))
    back = unstack_gpt_oss_experts(stacked)
    assert all(torch.equal(back[name.format(e)], per[e]) for e in range(12))
