"""Megatron-LM (``--ckpt-format torch``) import / export against shards written longhand here.

The reference is this file's own writer, :func:`_longhand`: it cuts an omnitron model's full state
into Megatron-Core's per-rank files by the documented layout (``mp_rank_TT_PPP/model_optim_rng.pt``;
per-stage local layer numbers; TE-fused norm names and ``_extra_state`` entries; QKV split over tp
by whole query groups; per-rank SwiGLU ``[gate shard; up shard]``; vocabulary padded to 128 x tp;
the last stage's copy of a tied embedding), slicing each rank by hand. A GPT-2-style model and a
Llama-style one (GQA 4 heads / 2 groups, SwiGLU, RoPE, untied, no biases), every weight perturbed,
are written at tp2 x pp2 (and interleaved, vp2): import gives the same full state bit for bit and
the same logits as the source model; export writes exactly the longhand tensors; export -> import
is bit-exact. Bad input fails naming the problem.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil

import numpy as np
import pytest
import torch

from omnitron.cli import main as cli
from omnitron.core.checkpoint.hf import write_weights_checkpoint
from omnitron.core.checkpoint.io import read_metadata, read_shard
from omnitron.core.checkpoint.megatron import MegatronConversionError, import_megatron, real_vocab_size
from omnitron.core.checkpoint.reshard import Layout, model_config, read_full_state
from omnitron.core.models.gpt.presets import gpt2_tiny, llama_tiny

V = 100
TP, PP = 2, 2


def _cfg(kind: str):
    if kind == "qwen2":  # Megatron's Qwen2 scripts: --disable-bias-linear --add-qkv-bias
        return dataclasses.replace(_cfg("llama"), add_qkv_bias=True)
    if kind == "gpt2":
        return gpt2_tiny(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=V,
                         seq_length=16, max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
    return llama_tiny(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                      vocab_size=V, seq_length=16, rotary_base=500.0)


@pytest.fixture(scope="module")
def source():
    """{kind: (cfg, model, full state)}: omnitron models with every weight perturbed."""
    from omnitron.core.models.gpt.model import GPTModel
    from omnitron.core.models.gpt.state import gather_full_state
    from omnitron.core.parallel.groups import ParallelGroups

    out = {}
    for i, kind in enumerate(("gpt2", "llama", "qwen2")):
        cfg = _cfg(kind)
        m = GPTModel(cfg, ParallelGroups.single(), seed=11 + i).eval()
        g = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        out[kind] = (cfg, m, {n: t.clone() for n, t in gather_full_state(m, m.groups).items()})
    return out


# ---- the longhand reference writer -----------------------------------------------------------
def _rows(t: torch.Tensor, r: int, tp: int) -> torch.Tensor:
    n = t.shape[0] // tp
    return t[r * n:(r + 1) * n].clone()


def _cols(t: torch.Tensor, r: int, tp: int) -> torch.Tensor:
    n = t.shape[1] // tp
    return t[:, r * n:(r + 1) * n].clone()


def _layer(full: dict, cfg, i: int, r: int, tp: int) -> dict:
    """Megatron-Core (TE spec) tensors of global layer ``i`` at tensor rank ``r``, unprefixed."""
    src = lambda k: full[f"decoder.layers.{i}.{k}"]  # noqa: E731
    heads, groups, d = cfg.num_attention_heads, cfg.num_query_groups or cfg.num_attention_heads, 32 // 4
    per_rank = groups // tp  # whole query groups [q heads of the group, k, v] per rank
    out = {}
    for kind in ("weight", "bias") if cfg.add_bias_linear or cfg.add_qkv_bias else ("weight",):
        qkv = src(f"self_attention.linear_qkv.{kind}")
        grouped = qkv.reshape(groups, (heads // groups + 2) * d, *qkv.shape[1:])
        out[f"self_attention.linear_qkv.{kind}"] = grouped[r * per_rank:(r + 1) * per_rank].reshape(
            -1, *qkv.shape[1:]).clone()
    for kind in ("weight", "bias") if cfg.add_bias_linear else ("weight",):
        fc1 = src(f"mlp.linear_fc1.{kind}")
        if cfg.swiglu:
            f = cfg.ffn_hidden_size
            out[f"mlp.linear_fc1.{kind}"] = torch.cat([_rows(fc1[:f], r, tp), _rows(fc1[f:], r, tp)])
        else:
            out[f"mlp.linear_fc1.{kind}"] = _rows(fc1, r, tp)
    out["self_attention.linear_proj.weight"] = _cols(src("self_attention.linear_proj.weight"), r, tp)
    out["mlp.linear_fc2.weight"] = _cols(src("mlp.linear_fc2.weight"), r, tp)
    if cfg.add_bias_linear:
        out["self_attention.linear_proj.bias"] = src("self_attention.linear_proj.bias").clone()
        out["mlp.linear_fc2.bias"] = src("mlp.linear_fc2.bias").clone()
    for kind in ("weight", "bias") if cfg.normalization == "LayerNorm" else ("weight",):
        out[f"self_attention.linear_qkv.layer_norm_{kind}"] = src(f"input_layernorm.{kind}").clone()
        out[f"mlp.linear_fc1.layer_norm_{kind}"] = src(f"pre_mlp_layernorm.{kind}").clone()
    for mod in ("self_attention.core_attention", "self_attention.linear_qkv", "self_attention.linear_proj",
                "mlp.linear_fc1", "mlp.linear_fc2"):
        out[f"{mod}._extra_state"] = None
    return out


def _longhand(full: dict, cfg, tp: int, pp: int, vp: int = 1, layers: dict | None = None) -> dict:
    """``{(tp_rank, pp_rank): [model state dict per chunk]}`` in Megatron-Core's layout (``layers``: the global
    layers of each (stage, chunk), else an even split)."""
    padded = 128 * tp  # V = 100 pads to one multiple of 128 x tp
    per = cfg.num_layers // (pp * vp)
    layers = layers or {(p, c): [(c * pp + p) * per + j for j in range(per)] for p in range(pp) for c in range(vp)}
    out = {}
    for p in range(pp):
        for r in range(tp):
            chunks = []
            for c in range(vp):
                sd = {}
                for j, i in enumerate(layers[(p, c)]):  # local number j, global layer i
                    sd.update({f"decoder.layers.{j}.{k}": t for k, t in _layer(full, cfg, i, r, tp).items()})
                first, last = p == 0 and c == 0, p == pp - 1 and c == vp - 1
                emb = torch.cat([full["embedding.word_embeddings.weight"], torch.zeros(padded - V, 32)])
                if first:
                    sd["embedding.word_embeddings.weight"] = _rows(emb, r, tp)
                    pos = "embedding.position_embeddings.weight"
                    if pos in full:
                        sd[pos] = full[pos].clone()
                if last:
                    for k in ("weight", "bias") if cfg.normalization == "LayerNorm" else ("weight",):
                        sd[f"decoder.final_layernorm.{k}"] = full[f"decoder.final_layernorm.{k}"].clone()
                    if cfg.untie_embeddings_and_output_weights:
                        out_w = torch.cat([full["output_layer.weight"], torch.zeros(padded - V, 32)])
                        sd["output_layer.weight"] = _rows(out_w, r, tp)
                    elif not first:
                        sd["output_layer.weight"] = _rows(emb, r, tp)
                chunks.append(sd)
            out[(r, p)] = chunks
    return out


def _args(cfg, tp: int, pp: int, **over) -> argparse.Namespace:
    llama = cfg.swiglu
    a = dict(num_layers=cfg.num_layers, hidden_size=32, ffn_hidden_size=cfg.ffn_hidden_size, num_attention_heads=4,
             kv_channels=8, group_query_attention=llama, num_query_groups=2 if llama else 1, seq_length=16,
             max_position_embeddings=16, tokenizer_type="NullTokenizer", vocab_size=V - 1,
             make_vocab_size_divisible_by=128, padded_vocab_size=128 * tp,
             normalization="RMSNorm" if llama else "LayerNorm", norm_epsilon=cfg.layernorm_epsilon, swiglu=llama,
             position_embedding_type="rope" if llama else "learned_absolute", rotary_base=500 if llama else 10000,
             rotary_percent=1.0, untie_embeddings_and_output_weights=llama, add_bias_linear=not llama,
             add_qkv_bias=cfg.add_qkv_bias, bias_gelu_fusion=not llama, hidden_dropout=0.0, attention_dropout=0.0,
             init_method_std=0.02,
             tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, lr=3e-4, micro_batch_size=2,
             params_dtype=torch.float32)  # NOTE: no iteration: Megatron's saved args need not have one
    a.update(over)
    return argparse.Namespace(**a)


def _write_megatron(root: str, shards: dict, args, pp: int, iteration: int = 1234) -> None:
    """Megatron's directory layout, with the optimizer / RNG entries a real file carries."""
    for (r, p), chunks in shards.items():
        d = os.path.join(root, f"iter_{iteration:07d}", f"mp_rank_{r:02d}" + (f"_{p:03d}" if pp > 1 else ""))
        os.makedirs(d)
        ckpt = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                "optimizer": {"param_groups": [{"lr": 3e-4}]}, "opt_param_scheduler": {"num_steps": 9},
                "rng_state": [{"np_rng_state": np.random.RandomState(r).get_state(), "torch": torch.get_rng_state()}]}
        ckpt.update({"model": chunks[0]} if len(chunks) == 1 else {f"model{c}": sd for c, sd in enumerate(chunks)})
        torch.save(ckpt, os.path.join(d, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


def _make(tmp_path, source, kind: str, name: str = "meg", vp: int = 1, **over) -> str:
    cfg, _, full = source[kind]
    root = str(tmp_path / name)
    _write_megatron(root, _longhand(full, cfg, TP, PP, vp), _args(cfg, TP, PP, **over), PP)
    return root


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).transpose(0, 1)[..., :V]


# ---- tests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2"])
def test_import_matches_source(source, kind, tmp_path, capsys):
    from omnitron.core.models.gpt.model import GPTModel
    from omnitron.core.parallel.groups import ParallelGroups

    cfg, model, full = source[kind]
    meg = _make(tmp_path, source, kind)
    assert cli(["checkpoint", "import-megatron", "--load", meg, "--save", str(tmp_path / "ck")]) == 0
    assert "--load" in capsys.readouterr().out
    path = str(tmp_path / "ck" / "iter_0000000")
    got = read_full_state(path).model
    assert sorted(got) == sorted(full) and all(torch.equal(got[n], full[n]) for n in full)
    meta = read_metadata(path)
    assert model_config(meta["model"]) == cfg and meta["config"]["vocab_size"] == V - 1
    m = GPTModel(model_config(meta["model"]), ParallelGroups.single()).eval()
    m.load_state_dict(read_shard(path, 0)["model"][0])
    tokens = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(5))
    assert torch.equal(_logits(m, tokens), _logits(model, tokens))


def test_import_interleaved_to_tp2_pp2(source, tmp_path):
    """A vp2 Megatron run (model0 / model1 per file) into omnitron's own tp2 x pp2 layout."""
    cfg, _, full = source["llama"]
    meg = _make(tmp_path, source, "llama", vp=2, virtual_pipeline_model_parallel_size=2)
    out = import_megatron(os.path.join(meg, "iter_0001234"), str(tmp_path / "ck"), Layout(tp=2, pp=2))
    from omnitron.core.checkpoint.io import read_metadata

    assert read_metadata(out)["imported_from"]["iteration"] == 1234  # the files' top-level iteration
    got = read_full_state(out).model
    assert sorted(got) == sorted(full) and all(torch.equal(got[n], full[n]) for n in full)


def test_import_accounted_split_with_empty_chunks(source, tmp_path):
    """A run with --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split and 3 virtual
    stages a rank: 4 layers + 2 slots over pp2 x vp3, one slot a chunk, so the first chunk (the embedding) and the
    last (final norm, output layer) hold no layer (Megatron's slot arithmetic, written out by hand): rank 0 holds
    [], [1], [3], rank 1 [0], [2], []. Imported whole, bit for bit."""
    cfg, _, full = source["llama"]
    layers = {(0, 0): [], (1, 0): [0], (0, 1): [1], (1, 1): [2], (0, 2): [3], (1, 2): []}
    root = str(tmp_path / "meg")
    args = _args(cfg, TP, PP, virtual_pipeline_model_parallel_size=3, num_virtual_stages_per_pipeline_rank=3,
                 account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
    _write_megatron(root, _longhand(full, cfg, TP, PP, 3, layers), args, PP)
    out = import_megatron(os.path.join(root, "iter_0001234"), str(tmp_path / "ck"), Layout())
    got = read_full_state(out).model
    assert sorted(got) == sorted(full) and all(torch.equal(got[n], full[n]) for n in full)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen2"])
def test_export_equals_longhand(source, kind, tmp_path):
    cfg, _, full = source[kind]
    write_weights_checkpoint(full, cfg, str(tmp_path / "ck"), Layout(tp=1), config={"tokenizer_type": "NullTokenizer"})
    out = str(tmp_path / "meg")
    assert cli(["checkpoint", "export-megatron", "--load", str(tmp_path / "ck"), "--out", out,
                "--target-tensor-model-parallel-size", str(TP), "--target-pipeline-model-parallel-size", str(PP),
                "--ckpt-format", "torch"]) == 0
    with open(os.path.join(out, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "0"
    want = _longhand(full, cfg, TP, PP)
    assert sorted(os.listdir(os.path.join(out, "iter_0000000"))) == ["mp_rank_00_000", "mp_rank_00_001",
                                                                     "mp_rank_01_000", "mp_rank_01_001"]
    ref_args = vars(_args(cfg, TP, PP))
    for (r, p), (sd,) in want.items():
        ck = torch.load(os.path.join(out, "iter_0000000", f"mp_rank_{r:02d}_{p:03d}", "model_optim_rng.pt"),
                        weights_only=False)
        assert ck["checkpoint_version"] == 3.0 and ck["iteration"] == 0
        assert sorted(ck["model"]) == sorted(sd), (r, p)
        for name, t in sd.items():
            got = ck["model"][name]
            assert (got is None and t is None) or (got.dtype == t.dtype and torch.equal(got, t)), name
        args = vars(ck["args"])
        for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                    "group_query_attention", "padded_vocab_size", "vocab_size", "tokenizer_type", "normalization",
                    "swiglu", "position_embedding_type", "untie_embeddings_and_output_weights", "add_bias_linear",
                    "add_qkv_bias",
                    "tensor_model_parallel_size", "pipeline_model_parallel_size", "kv_channels", "seq_length"):
            assert args[key] == ref_args[key], key
        # Megatron's checkpoint-args check compares this with the launch line's, whose default is True (RoPE
        # models too, unless --no-position-embedding is given)
        assert args["add_position_embedding"] is True


@pytest.mark.parametrize("kind,tp,pp,impl", [("llama", 2, 2, "transformer_engine"), ("gpt2", 1, 1, "local"),
                                             ("gpt2", 2, 4, "transformer_engine"), ("llama_bf16", 2, 1, "local"),
                                             ("llama_1p", 1, 1, "local"), ("qwen2", 2, 2, "local")])
def test_export_import_round_trip(source, kind, tp, pp, impl, tmp_path):
    """omnitron -> Megatron -> omnitron is bit-exact (bf16 stays bf16; tied copies on a last stage dropped;
    --apply-layernorm-1p travels in the args, the zero-centred weights as they are, as Megatron holds them)."""
    cfg, _, full = source[kind.split("_")[0]]
    if kind.endswith("bf16"):
        cfg, full = dataclasses.replace(cfg, params_dtype=torch.bfloat16), {n: t.bfloat16() for n, t in full.items()}
    if kind.endswith("1p"):
        cfg = dataclasses.replace(cfg, apply_layernorm_1p=True)
    write_weights_checkpoint(full, cfg, str(tmp_path / "ck"), Layout(tp=2, pp=2))
    assert cli(["checkpoint", "export-megatron", "--load", str(tmp_path / "ck"), "--out", str(tmp_path / "meg"),
                "--target-tensor-model-parallel-size", str(tp), "--target-pipeline-model-parallel-size", str(pp),
                "--transformer-impl", impl, "--ckpt-format", "torch"]) == 0
    assert cli(["checkpoint", "import-megatron", "--load", str(tmp_path / "meg"), "--save", str(tmp_path / "back"),
                "--tensor-model-parallel-size", "2"]) == 0
    meta = read_metadata(str(tmp_path / "back" / "iter_0000000"))
    got = read_full_state(str(tmp_path / "back" / "iter_0000000")).model
    assert model_config(meta["model"]) == cfg
    assert sorted(got) == sorted(full) and all(got[n].dtype == full[n].dtype and torch.equal(got[n], full[n])
                                               for n in full)


def test_real_vocab_size():
    """Rows kept of Megatron's padded vocabulary, by tokenizer (NullTokenizer adds an end-of-document token)."""
    assert real_vocab_size({"tokenizer_type": "NullTokenizer", "vocab_size": 99, "padded_vocab_size": 128}) == 100
    assert real_vocab_size({"tokenizer_type": "GPT2BPETokenizer", "padded_vocab_size": 50304}) == 50257
    assert real_vocab_size({"tokenizer_type": "HuggingFaceTokenizer", "padded_vocab_size": 32128}) == 32128
    with pytest.raises(MegatronConversionError, match="padded_vocab_size"):
        real_vocab_size({"tokenizer_type": "HuggingFaceTokenizer"})


def test_gelu_kind_is_read_as_megatron_core_computes_it():
    """Megatron-Core runs the tanh GeLU only inside its fused bias-GeLU (bias_gelu_fusion and biases), else
    the exact one: the imported config computes the same, and the exported args say the same again."""
    from omnitron.core.checkpoint.megatron import args_for, config_from_megatron
    from omnitron.core.transformer.mlp import exact_gelu

    cfg = _cfg("gpt2")
    for over, exact in (({}, False), ({"bias_gelu_fusion": False}, True),
                        ({"add_bias_linear": False, "bias_gelu_fusion": False}, True)):
        args = vars(_args(cfg, 1, 1, **over))
        got = config_from_megatron(args, vocab_size=V, dtype=torch.float32)
        assert exact_gelu(got) is exact, over
        back = args_for(got, 1, 1, 0, {}, "local")
        assert back.bias_gelu_fusion is not exact and back.openai_gelu is False


@pytest.mark.parametrize("case,message", [
    ("missing_shard", "mp_rank_01_001/model_optim_rng.pt is missing"),
    ("moe", "no tensor decoder.layers.0.mlp.router.weight"),
    ("fp8_params", "fp8_param_gather=True"),  # (--squared-relu imports since 2026-12-07, post-LN args too)
    ("no_args", "no 'args'"),
    ("wrong_shape", "has shape"),
    ("legacy_names", "legacy Megatron model names"),
    ("torch_dist", "DCP files without Megatron's metadata.json"),
    # crafted files: refused in one line naming the file, before a model of the args' size is allocated
    ("not_a_dict", "mp_rank_00_000/model_optim_rng.pt: holds a list, not Megatron's checkpoint dict"),
    ("model_not_a_state_dict", "mp_rank_01_001/model_optim_rng.pt: 'model' is not a state dict of tensor names"),
    ("huge_args", "the checkpoint and its args do not match"),  # a ~10**14-byte model over small tensors
])
def test_import_errors(source, case, message, tmp_path, capsys):
    over = {"moe": {"num_experts": 8}, "fp8_params": {"fp8_param_gather": True},
            "wrong_shape": {"ffn_hidden_size": 96},
            "huge_args": {"hidden_size": 2 ** 22, "ffn_hidden_size": 2 ** 24, "kv_channels": 2 ** 20}}.get(case, {})
    meg = _make(tmp_path, source, "gpt2", **over)
    it = os.path.join(meg, "iter_0001234")
    if case == "missing_shard":
        shutil.rmtree(os.path.join(it, "mp_rank_01_001"))
    if case in ("no_args", "legacy_names"):
        for d in os.listdir(it):
            f = os.path.join(it, d, "model_optim_rng.pt")
            ck = torch.load(f, weights_only=False)
            if case == "no_args":
                del ck["args"]
            else:
                ck["model"] = {"language_model." + k: v for k, v in ck["model"].items()}
            torch.save(ck, f)
    if case == "not_a_dict":
        torch.save([torch.zeros(2)], os.path.join(it, "mp_rank_00_000", "model_optim_rng.pt"))
    if case == "model_not_a_state_dict":
        f = os.path.join(it, "mp_rank_01_001", "model_optim_rng.pt")
        torch.save({**torch.load(f, weights_only=False), "model": torch.zeros(3)}, f)
    if case == "torch_dist":
        shutil.rmtree(it)
        os.makedirs(it)
        open(os.path.join(it, "__0_0.distcp"), "w").close()
        open(os.path.join(it, "common.pt"), "w").close()
    assert cli(["checkpoint", "import-megatron", "--load", meg, "--save", str(tmp_path / "ck")]) == 2
    assert message in capsys.readouterr().err
    with pytest.raises(MegatronConversionError, match=message.replace("(", r"\(").replace(")", r"\)")):
        import_megatron(meg, str(tmp_path / "ck2"), Layout())


def test_export_errors(source, tmp_path, capsys):
    cfg, _, full = source["llama"]
    write_weights_checkpoint(full, cfg, str(tmp_path / "ck"), Layout())
    base = ["checkpoint", "export-megatron", "--load", str(tmp_path / "ck"), "--out", str(tmp_path / "meg"),
            "--ckpt-format", "torch"]
    assert cli(base + ["--target-tensor-model-parallel-size", "4", "--target-pipeline-model-parallel-size", "1"]) == 2
    assert "whole query groups (2)" in capsys.readouterr().err
    assert cli(base + ["--target-tensor-model-parallel-size", "1", "--target-pipeline-model-parallel-size", "3"]) == 2
    assert "do not split evenly over 3 stages" in capsys.readouterr().err
    assert cli(base + ["--target-tensor-model-parallel-size", "1", "--target-pipeline-model-parallel-size", "1"]) == 0
    assert cli(base + ["--target-tensor-model-parallel-size", "1", "--target-pipeline-model-parallel-size", "1"]) == 2
    assert "--out" in (err := capsys.readouterr().err) and "already holds iter_0000000" in err, err


@pytest.mark.parametrize("how, says", [("nan", "holds NaN"), ("inf", "holds inf"), ("int", "is int32, not a")])
def test_nonfinite_or_integer_weight_is_refused_naming_tensor_and_file(source, how, says, tmp_path, capsys):
    """A NaN / inf or integer weight in one rank file (chosen at random, as the tensor and element) imported
    silently; it is refused naming both, with nothing written."""
    meg = _make(tmp_path, source, "gpt2")
    it = os.path.join(meg, "iter_0001234")
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    pick = lambda n: int(torch.randint(n, (1,), generator=gen))  # noqa: E731
    rank = sorted(os.listdir(it))[pick(len(os.listdir(it)))]
    f = os.path.join(it, rank, "model_optim_rng.pt")
    ck = torch.load(f, weights_only=False)
    names = sorted(n for n, t in ck["model"].items() if torch.is_tensor(t) and not n.endswith("_extra_state"))
    name = names[pick(len(names))]
    t = ck["model"][name].clone()
    if how == "int":
        t = t.mul(1000).round().to(torch.int32)
    else:
        t.view(-1)[pick(t.numel())] = float(how)
    ck["model"][name] = t
    torch.save(ck, f)
    assert cli(["checkpoint", "import-megatron", "--load", meg, "--save", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{f}: tensor {name!r} {says}" in err, err
    assert not os.path.exists(tmp_path / "ck") or not os.listdir(tmp_path / "ck")


# Megatron-LM's defaults for the args config_from_megatron reads (d98e8a6): megatron/training/arguments.py
# (--rotary-base 10000, --rotary-percent 1.0, --rope-scaling-factor 8.0, --make-vocab-size-divisible-by 128,
# --position-embedding-type learned_absolute) and megatron/core/transformer/transformer_config.py
# (--norm-epsilon 1e-5, hidden_dropout / attention_dropout 0.1, add_bias_linear True, init_method_std 0.02)
_MEGATRON_DEFAULTS = {"rotary_base": 10000, "rotary_percent": 1.0, "rope_scaling_factor": 8.0,
                      "make_vocab_size_divisible_by": 128, "position_embedding_type": "learned_absolute",
                      "norm_epsilon": 1e-5, "hidden_dropout": 0.1, "attention_dropout": 0.1, "add_bias_linear": True,
                      "init_method_std": 0.02}


@pytest.mark.parametrize("pos", ["learned_absolute", "rope"])
def test_args_an_older_megatron_did_not_record_read_as_megatrons_defaults(pos):
    """An args namespace without the optional fields above (a Megatron that predates a flag records none) reads as
    the same args with Megatron's defaults written in: under --use-rope-scaling the factor is 8, the norm epsilon
    1e-5, dropouts 0.1, biases on (reference: the defaults transcribed above from Megatron's argument parser)."""
    given = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
             "max_position_embeddings": 32, "use_rope_scaling": True, "swiglu": True}
    if pos == "rope":
        given["position_embedding_type"] = "rope"
    from omnitron.core.checkpoint.megatron import config_from_megatron

    got = config_from_megatron(given, vocab_size=V, dtype=torch.float32)
    want = config_from_megatron({**_MEGATRON_DEFAULTS, **given}, vocab_size=V, dtype=torch.float32)
    assert dataclasses.asdict(got) == dataclasses.asdict(want)


def test_two_spellings_of_one_tensor_must_hold_the_same_values():
    """A Megatron stage state dict may name a norm twice (the TE spec's fused ``linear_qkv.layer_norm_weight`` and
    the local spec's ``input_layernorm.weight``): equal copies import as one tensor, different ones are refused
    naming it (one of them would be dropped silently)."""
    from omnitron.core.checkpoint.megatron import _to_omnitron_names

    w = torch.randn(8, generator=torch.Generator().manual_seed(4))
    sd = {"decoder.layers.0.input_layernorm.weight": w,
          "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": w.clone()}
    out, layers = _to_omnitron_names(sd, 3, "ck")
    assert layers == 1 and list(out) == ["decoder.layers.3.input_layernorm.weight"]
    assert torch.equal(out["decoder.layers.3.input_layernorm.weight"], w)
    sd["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"] = w + 1e-3
    with pytest.raises(MegatronConversionError, match="two names of decoder.layers.3.input_layernorm.weight hold "
                                                      "different tensors"):
        _to_omnitron_names(sd, 3, "ck")
