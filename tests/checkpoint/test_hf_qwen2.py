"""Hugging Face Qwen2 (``Qwen2ForCausalLM``: q/k/v biases, none on o_proj or the MLP) against ``transformers``,
both directions, in float64: Megatron's ``--disable-bias-linear --add-qkv-bias``.

Import: a tiny random Qwen2ForCausalLM (4 heads over 2 key/value heads, or 1: multi-query, which tp2 replicates),
every weight random (the q/k/v biases too, std 0.3 so that a lost or misplaced bias shows), saved with
``save_pretrained`` and imported with ``import_hf`` at tp1 and tp2; omnitron's forward on the imported shards (one
process; two gloo processes for tp2) gives transformers' logits on random tokens. Export: an omnitron
``add_qkv_bias`` model (also with --rotary-interleaved, whose q/k bias rows are permuted with the weight rows)
written by ``config_to_hf`` / ``state_to_hf`` loads strictly as a Qwen2ForCausalLM with omnitron's logits; and
``export-hf`` of an import gives back every tensor bit for bit.

Tolerance: every weight and activation is float64 on both sides, except transformers' RoPE, whose cos/sin are
computed in float32 (``Qwen2RotaryEmbedding`` autocasts off and casts to the input dtype after): one float32 ulp
(6e-8 relative) in each rotation factor moves a score q.k of size O(5) by ~3e-7, a softmax weight by as much,
through two layers and the unembedding (gain ~3): ~1e-6 of the logits' maximum at worst (observed 3e-7 to
8e-7). Bound 5e-6; a dropped bias, a bias on the wrong head or a wrong rope permutation moves the logits by
O(0.1).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from omnitron.backends import get_backend  # noqa: E402
from omnitron.cli import main as cli  # noqa: E402
from omnitron.core.checkpoint.hf import (HFConversionError, config_from_hf, config_to_hf, import_hf,  # noqa: E402
                                         read_hf_dir, state_to_hf)
from omnitron.core.checkpoint.io import read_metadata, read_shard  # noqa: E402
from omnitron.core.checkpoint.reshard import Layout, model_config, read_full_state  # noqa: E402
from omnitron.core.models.gpt import GPTModel, gather_full_state  # noqa: E402
from omnitron.core.parallel.groups import ParallelGroups  # noqa: E402
from omnitron.testing.distributed import REFERENCE_KERNELS, run_distributed  # noqa: E402
from tests.checkpoint.test_hf import _tp2_worker  # noqa: E402
from tests.checkpoint.test_hf_moe import TOL, V, _close, _hf_logits, _omni_logits, _randomize  # noqa: E402

assert TOL == 5e-6  # the bound derived above; observed 3e-7 .. 8e-7


def _hf_config(**kw):
    return transformers.Qwen2Config(**{**dict(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=False), **kw})


def _hf_model(seed: int, **kw):
    hf = transformers.AutoModelForCausalLM.from_config(_hf_config(**kw), dtype=torch.float64).eval()
    _randomize(hf, seed)
    return hf


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(seed))


def test_config_maps_to_megatrons_qwen2_flags():
    cfg = config_from_hf(_hf_config().to_dict())
    assert cfg.add_qkv_bias and not cfg.add_bias_linear and cfg.swiglu and cfg.normalization == "RMSNorm"
    assert cfg.rotary_base == 1e6 and cfg.num_query_groups == 2


@pytest.mark.parametrize("kv", [2, 1])
def test_import_tp1_gives_transformers_logits(kv, tmp_path):
    hf = _hf_model(1, num_key_value_heads=kv)
    hf.save_pretrained(tmp_path / "hf")
    path = import_hf(str(tmp_path / "hf"), str(tmp_path / "omni"), Layout())
    cfg = model_config(read_metadata(path)["model"])
    assert cfg.add_qkv_bias and not cfg.add_bias_linear
    model = GPTModel(cfg, ParallelGroups.single(), backend=get_backend("cpu")).eval()
    model.load_state_dict(read_shard(path, 0)["model"][0])
    assert model.decoder.layers["0"].self_attention.linear_qkv.bias is not None
    assert model.decoder.layers["0"].self_attention.linear_proj.bias is None
    tokens = _tokens(2)
    _close(_omni_logits(model, tokens), _hf_logits(hf, tokens))


def test_import_tp2_gives_transformers_logits(tmp_path):
    """tp2 shards of a 2-group model (k/v split over tp) and of a 1-group one (k/v replicated on both ranks)."""
    models, paths = [], []
    for kv in (2, 1):
        hf = _hf_model(3 + kv, num_key_value_heads=kv)
        hf.save_pretrained(tmp_path / f"hf{kv}")
        paths.append(import_hf(str(tmp_path / f"hf{kv}"), str(tmp_path / f"omni{kv}"), Layout(tp=2)))
        models.append(hf)
    tokens = _tokens(6)
    ranks = run_distributed(_tp2_worker, 2, paths, tokens, env=REFERENCE_KERNELS)
    for i, hf in enumerate(models):
        logits = torch.cat([ranks[0][i], ranks[1][i]], -1)[..., :V].double()  # tp-local slices of the vocab
        _close(logits, _hf_logits(hf, tokens))


@pytest.mark.parametrize("interleaved", [False, True])
def test_export_loads_as_qwen2_with_the_same_logits(interleaved, tmp_path):
    """An omnitron --disable-bias-linear --add-qkv-bias model loads strictly as Qwen2ForCausalLM (with
    --rotary-interleaved: each head's q/k weight and bias rows permuted to HF's half layout)."""
    from dataclasses import replace

    from safetensors.torch import save_file

    cfg = replace(config_from_hf(_hf_config().to_dict()), rotary_interleaved=interleaved)
    model = GPTModel(cfg, ParallelGroups.single(), backend=get_backend("cpu")).eval()
    _randomize(model, 7)
    full = gather_full_state(model, ParallelGroups.single())
    save_file(state_to_hf(full, cfg), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    written = config_to_hf(cfg)
    assert written["architectures"] == ["Qwen2ForCausalLM"] and "attention_bias" not in written
    (tmp_path / "config.json").write_text(json.dumps(written))
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float64,
                                                                 output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    tokens = _tokens(8)
    _close(_hf_logits(hf.eval(), tokens), _omni_logits(model, tokens))


def test_export_hf_of_an_import_is_bit_exact(tmp_path, capsys):
    hf = _hf_model(9)
    hf.save_pretrained(tmp_path / "hf")
    assert cli(["checkpoint", "import-hf", "--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "ck"),
                "--tensor-model-parallel-size", "2"]) == 0
    assert "--add-qkv-bias" in capsys.readouterr().out  # the train flags the import prints
    assert cli(["checkpoint", "export-hf", "--load", str(tmp_path / "ck"), "--out", str(tmp_path / "out")]) == 0
    c0, s0 = read_hf_dir(str(tmp_path / "hf"))
    c1, s1 = read_hf_dir(str(tmp_path / "out"))
    assert sorted(s0) == sorted(s1) and any(n.endswith("q_proj.bias") for n in s0)
    for name, t in s0.items():
        assert torch.equal(s1[name], t), name
    assert config_from_hf(c1) == config_from_hf(c0) and c1["model_type"] == "qwen2"
    full = read_full_state(os.path.join(str(tmp_path / "ck"), "iter_0000000"), with_optimizer=False).model
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in full
    assert "decoder.layers.0.self_attention.linear_proj.bias" not in full


@pytest.mark.parametrize("first", [0, 1])
def test_sliding_window_imports_and_exports_with_transformers_logits(first, tmp_path):
    """Qwen2's window (use_sliding_window, sliding_window 3, layers from max_window_layers on; 12 tokens so the
    window cuts most keys off) imports as --window-size 2,0 on those layers with transformers' logits, and an
    export of it loads back as the same Qwen2 (same layer types, same logits)."""
    hf = _hf_model(11, use_sliding_window=True, sliding_window=3, max_window_layers=first,
                   attn_implementation="eager")
    assert hf.config.layer_types == ["full_attention"] * first + ["sliding_attention"] * (2 - first)
    cfg = config_from_hf(hf.config.to_dict())
    assert cfg.window_size == "2,0" and (cfg.window_attn_skip_freq is None) == (first == 0)
    hf.save_pretrained(tmp_path / "hf")
    path = import_hf(str(tmp_path / "hf"), str(tmp_path / "omni"), Layout())
    model = GPTModel(model_config(read_metadata(path)["model"]), ParallelGroups.single(),
                     backend=get_backend("cpu")).eval()
    model.load_state_dict(read_shard(path, 0)["model"][0])
    tokens = _tokens(12)
    want = _hf_logits(hf, tokens)
    _close(_omni_logits(model, tokens), want)
    full = transformers.AutoModelForCausalLM.from_config(_hf_config(), dtype=torch.float64).eval()
    full.load_state_dict(hf.state_dict())
    assert (_hf_logits(full, tokens) - want).abs().max() > 1e-2  # the window changes these logits
    written = config_to_hf(cfg)
    assert written["layer_types"] == hf.config.layer_types and written["sliding_window"] == 3
    back = transformers.Qwen2Config(**{k: v for k, v in written.items() if k not in ("architectures", "model_type")})
    assert back.layer_types == hf.config.layer_types and config_from_hf(written) == cfg


def test_sliding_windows_qwen2_cannot_hold_are_refused_in_one_line():
    from dataclasses import replace

    for hf_kw, words in ((dict(layer_types=["sliding_attention", "full_attention"], use_sliding_window=False),
                          "marks sliding_attention layers but the window is None"),
                         (dict(layer_types=["full_attention", "local"]), "layer_types must give one of")):
        with pytest.raises(HFConversionError, match=words) as info:
            config_from_hf({**_hf_config().to_dict(), **hf_kw})
        assert "\n" not in str(info.value)
    cfg = config_from_hf(_hf_config().to_dict())
    for window, skip in (("3,0", "[1,0]"), ("-1,0", None)):  # not Qwen2's last-layers form; unbounded
        with pytest.raises(HFConversionError, match="windows its layers from max_window_layers on"):
            config_to_hf(replace(cfg, window_size=window, window_attn_skip_freq=skip))


def test_moe_export_of_qkv_bias_only_is_refused():
    from omnitron.core.models.gpt.presets import llama_tiny

    cfg = llama_tiny(add_qkv_bias=True, num_experts=4, qk_layernorm=True)
    with pytest.raises(HFConversionError, match="--add-qkv-bias without --add-bias-linear"):
        config_to_hf(cfg)
