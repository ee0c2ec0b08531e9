"""Megatron-Core MoE / MLA / MTP checkpoints (``--ckpt-format torch_dist`` and ``torch``) to and from omnitron,
against checkpoints written longhand here (megatron-core is not needed; with it installed,
tests/checkpoint/test_megatron_core_interop.py checks the same against megatron-core itself).

The transcription of megatron-core 0.16.1's names, written out here independently of
omnitron/core/checkpoint/megatron_names.py:

- ``transformer/moe/experts.py``: SequentialMLP's module names ``mlp.experts.local_experts.E.linear_fc1.weight``,
  TEGroupedMLP's ``mlp.experts.linear_fc1.weightE``; both ``sharded_state_dict`` to the key
  ``mlp.experts.experts.linear_fc1.weight`` with an expert axis after the layer axis (``singleton_local_shards``:
  ``mlp.experts.experts.E.linear_fc1.weight``); router ``mlp.router.weight``, buffer ``mlp.router.expert_bias``;
  ``mlp.shared_experts.linear_fc1/fc2``.
- ``models/gpt/gpt_layer_specs.py``: TE spec: GQA fuses the input norm into ``linear_qkv`` (``layer_norm_weight``),
  a dense MLP the pre-MLP norm into ``linear_fc1``, a MoE layer keeps ``pre_mlp_layernorm``; MLA keeps
  ``input_layernorm`` and fuses ``q_layernorm`` / ``kv_layernorm`` into ``linear_q_up_proj`` / ``linear_kv_up_proj``.
  Local spec: omnitron's names; its GQA layers' sharded keys map the input / pre-MLP norms to the fused names.
- ``transformer/transformer_block.py``: a ``--moe-layer-freq`` pattern makes the layers non-homogeneous: one key per
  layer ``decoder.layers.N.*``; else stacked on a leading axis. ``transformer/multi_token_prediction.py``:
  ``mtp.layers.K.{enorm,hnorm,eh_proj,final_layernorm}``, ``mtp.layers.K.transformer_layer.*``, never stacked.

Import: the full state equals the written tensors bit for bit, the routers' expert bias is carried, and the
imported model's logits match omnitron's float64 one-process model over the same tensors (tolerance: fp32
against float64 on 3 width-32 layers, ~ layers x sqrt(64) x 2**-24 = 1.4e-6 relative; 1e-5 bounds it, as in
test_megatron_dist.py; a wrong mapping errs at the weights' scale, 1e-2 and up). Export writes every
transcribed key of both specs with the same tensors.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from omnitron.cli import main as cli
from omnitron.core.checkpoint.hf import write_weights_checkpoint
from omnitron.core.checkpoint.io import read_metadata, read_shard
from omnitron.core.checkpoint.reshard import Layout, model_config, read_full_state
from omnitron.core.models.gpt.presets import deepseek_v3_tiny
from tests.checkpoint.test_megatron_dist import V, _read_back, _weights, _write

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
L, E = 3, 4


def _cfg(kind: str):
    """``mla``: MLA + QK norms, first layer dense, MoE with shared expert and expert bias, one MTP depth.
    ``gqa``: GQA, every layer MoE (stacked keys), a shared expert."""
    base = dict(num_layers=L, hidden_size=32, vocab_size=V, seq_length=16, hidden_dropout=0.0, attention_dropout=0.0,
                ffn_hidden_size=48, num_experts=E, moe_router_topk=2, moe_ffn_hidden_size=16,
                moe_shared_expert_intermediate_size=16, rotary_scaling_factor=1.0)
    if kind == "mla":
        return deepseek_v3_tiny(**base, moe_router_num_groups=2, moe_router_group_topk=1, moe_layer_freq="[0,1,1]",
                                mtp_num_layers=1)
    return deepseek_v3_tiny(**base, moe_layer_freq=1, multi_latent_attention=False, num_query_groups=2,
                            qk_layernorm=False, moe_router_num_groups=None, moe_router_group_topk=None,
                            yarn_original_max_position_embeddings=None)


def _args(cfg, tp: int = 1) -> argparse.Namespace:
    """A Megatron run's args for ``cfg`` (Megatron's argument names)."""
    mla = cfg.multi_latent_attention
    return argparse.Namespace(
        num_layers=L, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, kv_channels=8,
        group_query_attention=not mla, num_query_groups=2, seq_length=16, max_position_embeddings=16,
        tokenizer_type="NullTokenizer", vocab_size=V - 1, make_vocab_size_divisible_by=128, padded_vocab_size=128 * tp,
        normalization="RMSNorm", norm_epsilon=cfg.layernorm_epsilon, swiglu=True, position_embedding_type="rope",
        rotary_base=10000, rotary_percent=1.0, untie_embeddings_and_output_weights=True,
        add_bias_linear=cfg.add_bias_linear,
        qk_layernorm=cfg.qk_layernorm, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, params_dtype=torch.float32,
        num_experts=E, moe_router_topk=2, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
        moe_layer_freq=[0, 1, 1] if mla else 1, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5,
        moe_router_num_groups=2 if mla else None, moe_router_group_topk=1 if mla else None,
        multi_latent_attention=mla, q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8,
        v_head_dim=16, rope_type="rope", mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=32,
        mtp_num_layers=1 if mla else None)


def _with_bias(cfg, W: dict, g) -> dict:
    """``W`` plus a random expert bias for every MoE router (decoder and MTP layers)."""
    names = [n[:-len("weight")] + "expert_bias" for n in W if n.endswith("mlp.router.weight")]
    return {**W, **{n: torch.randn(E, generator=g) for n in names}}


def _te(rest: str, moe: bool, mla: bool) -> str:
    """The TE spec's name of an omnitron layer parameter (experts aside)."""
    table = {"self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
             "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight"}
    if not mla:
        table["input_layernorm.weight"] = "self_attention.linear_qkv.layer_norm_weight"
    if not moe:
        table["pre_mlp_layernorm.weight"] = "mlp.linear_fc1.layer_norm_weight"
    return table.get(rest, rest)


def _local_key(rest: str, mla: bool) -> str:
    """The local spec's sharded key (GQA layers map the input / pre-MLP norms; MLA layers keep theirs)."""
    if mla:
        return rest
    return {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}.get(rest, rest)


def _layers(W: dict, cfg):
    """``(prefix, decoder layer or None for MTP, rest, tensor)`` of every layer tensor of ``W``."""
    for name, t in W.items():
        parts = name.split(".")
        if name.startswith("decoder.layers."):
            yield f"decoder.layers.{parts[2]}.", int(parts[2]), ".".join(parts[3:]), t
        elif name.startswith("mtp.layers.") and parts[3] == "transformer_layer":
            yield ".".join(parts[:4]) + ".", None, ".".join(parts[4:]), t


def _moe(cfg, layer) -> bool:
    return layer is None or layer > 0 if cfg.multi_latent_attention else True


def _dist_transcription(W: dict, cfg, *, spec: str, singleton: bool = False) -> dict:
    """``{torch_dist key: global tensor}`` of ``W`` as megatron-core's ``spec`` (``te`` / ``local``) saves it."""
    mla, stacked = cfg.multi_latent_attention, not cfg.multi_latent_attention and not singleton
    out, per = {}, {}
    for name, t in W.items():
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            out[name] = torch.cat([t, t.new_zeros(128 - V, t.shape[1])])
        elif not name.startswith("decoder.layers.") and ".transformer_layer." not in name:
            out[name] = t
    for prefix, layer, rest, t in _layers(W, cfg):
        if rest.startswith("mlp.experts."):
            e, sub = int(rest.split(".")[2]), ".".join(rest.split(".")[3:])
            if singleton:
                per[(prefix, f"mlp.experts.experts.{e}.{sub}")] = t
            else:
                per.setdefault((prefix, f"mlp.experts.experts.{sub}"), [None] * E)[e] = t
            continue
        key = _te(rest, _moe(cfg, layer), mla) if spec == "te" else _local_key(rest, mla)
        per[(prefix, key)] = t
    per = {k: torch.stack(v) if isinstance(v, list) else v for k, v in per.items()}
    for (prefix, key), t in per.items():
        if stacked and prefix.startswith("decoder."):
            out[f"decoder.layers.{key}"] = torch.stack([per[(f"decoder.layers.{i}.", key)] for i in range(L)])
        else:
            out[prefix + key] = t
    return out


def _torch_transcription(W: dict, cfg, *, grouped: bool) -> dict:
    """The TE spec's tp1 module state dict (``--ckpt-format torch``): SequentialMLP or TEGroupedMLP experts."""
    out = {n: t for n, t in W.items() if not n.startswith("decoder.layers.") and ".transformer_layer." not in n}
    out["embedding.word_embeddings.weight"] = torch.cat([W["embedding.word_embeddings.weight"],
                                                         torch.zeros(128 - V, 32)])
    out["output_layer.weight"] = torch.cat([W["output_layer.weight"], torch.zeros(128 - V, 32)])
    for prefix, layer, rest, t in _layers(W, cfg):
        if rest.startswith("mlp.experts."):
            e, sub = rest.split(".")[2], rest.split(".")[3:]
            key = f"mlp.experts.{sub[0]}.{sub[1]}{e}" if grouped else f"mlp.experts.local_experts.{e}.{'.'.join(sub)}"
        else:
            key = _te(rest, _moe(cfg, layer), cfg.multi_latent_attention)
        out[prefix + key] = t
    return out


def _check_import(tmp_path, cfg, W: dict) -> None:
    """The import of ``tmp_path/meg`` holds ``W`` (expert biases in the model's buffers); logits vs float64."""
    from omnitron.core.models.gpt.model import GPTModel
    from omnitron.core.models.gpt.state import full_state_shards
    from omnitron.core.parallel.groups import ParallelGroups

    assert cli(["checkpoint", "import-megatron", "--load", str(tmp_path / "meg"), "--save", str(tmp_path / "ck")]) == 0
    path = str(tmp_path / "ck" / "iter_0000000")
    params = {n: t for n, t in W.items() if not n.endswith("expert_bias")}
    got = read_full_state(path).model  # the expert biases too (buffers): W holds them under the global names
    assert sorted(got) == sorted(W) and all(torch.equal(got[n], W[n]) for n in W)
    assert model_config(read_metadata(path)["model"]) == cfg
    model = GPTModel(cfg, ParallelGroups.single()).eval()
    model.load_state_dict(read_shard(path, 0)["model"][0])
    for n, b in model.named_buffers():
        if n.endswith("expert_bias"):
            assert torch.equal(b, W[n]), n
    ref = GPTModel(dataclasses.replace(cfg, params_dtype=torch.float64), ParallelGroups.single()).double().eval()
    sd = full_state_shards(ref, {n: t.double() for n, t in params.items()}, 1, 0)
    sd.update({n: W[n] for n, _ in ref.named_buffers() if n.endswith("expert_bias")})
    ref.load_state_dict(sd, strict=False)
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    tokens = torch.randint(0, V, (2, 12), generator=g)
    with torch.no_grad():
        a, b = model(tokens)[..., :V].double(), ref(tokens)[..., :V]
    assert float((a - b).norm() / b.norm()) < 1e-5


@pytest.mark.parametrize("kind,variant", [("mla", "te"), ("mla", "local"), ("gqa", "te"), ("gqa", "local"),
                                          ("gqa", "singleton")])
def test_torch_dist_import(kind, variant, tmp_path, capsys):
    cfg = _cfg(kind)
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    W = _with_bias(cfg, _weights(cfg, seed=int(torch.randint(0, 2**31, (1,), generator=g))), g)
    tensors = _dist_transcription(W, cfg, spec="local" if variant == "singleton" else variant,
                                  singleton=variant == "singleton")
    if variant == "singleton":  # SwiGLU's halves as singleton keys: the experts' and the shared expert's fc1
        for k in [k for k in tensors if k.endswith("linear_fc1.weight")]:
            tensors[k + "_w"], tensors[k + "_v"] = tensors.pop(k).chunk(2)
    _write(str(tmp_path / "meg"), tensors, _args(cfg), te=False)
    _check_import(tmp_path, cfg, W)
    from tests.checkpoint.test_train_hint import assert_hint_builds  # (it needs transformers; this file does not)

    assert_hint_builds(capsys.readouterr().out, cfg)  # the printed flags build the model, every field
    if variant != "singleton":  # and back to Megatron: the same tensors, the expert bias included
        assert cli(["checkpoint", "export-megatron", "--load", str(tmp_path / "ck"), "--out", str(tmp_path / "meg2"),
                    "--target-tensor-model-parallel-size", "1", "--target-pipeline-model-parallel-size", "1"]) == 0
        got, _ = _read_back(str(tmp_path / "meg2" / "iter_0000000"))
        assert all(torch.equal(got[k], t) for k, t in tensors.items())


@pytest.mark.parametrize("kind,grouped", [("mla", False), ("gqa", True)])
def test_torch_format_import(kind, grouped, tmp_path):
    cfg = _cfg(kind)
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    W = _with_bias(cfg, _weights(cfg, seed=int(torch.randint(0, 2**31, (1,), generator=g))), g)
    _write_torch_format(tmp_path, cfg, W, grouped=grouped)
    _check_import(tmp_path, cfg, W)


def test_torch_format_import_of_the_later_mtp_layer_name(tmp_path):
    """megatron-core after 0.16 (the d98e8a6 snapshot) saves the MTP depth's layer as ``mtp.layers.K.mtp_model_layer.*``
    in ``--ckpt-format torch`` (its module's attribute; the torch_dist keys keep ``transformer_layer``): imported as
    the same weights."""
    cfg = _cfg("mla")
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    W = _with_bias(cfg, _weights(cfg, seed=int(torch.randint(0, 2**31, (1,), generator=g))), g)
    _write_torch_format(tmp_path, cfg, W, grouped=False)
    path = tmp_path / "meg" / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt"
    saved = torch.load(path, weights_only=False)
    saved["model"] = {n.replace(".transformer_layer.", ".mtp_model_layer."): t for n, t in saved["model"].items()}
    assert any(".mtp_model_layer." in n for n in saved["model"])
    torch.save(saved, path)
    _check_import(tmp_path, cfg, W)


@pytest.mark.parametrize("mscale_all_dim", [1.0, 0.0])
def test_plain_rope_with_a_yarn_softmax_scale_is_refused(mscale_all_dim, tmp_path, capsys):
    """rope_type 'rope' with --rotary-scaling-factor 40: Megatron's MLA rotates by plain RoPE but scales its softmax
    by m(40, mscale_all_dim)^2 = 1.3689^2 = 1.874 (mscale_all_dim 1), which omnitron cannot hold: refused in one
    line. With mscale_all_dim 0 the scale is 1 / sqrt(d), plain RoPE's: imports as RoPE."""
    cfg = _cfg("mla")
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    W = _with_bias(cfg, _weights(cfg, seed=int(torch.randint(0, 2**31, (1,), generator=g))), g)
    args = argparse.Namespace(**{**vars(_args(cfg)), "rotary_scaling_factor": 40.0,
                                 "mscale_all_dim": mscale_all_dim})
    _write_torch_format(tmp_path, cfg, W, grouped=False, args=args)
    if mscale_all_dim == 0.0:
        return _check_import(tmp_path, dataclasses.replace(cfg, mscale_all_dim=0.0), W)
    assert cli(["checkpoint", "import-megatron", "--load", str(tmp_path / "meg"), "--save", str(tmp_path / "ck")]) != 0
    err = capsys.readouterr().err.strip()
    assert "rope_type='rope' with rotary_scaling_factor=40.0" in err and "1.87385" in err
    assert len(err.splitlines()) == 1


def _write_torch_format(tmp_path, cfg, W: dict, *, grouped: bool, args=None) -> None:
    """``tmp_path/meg``: a tp1 ``--ckpt-format torch`` Megatron checkpoint (iteration 7) of ``W`` (``args``: the
    run's, default :func:`_args`)."""
    it = tmp_path / "meg" / "iter_0000007" / "mp_rank_00"
    os.makedirs(it)
    torch.save({"args": args or _args(cfg), "iteration": 7, "checkpoint_version": 3.0,
                "model": _torch_transcription(W, cfg, grouped=grouped)}, it / "model_optim_rng.pt")
    (tmp_path / "meg" / "latest_checkpointed_iteration.txt").write_text("7")


@pytest.mark.parametrize("kind", ["mla", "gqa"])
def test_torch_dist_export_holds_both_specs_keys(kind, tmp_path):
    """Every key of the TE and the local spec's transcription is in the export with its tensor; the expert bias
    (W holds none: the checkpoint's zeros) is zero; export -> import is bit-exact."""
    cfg = _cfg(kind)
    W = _weights(cfg, seed=int.from_bytes(os.urandom(4), "little"))
    write_weights_checkpoint(W, cfg, str(tmp_path / "ck0"), Layout(), config={"tokenizer_type": "NullTokenizer"})
    assert cli(["checkpoint", "export-megatron", "--load", str(tmp_path / "ck0"), "--out", str(tmp_path / "meg"),
                "--target-tensor-model-parallel-size", "1", "--target-pipeline-model-parallel-size", "1"]) == 0
    got, _ = _read_back(str(tmp_path / "meg" / "iter_0000000"))
    objects = FileSystemReader(str(tmp_path / "meg" / "iter_0000000")).read_metadata().state_dict_metadata
    zero = {n[:-len("weight")] + "expert_bias": torch.zeros(E) for n in W if n.endswith("mlp.router.weight")}
    for spec in ("te", "local"):
        want = _dist_transcription({**W, **zero}, cfg, spec=spec)
        for key, t in want.items():
            assert key in got and torch.equal(got[key], t), (spec, key)
    assert set(got) == set(_dist_transcription({**W, **zero}, cfg, spec="te")) | set(
        _dist_transcription({**W, **zero}, cfg, spec="local"))
    assert any(".mlp.experts.experts.linear_fc1._extra_state/shard_" in k for k in objects)
    assert cli(["checkpoint", "import-megatron", "--load", str(tmp_path / "meg"), "--save", str(tmp_path / "ck")]) == 0
    back = read_full_state(str(tmp_path / "ck" / "iter_0000000")).model
    _assert_weights_and_zero_biases(back, W)


def _assert_weights_and_zero_biases(back: dict, W: dict) -> None:
    """``back`` (a full state read from disk) is ``W`` bit for bit plus one zero ``expert_bias`` per router (``W``
    holds none: the checkpoint's routers kept their initial zeros through export and import)."""
    bias = {n: t for n, t in back.items() if n.endswith("expert_bias")}
    assert sorted(n[:-len("expert_bias")] for n in bias) == sorted(
        n[:-len("weight")] for n in W if n.endswith("mlp.router.weight"))
    assert not any(t.any() for t in bias.values())
    assert sorted(set(back) - set(bias)) == sorted(W) and all(torch.equal(back[n], W[n]) for n in W)


def test_torch_format_mla_at_tp2_is_refused(tmp_path, capsys):
    cfg = _cfg("mla")
    write_weights_checkpoint(_weights(cfg, seed=1), cfg, str(tmp_path / "ck0"), Layout(),
                             config={"tokenizer_type": "NullTokenizer"})
    assert cli(["checkpoint", "export-megatron", "--load", str(tmp_path / "ck0"), "--out", str(tmp_path / "meg"),
                "--target-tensor-model-parallel-size", "2", "--target-pipeline-model-parallel-size", "1",
                "--ckpt-format", "torch"]) == 2
    err = capsys.readouterr().err
    assert "use --ckpt-format torch_dist" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("kind,tp,pp", [("gqa", 2, 1), ("mla", 1, 3)])
def test_torch_format_round_trip(kind, tp, pp, tmp_path):
    """``--ckpt-format torch`` export at tp x pp (experts split over tp as Megatron's expert tensor parallelism
    equal to tp; MTP on the last stage) imports back bit for bit; every rank file holds its TE extra states."""
    cfg = _cfg(kind)
    W = _weights(cfg, seed=int.from_bytes(os.urandom(4), "little"))
    write_weights_checkpoint(W, cfg, str(tmp_path / "ck0"), Layout(), config={"tokenizer_type": "NullTokenizer"})
    assert cli(["checkpoint", "export-megatron", "--load", str(tmp_path / "ck0"), "--out", str(tmp_path / "meg"),
                "--target-tensor-model-parallel-size", str(tp), "--target-pipeline-model-parallel-size", str(pp),
                "--ckpt-format", "torch"]) == 0
    last = torch.load(tmp_path / "meg" / "iter_0000000" / (f"mp_rank_00_{pp - 1:03d}" if pp > 1 else "mp_rank_00") /
                      "model_optim_rng.pt", weights_only=False)["model"]
    assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2._extra_state" in last
    if cfg.mtp_num_layers:
        assert "mtp.layers.0.eh_proj._extra_state" in last and "mtp.layers.0.eh_proj.weight" in last
    assert cli(["checkpoint", "import-megatron", "--load", str(tmp_path / "meg"), "--save", str(tmp_path / "ck")]) == 0
    back = read_full_state(str(tmp_path / "ck" / "iter_0000000")).model
    _assert_weights_and_zero_biases(back, W)


def test_pre_softmax_with_a_scaling_factor_imports(tmp_path):
    """Megatron's DeepSeek-V3 scripts pass --moe-router-pre-softmax with sigmoid scores and
    --moe-router-topk-scaling-factor 2.5 (the factor scales the weights either way, as here): the checkpoint imports
    with both, its logits those of the float64 model over the same tensors."""
    cfg = dataclasses.replace(_cfg("gqa"), moe_router_pre_softmax=True)
    assert cfg.moe_router_topk_scaling_factor == 2.5
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    W = _with_bias(cfg, _weights(cfg, seed=int(torch.randint(0, 2**31, (1,), generator=g))), g)
    args = _args(cfg)
    args.moe_router_pre_softmax = True
    _write_torch_format(tmp_path, cfg, W, grouped=False, args=args)
    _check_import(tmp_path, cfg, W)


@pytest.mark.parametrize("saved", [True, False])
def test_router_bias_of_add_bias_linear(saved, tmp_path):
    """Megatron-Core's routers hold ``mlp.router.bias`` with --add-bias-linear (since 0.15; ``saved`` False: a
    checkpoint from before): the import keeps it (or records a model without it), the logits match the float64
    model over the same tensors, and the export writes it back (a zero one for a model without)."""
    cfg = dataclasses.replace(_cfg("gqa"), add_bias_linear=True)
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    W = _with_bias(cfg, _weights(cfg, seed=int(torch.randint(0, 2**31, (1,), generator=g))), g)
    biases = [n for n in W if n.endswith("mlp.router.bias")]
    assert len(biases) == L  # the model's router has the bias: Megatron's rule
    if not saved:
        W = {n: t for n, t in W.items() if n not in biases}
        cfg = dataclasses.replace(cfg, moe_router_bias=False)
    _write_torch_format(tmp_path, cfg, W, grouped=False)
    _check_import(tmp_path, cfg, W)
    assert cli(["checkpoint", "export-megatron", "--load", str(tmp_path / "ck"), "--out", str(tmp_path / "meg2"),
                "--target-tensor-model-parallel-size", "1", "--target-pipeline-model-parallel-size", "1",
                "--ckpt-format", "torch"]) == 0
    out = torch.load(tmp_path / "meg2" / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt",
                     weights_only=False)["model"]
    for n in biases:
        assert torch.equal(out[n], W[n] if saved else torch.zeros(E)), n


def test_torch_format_with_whole_experts_at_tp2_imports(tmp_path):
    """Megatron's --expert-tensor-parallel-size 1 at tp 2 (what its expert biases need): every tp rank's file holds
    each routed expert whole, the rest split as usual; the import takes the experts once, bit for bit."""
    cfg = _cfg("gqa")
    W = _weights(cfg, seed=int.from_bytes(os.urandom(4), "little"))
    write_weights_checkpoint(W, cfg, str(tmp_path / "ck0"), Layout(), config={"tokenizer_type": "NullTokenizer"})
    assert cli(["checkpoint", "export-megatron", "--load", str(tmp_path / "ck0"), "--out", str(tmp_path / "meg"),
                "--target-tensor-model-parallel-size", "2", "--target-pipeline-model-parallel-size", "1",
                "--ckpt-format", "torch"]) == 0
    expert = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")
    for rank in ("mp_rank_00", "mp_rank_01"):
        f = tmp_path / "meg" / "iter_0000000" / rank / "model_optim_rng.pt"
        ck = torch.load(f, weights_only=False)
        ck["args"].expert_tensor_parallel_size = 1
        for key in list(ck["model"]):
            m = expert.match(key)
            if m:
                ck["model"][key] = W[f"decoder.layers.{m.group(1)}.mlp.experts.{m.group(2)}.{m.group(3)}"].clone()
        torch.save(ck, f)
    assert cli(["checkpoint", "import-megatron", "--load", str(tmp_path / "meg"), "--save", str(tmp_path / "ck")]) == 0
    _assert_weights_and_zero_biases(read_full_state(str(tmp_path / "ck" / "iter_0000000")).model, W)


@pytest.mark.parametrize("freq", [1, 2, 3, "1", "2", "[1,1,1,1]", "[1,0,1,0]", "([1]*2+[0]*2)"])
def test_stacked_layer_keys_follow_megatrons_homogeneity_rule(freq):
    """Megatron stacks the decoder's layers under one key (homogeneous) unless --moe-layer-freq is an int above 1 or
    a list, any list (TransformerBlock.sharded_state_dict, megatron-core d98e8a6: ``isinstance(freq, list)`` sets
    non_homogeneous_layers); omnitron holds an int or its string. Reference: that rule transcribed, on the parsed
    flag; a dense model is homogeneous whatever the flag says."""
    from types import SimpleNamespace

    from omnitron.core.checkpoint.megatron_names import homogeneous

    parsed = int(freq) if str(freq).strip().isdigit() else [1]  # a pattern is a list to Megatron
    megatron = not (isinstance(parsed, int) and parsed > 1 or isinstance(parsed, list))
    assert homogeneous(SimpleNamespace(num_experts=4, moe_layer_freq=freq)) is megatron
    assert homogeneous(SimpleNamespace(num_experts=None, moe_layer_freq=freq)) is True
