"""Megatron-Core ``--ckpt-format torch_dist`` import / export against checkpoints written longhand here.

megatron-core is not installed in the test environment, so the reference checkpoint is this file's own
transcription of Megatron-Core's conventions (``dist_checkpointing`` and the models' ``sharded_state_dict``
at Megatron-LM d98e8a6), written with ``torch.distributed.checkpoint`` itself: ShardedTensor keys without
layer numbers, the layers stacked on a leading axis of size num_layers (or, under ``singleton_local_shards``,
one key per global layer and SwiGLU's ``_w`` / ``_v`` halves), TE-fused norm names, vocabulary rows padded
to 128 x tp, TE ``_extra_state`` ShardedObjects as bytes items ``KEY/shard_L_N``, optimizer and RNG items
beside the model's, the unsharded state in ``common.pt`` (or in the ``common_state`` bytes item, as newer
Megatron keeps it) and ``metadata.json`` naming the backend.

Every weight is fresh random. Import: the full state equals the written tensors bit for bit and the
logits of the imported model match a float64 GPT written from the maths (tests/models/test_gpt_reference)
over the same tensors. Export writes exactly the transcription (keys, global shapes, tensors, one DCP piece
per layer and tensor rank); export -> import is bit-exact. Files that would run code are refused.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_meta
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from omnitron.cli import main as cli
from omnitron.core.checkpoint.hf import write_weights_checkpoint
from omnitron.core.checkpoint.io import read_metadata, read_shard
from omnitron.core.checkpoint.reshard import Layout, model_config, read_full_state
from omnitron.core.models.gpt.presets import gpt2_tiny, llama_tiny
from tests.models.test_gpt_reference import plain_gpt_loss

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process writing, as meant
V, L, TP = 100, 3, 2
TE_NORMS = {"input_layernorm": "self_attention.linear_qkv.layer_norm", "pre_mlp_layernorm": "mlp.linear_fc1.layer_norm"}
TE_EXTRA = ("self_attention.core_attention", "self_attention.linear_qkv", "self_attention.linear_proj",
            "mlp.linear_fc1", "mlp.linear_fc2")


def _cfg(kind: str):
    if kind == "qwen2":  # Megatron's Qwen2 scripts: --disable-bias-linear --add-qkv-bias
        import dataclasses

        return dataclasses.replace(_cfg("llama"), add_qkv_bias=True)
    if kind == "gpt2":
        return gpt2_tiny(num_layers=L, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=V,
                         seq_length=16, max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
    return llama_tiny(num_layers=L, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                      vocab_size=V, seq_length=16, rotary_base=500.0)


def _weights(cfg, seed: int) -> dict:
    """Fresh random tensors for every parameter of ``cfg``'s model (names and shapes from a tp1 model)."""
    from omnitron.core.models.gpt.model import GPTModel
    from omnitron.core.models.gpt.state import gather_full_state
    from omnitron.core.parallel.groups import ParallelGroups

    shapes = gather_full_state(GPTModel(cfg, ParallelGroups.single(), seed=0), ParallelGroups.single())
    g = torch.Generator().manual_seed(seed)
    return {n: (1.0 if "norm" in n and n.endswith("weight") else 0.0) + torch.randn(t.shape, generator=g) * 0.1
            for n, t in shapes.items()}


def _args(cfg, tp: int = TP) -> argparse.Namespace:
    llama = cfg.swiglu
    return argparse.Namespace(
        num_layers=L, hidden_size=32, ffn_hidden_size=cfg.ffn_hidden_size, num_attention_heads=4, kv_channels=8,
        group_query_attention=llama, num_query_groups=2 if llama else 1, seq_length=16, max_position_embeddings=16,
        tokenizer_type="NullTokenizer", vocab_size=V - 1, make_vocab_size_divisible_by=128, padded_vocab_size=128 * tp,
        normalization="RMSNorm" if llama else "LayerNorm", norm_epsilon=cfg.layernorm_epsilon, swiglu=llama,
        position_embedding_type="rope" if llama else "learned_absolute", rotary_base=500 if llama else 10000,
        rotary_percent=1.0, untie_embeddings_and_output_weights=llama, add_bias_linear=not llama,
        add_qkv_bias=cfg.add_qkv_bias, bias_gelu_fusion=not llama, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=2, ckpt_format="torch_dist",
        params_dtype=torch.float32)


# ---- the longhand transcription of Megatron-Core's keys -------------------------------------------------
def _megatron_name(rest: str) -> str:
    """A layer parameter's key: the pre-attention / pre-MLP norms under the TE spec's fused names, which the
    local spec maps its own to (its ``sharded_state_dict_keys_map``)."""
    for norm, fused in TE_NORMS.items():
        if rest.startswith(norm + "."):
            return f"{fused}_{rest.split('.')[-1]}"
    return rest


def _transcribe(W: dict, cfg, *, singleton: bool = False, tp: int = TP) -> dict:
    """``{Megatron key: global tensor}`` of omnitron-named full weights ``W``."""
    out, pad = {}, 128 * tp - V
    for name, t in W.items():
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            out[name] = torch.cat([t, torch.zeros(pad, t.shape[1], dtype=t.dtype)])
        elif not name.startswith("decoder.layers."):
            out[name] = t
    rests = sorted({n.split(".", 3)[3] for n in W if n.startswith("decoder.layers.")})
    for rest in rests:
        key, per = _megatron_name(rest), [W[f"decoder.layers.{i}.{rest}"] for i in range(L)]
        if not singleton:
            out[f"decoder.layers.{key}"] = torch.stack(per)
            continue
        for i, t in enumerate(per):
            if cfg.swiglu and key.startswith("mlp.linear_fc1.") and "norm" not in key:
                out[f"decoder.layers.{i}.{key}_w"], out[f"decoder.layers.{i}.{key}_v"] = t.chunk(2)
            else:
                out[f"decoder.layers.{i}.{key}"] = t
    return out


def _objects(te: bool) -> dict:
    """Megatron's ShardedObjects, each the list of its local objects: TE extra state per layer, an RNG state
    (DCP's save planner torch.saves each into a bytes item, as Megatron's MCoreSavePlanner writes them)."""
    out = {f"decoder.layers.{mod}._extra_state/shard_{i}_{L}": [None] for mod in (TE_EXTRA if te else ())
           for i in range(L)}
    out["rng_state/shard_0.0_1.1"] = [{"random_rng_state": (3, tuple(range(5)), None)}]
    return out


def _write(root: str, tensors: dict, args, *, iteration: int = 1234, te: bool = True, common_in_dcp: bool = False,
           common=None, objects=None) -> str:
    """A Megatron-Core torch_dist directory: DCP tensors and objects, common.pt, metadata.json, tracker."""
    it = os.path.join(root, f"iter_{iteration:07d}")
    os.makedirs(it)
    common = common if common is not None else {
        "args": args, "checkpoint_version": 3.0, "iteration": iteration, "num_floating_point_operations_so_far": 0.0,
        "content_metadata": {"singleton_local_shards": False, "distrib_optim_sharding_type": "dp_reshardable"},
        "opt_param_scheduler": {"num_steps": 9}}
    state = {**tensors, **_objects(te), **(objects or {})}
    state["optimizer.state.exp_avg.embedding.word_embeddings.weight"] = torch.ones(3)  # never read
    if common_in_dcp:
        state["common_state/shard_0_1"] = [common]
    dcp.save(state, storage_writer=FileSystemWriter(it), planner=DefaultSavePlanner(flatten_state_dict=False),
             no_dist=True)  # not flattened: each object list is one bytes item, as Megatron's planner has it
    if not common_in_dcp:
        torch.save(common, os.path.join(it, "common.pt"))
    with open(os.path.join(it, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}, f)
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return it


# ---- import ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,variant", [("gpt2", "common.pt"), ("llama", "common.pt"),
                                          ("llama", "common_in_dcp"), ("llama", "singleton_local"),
                                          ("gpt2", "local_spec"),  # local spec: no TE extra state
                                          ("qwen2", "common.pt")])
def test_import_matches_float64_reference(kind, variant, tmp_path, capsys):
    """The imported state is the written tensors; its logits match float64 maths over them.

    Tolerance: the fp32 engine against float64 on a 3-layer, width-32 model: each logit is a chain of
    sums of <= 64 products per layer, relative error ~ layers x sqrt(64) x 2**-24 = 1.4e-6; 1e-5 bounds it
    with the same margin as tests/models/test_gpt_reference.py. A wrong mapping (a swapped gate / up, a
    misnamed norm, a shifted layer) errs at the weights' own scale, 1e-2 and up."""
    from omnitron.core.models.gpt.model import GPTModel
    from omnitron.core.parallel.groups import ParallelGroups

    cfg = _cfg(kind)
    W = _weights(cfg, seed=int.from_bytes(os.urandom(4), "little"))
    te = variant != "local_spec"
    _write(str(tmp_path / "meg"), _transcribe(W, cfg, singleton=variant == "singleton_local"), _args(cfg),
           te=te, common_in_dcp=variant == "common_in_dcp")
    assert cli(["checkpoint", "import-megatron", "--load", str(tmp_path / "meg"), "--save", str(tmp_path / "ck")]) == 0
    assert "torch_dist checkpoint, iteration 1234" in capsys.readouterr().out
    path = str(tmp_path / "ck" / "iter_0000000")
    got = read_full_state(path).model
    assert sorted(got) == sorted(W) and all(torch.equal(got[n], W[n]) for n in W)
    meta = read_metadata(path)
    assert model_config(meta["model"]) == cfg and meta["imported_from"]["ckpt_format"] == "torch_dist"
    model = GPTModel(model_config(meta["model"]), ParallelGroups.single()).eval()
    model.load_state_dict(read_shard(path, 0)["model"][0])
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    tokens = torch.randint(0, V, (2, 12), generator=g)
    with torch.no_grad():
        logits = model(tokens).transpose(0, 1)[..., :V].double()
    _, ref = plain_gpt_loss({n: t.double() for n, t in W.items()}, cfg, tokens, torch.zeros_like(tokens))
    assert float((logits - ref).norm() / ref.norm()) < 1e-5


# ---- export ----------------------------------------------------------------------------------------------
def _read_back(it: str) -> tuple[dict, dict]:
    """(tensors, {key: number of saved pieces}) of a DCP directory, through torch's own reader."""
    md = FileSystemReader(it).read_metadata()
    tensors = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
               if isinstance(m, dcp_meta.TensorStorageMetadata)}
    dcp.load(tensors, storage_reader=FileSystemReader(it), no_dist=True)
    return tensors, {k: len(m.chunks) for k, m in md.state_dict_metadata.items()
                     if isinstance(m, dcp_meta.TensorStorageMetadata)}


@pytest.mark.parametrize("kind,impl,dtype", [("gpt2", "transformer_engine", torch.float32),
                                             ("llama", "transformer_engine", torch.bfloat16),
                                             ("llama", "local", torch.float32), ("qwen2", "local", torch.float32)])
def test_export_is_the_transcription_and_round_trips(kind, impl, dtype, tmp_path):
    import dataclasses

    cfg = dataclasses.replace(_cfg(kind), params_dtype=dtype)
    W = {n: t.to(dtype) for n, t in _weights(cfg, seed=int.from_bytes(os.urandom(4), "little")).items()}
    write_weights_checkpoint(W, cfg, str(tmp_path / "ck"), Layout(tp=2, pp=1),
                             config={"tokenizer_type": "NullTokenizer"})
    assert cli(["checkpoint", "export-megatron", "--load", str(tmp_path / "ck"), "--out", str(tmp_path / "meg"),
                "--target-tensor-model-parallel-size", str(TP), "--target-pipeline-model-parallel-size", "2",
                "--transformer-impl", impl]) == 0
    it = str(tmp_path / "meg" / "iter_0000000")
    assert (tmp_path / "meg" / "latest_checkpointed_iteration.txt").read_text() == "0"
    assert {".metadata", "__0_0.distcp", "common.pt", "metadata.json"} <= set(os.listdir(it))
    with open(os.path.join(it, "metadata.json")) as f:
        assert json.load(f)["sharded_backend"] == "torch_dist"
    want = _transcribe(W, cfg)
    got, pieces = _read_back(it)
    assert sorted(got) == sorted(want)
    for key, t in want.items():
        assert got[key].dtype == dtype and torch.equal(got[key], t), key
        split = any(key.endswith(s) for s in ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight",
                                              "linear_fc1.bias", "linear_proj.weight", "linear_fc2.weight",
                                              "word_embeddings.weight", "output_layer.weight"))
        parts = (2 * TP if cfg.swiglu and "linear_fc1" in key else TP) if split else 1
        assert pieces[key] == parts * (L if key.startswith("decoder.layers.") else 1), key  # as Megatron's ranks
    objects = set(FileSystemReader(it).read_metadata().state_dict_metadata) - set(got)
    assert objects == {k for k in _objects(True) if "_extra_state" in k}  # under either spec: Megatron asks for them
    common = torch.load(os.path.join(it, "common.pt"), weights_only=False)  # the test's own file: trusted
    assert common["iteration"] == 0 and common["checkpoint_version"] == 3.0
    assert common["content_metadata"]["singleton_local_shards"] is False
    ref = vars(_args(cfg))
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "padded_vocab_size", "vocab_size", "normalization", "swiglu", "position_embedding_type",
                "untie_embeddings_and_output_weights", "add_bias_linear", "add_qkv_bias", "ckpt_format",
                "tensor_model_parallel_size"):
        assert vars(common["args"])[key] == ref[key], key
    assert cli(["checkpoint", "import-megatron", "--load", str(tmp_path / "meg"),
                "--save", str(tmp_path / "back")]) == 0
    back = read_full_state(str(tmp_path / "back" / "iter_0000000"))
    assert model_config(back.meta["model"]) == cfg
    assert sorted(back.model) == sorted(W) and all(back.model[n].dtype == dtype and torch.equal(back.model[n], W[n])
                                                   for n in W)


# ---- bad and hostile input ------------------------------------------------------------------------------
class _Eval:
    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        return (eval, (self.code,))


@pytest.mark.parametrize("where", ["common.pt", "common_in_dcp", "metadata", "extra_state"])
def test_hostile_files_run_no_code(where, tmp_path, capsys):
    """A payload that runs code under plain pickle, in each pickled place of a torch_dist checkpoint: refused
    in one line (the unsharded state, DCP's index), or never unpickled (a TE extra-state bytes item)."""
    marker = tmp_path / "pwned"
    code = f"open({str(marker)!r}, 'w').close()"
    cfg = _cfg("gpt2")
    W = _weights(cfg, seed=1)
    live = tmp_path / "live"  # the payload is live: plain torch.load runs it
    buf = io.BytesIO()
    torch.save([_Eval(f"open({str(live)!r}, 'w').close()")], buf)
    torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert live.exists()
    common = {"args": _args(cfg), "iteration": 7, "hook": _Eval(code)} if where.startswith("common") else None
    objects = {f"decoder.layers.mlp.linear_fc1._extra_state/shard_0_{L}": [_Eval(code)]} if where == "extra_state" \
        else None
    it = _write(str(tmp_path / "meg"), _transcribe(W, cfg), _args(cfg), iteration=7, common=common,
                common_in_dcp=where == "common_in_dcp", objects=objects)
    if where == "metadata":
        with open(os.path.join(it, ".metadata"), "wb") as f:
            pickle.dump(_Eval(code), f)
    rc = cli(["checkpoint", "import-megatron", "--load", str(tmp_path / "meg"), "--save", str(tmp_path / "ck")])
    err = capsys.readouterr().err
    assert not marker.exists()
    if where == "extra_state":
        assert rc == 0  # the bytes item is not read at all
        return
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert ("refused as unsafe" in err) if where != "metadata" else ("is not part of DCP's metadata" in err)


@pytest.mark.parametrize("case,message", [
    ("wrong_layers", "stacks (4,) layers, the args' model 3"),
    ("moe", "no tensor decoder.layers.0.mlp.router.weight"),
    ("no_config", "no torch_dist metadata.json there (DCP files without Megatron's metadata.json"),
    ("other_backend", "sharded_backend 'zarr'"),
    ("missing_tensor", "no tensor decoder.layers.0.mlp.linear_fc2.weight"),
])
def test_import_errors(case, message, tmp_path, capsys):
    cfg = _cfg("gpt2")
    W = _weights(cfg, seed=2)
    tensors, args = _transcribe(W, cfg), _args(cfg)
    if case == "wrong_layers":
        tensors["decoder.layers.mlp.linear_fc2.weight"] = torch.zeros(4, 32, 64)
    if case == "moe":
        args.num_experts = 8
    if case == "missing_tensor":
        del tensors["decoder.layers.mlp.linear_fc2.weight"]
    it = _write(str(tmp_path / "meg"), tensors, args)
    if case == "no_config":
        os.remove(os.path.join(it, "metadata.json"))
    if case == "other_backend":
        with open(os.path.join(it, "metadata.json"), "w") as f:
            json.dump({"sharded_backend": "zarr"}, f)
    assert cli(["checkpoint", "import-megatron", "--load", str(tmp_path / "meg"), "--save", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def _deflate(archive: bytes) -> bytes:
    """The torch.save archive ``archive`` with every record deflate-compressed (torch.load still reads it)."""
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for name in src.namelist():
            dst.writestr(name, src.read(name))
    return out.getvalue()


def _craft(it: str, case: str) -> None:
    """Rewrite ``.metadata`` (and, for ``compressed``, the data file) of iteration directory ``it``."""
    from omnitron.core.checkpoint.dist_planner import read_dcp_metadata

    md = read_dcp_metadata(it)
    data = sorted({i.relative_path for i in md.storage_data.values()})
    if case in ("traversal", "absolute"):  # a valid copy of the data outside: without the check it is read
        outside = os.path.join(os.path.dirname(os.path.dirname(it)), "outside.distcp")
        os.replace(os.path.join(it, data[0]), outside)
        for info in md.storage_data.values():
            info.relative_path = "../../outside.distcp" if case == "traversal" else outside
    if case == "common_length":  # read() would allocate the length declared
        next(i for k, i in md.storage_data.items() if k.fqn.startswith("common_state")).length = 2 ** 50
    if case == "huge":  # 2**40 rows of the embedding over the same few kilobytes
        m = md.state_dict_metadata["embedding.word_embeddings.weight"]
        m.size = torch.Size([2 ** 40, *m.size[1:]])
    if case == "compressed":
        old = open(os.path.join(it, data[0]), "rb").read()
        new = io.BytesIO()
        for index, info in sorted(md.storage_data.items(), key=lambda kv: kv[1].offset):
            chunk = old[info.offset:info.offset + info.length]
            chunk = _deflate(chunk) if isinstance(md.state_dict_metadata[index.fqn],
                                                  dcp_meta.TensorStorageMetadata) else chunk
            info.offset, info.length = new.tell(), len(chunk)
            new.write(chunk)
        new.write(bytes(len(old)))  # padding: the file still holds the bytes the tensors declare
        open(os.path.join(it, data[0]), "wb").write(new.getvalue())
    with open(os.path.join(it, ".metadata"), "wb") as f:
        pickle.dump(md, f)


@pytest.mark.parametrize("case,message", [
    ("traversal", "data file '../../outside.distcp' is not a file name in the checkpoint's directory"),
    ("absolute", "is not a file name in the checkpoint's directory"),
    ("huge", "but the data files holding them have"),
    ("compressed", "is compressed (method 8), which torch.save never writes"),
    ("common_length", f" + {2 ** 50} of __0_0.distcp, which has"),
])
def test_crafted_metadata_is_refused_before_reading(case, message, tmp_path, capsys):
    """DCP's index names the data files and declares each tensor's size, and Megatron's checkpoints carry no
    checksums: a data file outside the directory (a valid copy there, which would otherwise be imported), a
    declared size beyond the bytes stored (``torch.empty`` of it would be attempted first) and a deflated
    chunk (torch.load inflates it to the size its record declares, so a few megabytes could claim gigabytes), and a
    common_state item longer than its file (``read()`` allocates the length asked: MemoryError) are each refused in
    one line naming the checkpoint, and nothing is imported."""
    cfg = _cfg("llama")
    W = _weights(cfg, seed=int.from_bytes(os.urandom(4), "little"))
    it = _write(str(tmp_path / "meg"), _transcribe(W, cfg), _args(cfg), common_in_dcp=case == "common_length")
    _craft(it, case)
    rc = cli(["checkpoint", "import-megatron", "--load", str(tmp_path / "meg"), "--save", str(tmp_path / "ck")])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and it in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(tmp_path / "ck") or not os.listdir(tmp_path / "ck")


@pytest.mark.parametrize("how, says", [("nan", "holds NaN"), ("-inf", "holds inf"), ("int", "is int64, not a")])
def test_nonfinite_or_integer_weight_is_refused_naming_tensor(how, says, tmp_path, capsys):
    """A NaN / inf or integer weight (a random one, at a random element) imported silently; refused in one line
    naming the tensor and the iteration directory."""
    cfg = _cfg("gpt2")
    tensors = _transcribe(_weights(cfg, seed=int.from_bytes(os.urandom(4), "little")), cfg)
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    name = sorted(tensors)[int(torch.randint(len(tensors), (1,), generator=gen))]
    t = tensors[name].clone()
    if how == "int":
        t = t.mul(1000).round().long()
    else:
        t.view(-1)[int(torch.randint(t.numel(), (1,), generator=gen))] = float(how)
    tensors[name] = t
    it = _write(str(tmp_path / "meg"), tensors, _args(cfg))
    assert cli(["checkpoint", "import-megatron", "--load", str(tmp_path / "meg"), "--save", str(tmp_path / "ck")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{it}: tensor {name!r} {says}" in err, err
