"""Checkpoint resharding: a checkpoint saved under one parallel layout loads under another.

One 4-process spawn trains a Llama-style model (GQA with 2 query groups, SwiGLU, RoPE, biases, a
tied embedding, padded vocabulary) for N iterations at tp2 x pp2 x vp2 and saves. The trained
state is gathered live with the model's own collective gather (the reference). The checkpoint is
then loaded under five other layouts (tp1 dp4; tp4, whose 2 query groups force replicated KV;
uneven pp2 dp2; tp2 dp2 with sequence parallelism and the distributed optimizer; pp2 dp2 with the
V-shaped zb-v schedule; pp2 x vpp3 dp2 with the embedding and the loss counted as layers), each saved
straight back (compared with the reference tensor by tensor, exactly) and trained N more
iterations (losses equal to continuing at tp2 x pp2 x vp2, fp32 tolerance; dropout is off, so
fresh RNG streams do not matter). The same spawn does it once more in bf16 (fp32 masters) into
tp1, and for an MoE model whose 4 experts are spread over ep2 (tp2 -> pp2). The offline tests
then convert tp2 x pp2 x vp2 -> tp4 -> back with the command line and compare every tensor
bit for bit, and check inspect, export and the errors.
"""
from __future__ import annotations

import os

import pytest
import torch

from omnitron.testing.distributed import run_distributed

N = 2
A = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
     "--num-layers-per-virtual-pipeline-stage", "1"]
B = {"tp1_dp4": [],
     "tp4_replicated_kv": ["--tensor-model-parallel-size", "4"],
     "pp2_uneven_dp2": ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"],
     "tp2_dp2_sp_zero": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer"],
     # the V placement (rank 0 holds layer 0, layer 3 and both tied embedding copies)
     "pp2_zb_v_dp2": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                      "--pipeline-schedule", "zb-v"],
     # the embedding and the loss counted as layers: 6 slots at pp2 x vpp3, the end chunks hold no layer
     "pp2_account_vp3_dp2": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                             "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]}
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-tensor-parallel-size", "1",
       "--expert-model-parallel-size", "2"]
MOE_A, MOE_B = ["--tensor-model-parallel-size", "2", *MOE], ["--pipeline-model-parallel-size", "2", *MOE]


def _args(layout, save, extra=()):
    return ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
            "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--seq-length", "16",
            "--max-position-embeddings", "16", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200", "--num-workers", "0",
            "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", str(2 * N), "--lr", "3e-3",
            "--lr-warmup-iters", "0", "--clip-grad", "0.05", "--log-interval", "1", "--seed", "5", "--no-tensorboard",
            "--save", save, "--data-cache-path", os.path.join(os.path.dirname(save), "cache"),
            "--ckpt-format", "torch", *layout, *extra]  # this file tests the torch format's resharding


def _live_full(c) -> dict:
    """Every model weight and optimizer tensor at full shape, by the model's collective gather
    (each optimizer tensor replaces its parameter's data first, at its fp32 dtype; the run is over)."""
    from omnitron.core.models.gpt.state import gather_full_state

    def gather(m):  # cloned: for replicated parameters the gather returns the parameter itself
        return {n: t.clone() for n, t in gather_full_state(m, c.groups).items()}

    out = {"model": {}}
    for m in c.modules:
        out["model"].update(gather(m))
    tensors = c.optimizer.state_dict()["tensors"]
    for kind in next(iter(tensors.values())):
        d = out.setdefault(kind, {})
        for i, m in enumerate(c.modules):
            for name, p in m.named_parameters():
                p.data = tensors[f"chunk{i}.{name}"][kind].clone()
            d.update(gather(m))
    return out


def _worker(root):
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.training import checkpointing
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    torch.set_num_threads(1)
    be, world = get_backend(), dist.get_world_size()

    def run(layout, save, *extra):
        if "--load" in extra:  # the checkpoint's schedule whatever the --train-iters
            extra = (*extra, "--use-checkpoint-opt_param-scheduler")
        return train(parse_settings(_args(layout, os.path.join(root, save), extra), world), be)

    ck = os.path.join(root, "A")
    first = run(A, "A", "--exit-interval", str(N))
    out = {"first": first["losses"], "live": _live_full(first["components"])}
    out["cont_A"] = run(A, "cont_A", "--load", ck)["losses"]
    for name, layout in B.items():
        loaded = run(layout, "loaded_" + name, "--load", ck, "--train-iters", str(N))  # load, no steps
        checkpointing.save(loaded["components"])
        out["cont_" + name] = run(layout, "cont_" + name, "--load", ck)["losses"]
    bf16 = run(A, "bf16", "--bf16", "--exit-interval", str(N))
    out["live_bf16"] = _live_full(bf16["components"])
    checkpointing.save(run([], "loaded_bf16", "--bf16", "--load", os.path.join(root, "bf16"),
                           "--train-iters", str(N))["components"])
    out.update(_moe(run, root))
    return out


def _moe(run, root) -> dict:
    """MoE, experts over ep2: 2N iterations at tp2 (saving at N), then iteration N loaded at pp2."""
    import shutil

    import torch.distributed as dist

    a = run(MOE_A, "moe_A", "--save-interval", str(N))
    if dist.get_rank() == 0:  # a directory holding only iteration N
        shutil.copytree(os.path.join(root, "moe_A", "iter_%07d" % N), os.path.join(root, "moe_N", "iter_%07d" % N))
    dist.barrier()
    ck = os.path.join(root, "moe_N")
    from omnitron.core.training import checkpointing

    checkpointing.save(run(MOE_B, "loaded_moe", "--load", ck, "--train-iters", str(N))["components"])
    return {"moe_A": a["losses"], "cont_moe": run(MOE_B, "cont_moe", "--load", ck)["losses"]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    results = run_distributed(_worker, 4, str(root), timeout_s=600)
    live = {}
    for r in results:  # each pipeline stage gathered its own tensors
        for key in ("live", "live_bf16"):
            for kind, d in r[key].items():
                live.setdefault(key, {}).setdefault(kind, {}).update(d)
    return root, results[0], live


def _assert_equal(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want)))
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), (what, name)


def _check_full(path: str, live: dict, what: str) -> None:
    from omnitron.core.checkpoint.reshard import read_full_state

    full = read_full_state(path)
    _assert_equal(full.model, live["model"], what + " weights")
    for kind in ("exp_avg", "exp_avg_sq", "master"):
        if kind in live:
            _assert_equal(full.optimizer[kind], live[kind], f"{what} {kind}")
    assert set(full.optimizer) == set(live) - {"model"}, what


def test_loads_under_other_layouts_exactly(trained):
    """(a) weights and (b) optimizer tensors after loading under each layout B equal the trained ones."""
    from omnitron.core.checkpoint import find_latest, load_checkpoint

    root, res, live = trained
    assert sorted(res["first"]) == list(range(1, N + 1))
    _check_full(find_latest(str(root / "A")), live["live"], "saved tp2 pp2 vp2")
    for name in B:
        _check_full(find_latest(str(root / ("loaded_" + name))), live["live"], "loaded " + name)
        meta, _ = load_checkpoint(find_latest(str(root / ("loaded_" + name))), 0)
        assert meta["iteration"] == N and meta["consumed_samples"] == 4 * N
    _check_full(find_latest(str(root / "loaded_bf16")), live["live_bf16"], "bf16 loaded tp1")
    assert "master" in live["live_bf16"] and live["live_bf16"]["model"]["decoder.layers.0.mlp.linear_fc1.weight"] \
        .dtype == torch.bfloat16
    # independently of the reader: a tp1 pp1 shard holds the full tensors as they are (vocab padded)
    _, shard = load_checkpoint(find_latest(str(root / "loaded_tp1_dp4")), 3)
    sd, ref = shard["model"][0], live["live"]["model"]
    assert sorted(sd) == sorted(ref)
    for name, t in ref.items():
        assert torch.equal(sd[name][: t.shape[0]], t) and not sd[name][t.shape[0]:].any(), name
    assert shard["optimizer"]["step"] == N and "rng" in shard


def test_training_continues_identically(trained):
    """(c) N more iterations under each layout B match continuing under tp2 x pp2 x vp2 (and the
    MoE run at pp2 x ep2 matches its tp2 x ep2 run)."""
    _, res, _ = trained
    cases = [(name, res["cont_A"], res["cont_" + name]) for name in B]
    cases.append(("moe", {i: v for i, v in res["moe_A"].items() if i > N}, res["cont_moe"]))
    for name, want, got in cases:
        assert sorted(want) == list(range(N + 1, 2 * N + 1)) and len(set(want.values())) == N, name
        assert sorted(got) == sorted(want), name
        for it, loss in want.items():
            assert abs(got[it] - loss) <= 1e-5 * abs(loss), (name, it, got, want)


def test_moe_experts_reshard(trained):
    """Every expert (spread over ep ranks, differently at tp2 and at pp2) and its optimizer state survive."""
    from omnitron.core.checkpoint import find_latest
    from omnitron.core.checkpoint.reshard import read_full_state

    root = trained[0]
    saved = read_full_state(find_latest(str(root / "moe_N")))
    loaded = read_full_state(find_latest(str(root / "loaded_moe")))
    experts = {(n.split(".")[2], n.split(".")[5]) for n in saved.model if ".mlp.experts." in n}  # (layer, expert)
    assert len(experts) == 4 * 4
    _assert_equal(loaded.model, saved.model, "moe weights")
    assert sorted(loaded.optimizer) == sorted(saved.optimizer) == ["exp_avg", "exp_avg_sq"]
    for kind in saved.optimizer:
        _assert_equal(loaded.optimizer[kind], saved.optimizer[kind], "moe " + kind)


def _shards(path: str) -> list[dict]:
    from omnitron.core.checkpoint import load_checkpoint, read_metadata

    return [load_checkpoint(path, r)[1] for r in range(read_metadata(path)["world_size"])]


def _same(a, b, where: str) -> None:
    """Nested dicts / lists of tensors and plain values, bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), (where, sorted(set(a) ^ set(b)))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def test_convert_round_trip_is_bit_exact(trained, tmp_path, capsys):
    """A -> tp4 pp1 -> A with the command line reproduces every shard's model, optimizer and
    scheduler tensors exactly; inspect and export report the model."""
    from safetensors.torch import load_file

    from omnitron.cli import main
    from omnitron.core.checkpoint import find_latest, read_metadata

    root, _, live = trained
    src = find_latest(str(root / "A"))
    assert main(["checkpoint", "convert", "--load", str(root / "A"), "--save", str(tmp_path / "tp4"),
                 "--target-tensor-model-parallel-size", "4", "--target-pipeline-model-parallel-size", "1"]) == 0
    said = [ln.split("] ", 1)[1] for ln in capsys.readouterr().out.splitlines() if ln.startswith("[")]
    assert said[0].startswith("reading ") and said[1].startswith("writing 4 shards under ")
    assert said[-1].startswith("converted ")  # each phase in its own timed line
    meta4 = read_metadata(find_latest(str(tmp_path / "tp4")))
    assert meta4["layout"]["tensor_model_parallel_size"] == 4 and meta4["world_size"] == 4
    assert meta4["config"]["tensor_model_parallel_size"] == 4
    assert meta4["resharded_from"]["pipeline_model_parallel_size"] == 2
    assert main(["checkpoint", "convert", "--load", str(tmp_path / "tp4"), "--save", str(tmp_path / "back"),
                 "--target-tensor-model-parallel-size", "2", "--target-pipeline-model-parallel-size", "2",
                 "--target-num-layers-per-virtual-pipeline-stage", "1"]) == 0
    back = find_latest(str(tmp_path / "back"))
    assert read_metadata(back)["layout"] == read_metadata(src)["layout"]
    for r, (a, b) in enumerate(zip(_shards(src), _shards(back))):
        assert "rng" not in b
        for key in ("model", "optimizer", "scheduler"):
            _same(a[key], b[key], f"rank{r}.{key}")
    capsys.readouterr()
    assert main(["checkpoint", "inspect", str(tmp_path / "tp4")]) == 0
    text = capsys.readouterr().out
    n = sum(t.numel() for t in live["live"]["model"].values())
    assert "tp4 pp1 dp1" in text and f"{n:,}" in text and "converted    from tp2 pp2 vp2" in text
    assert "decoder.layers.3.self_attention.linear_qkv.weight" in text and "(64, 32)" in text  # (4 + 2*2) heads x 8
    assert main(["checkpoint", "export", "--load", back, "--out", str(tmp_path / "m.safetensors")]) == 0
    _assert_equal(load_file(str(tmp_path / "m.safetensors")), live["live"]["model"], "export")


def test_convert_to_and_from_the_account_layout(trained, tmp_path, capsys):
    """A -> pp2 x vpp3 with --target-account-for-embedding/loss-in-pipeline-split (end chunks without layers) holds
    the trained tensors, records the layout and the flags a resume reads, and converts back to A bit for bit;
    target flags that do not fit are refused in one line naming the --target- flag."""
    from omnitron.cli import main
    from omnitron.core.checkpoint import find_latest, read_metadata

    root, _, live = trained
    src = find_latest(str(root / "A"))
    account = ["--target-pipeline-model-parallel-size", "2", "--target-account-for-embedding-in-pipeline-split",
               "--target-account-for-loss-in-pipeline-split"]
    assert main(["checkpoint", "convert", "--load", src, "--save", str(tmp_path / "acc"),
                 "--target-tensor-model-parallel-size", "1", *account,
                 "--target-num-layers-per-virtual-pipeline-stage", "1"]) == 0
    acc = find_latest(str(tmp_path / "acc"))
    meta = read_metadata(acc)
    assert meta["layout"]["virtual_pipeline_model_parallel_size"] == 3
    assert meta["layout"]["account_for_embedding_in_pipeline_split"] is True
    assert meta["layout"]["account_for_loss_in_pipeline_split"] is True
    assert meta["config"]["num_virtual_stages_per_pipeline_rank"] == 3
    assert "num_layers_per_virtual_pipeline_stage" not in meta["config"]
    assert meta["config"]["account_for_embedding_in_pipeline_split"] is True
    _check_full(acc, live["live"], "converted to pp2 vpp3 +embedding +loss")
    assert main(["checkpoint", "convert", "--load", acc, "--save", str(tmp_path / "back"),
                 "--target-tensor-model-parallel-size", "2", "--target-pipeline-model-parallel-size", "2",
                 "--target-num-virtual-stages-per-pipeline-rank", "2"]) == 0
    back = find_latest(str(tmp_path / "back"))
    assert read_metadata(back)["layout"] == read_metadata(src)["layout"]
    for r, (a, b) in enumerate(zip(_shards(src), _shards(back))):
        for key in ("model", "optimizer", "scheduler"):
            _same(a[key], b[key], f"rank{r}.{key}")
    capsys.readouterr()
    for extra, needle in [(["--target-decoder-first-pipeline-num-layers", "1"],
                           "--target-account-for-embedding/loss-in-pipeline-split and --target-decoder-first/last"),
                          (["--target-num-virtual-stages-per-pipeline-rank", "2"], "do not split over 2 virtual")]:
        assert main(["checkpoint", "convert", "--load", src, "--save", str(tmp_path / "bad"),
                     "--target-tensor-model-parallel-size", "1", *account, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err
    assert main(["checkpoint", "convert", "--load", src, "--save", str(tmp_path / "bad"),
                 "--target-tensor-model-parallel-size", "1", "--target-pipeline-model-parallel-size", "2",
                 "--target-decoder-first-pipeline-num-layers", "2",
                 "--target-num-layers-per-virtual-pipeline-stage", "1"]) == 2
    assert "--target-num-virtual-stages-per-pipeline-rank instead" in capsys.readouterr().err


def test_errors_are_clear(trained, tmp_path, capsys):
    """Missing / corrupt shards, a model-shape mismatch and an impossible target layout."""
    import shutil

    from omnitron.cli import main
    from omnitron.core.checkpoint import CheckpointError, find_latest
    from omnitron.core.checkpoint.reshard import read_full_state
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.checkpointing import check_resume

    root, _, _ = trained
    ck = tmp_path / "A"
    shutil.copytree(root / "A", ck)
    check_resume(parse_settings(_args(B["tp4_replicated_kv"], str(tmp_path / "x"), ["--load", str(ck)]), 4))
    with pytest.raises(CheckpointError, match="--hidden-size 32, this run 64"):
        check_resume(parse_settings(_args([], str(tmp_path / "x"), ["--load", str(ck), "--hidden-size", "64"]), 1))
    path = find_latest(str(ck))
    capsys.readouterr()
    assert main(["checkpoint", "convert", "--load", str(ck), "--save", str(tmp_path / "bad"),
                 "--target-tensor-model-parallel-size", "3", "--target-pipeline-model-parallel-size", "1"]) == 2
    assert "tensor" in capsys.readouterr().err
    with open(os.path.join(path, "rank_00002.pt"), "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match="rank_00002.pt is corrupt: its sha256"):  # caught by the checksum
        read_full_state(path)
    os.remove(os.path.join(path, "rank_00002.pt"))
    with pytest.raises(CheckpointError, match="shard rank_00002.pt is missing"):
        read_full_state(path)
    assert main(["checkpoint", "inspect", str(ck)]) == 2
    assert "rank_00002.pt is missing" in capsys.readouterr().err


def test_layout_changes_and_older_metadata():
    """A layout difference is reported (or refused without ``reshard``); keys missing from older
    checkpoints' metadata mean their defaults, so such a checkpoint still resumes without resharding."""
    from omnitron.core.checkpoint import CheckpointError, check_compatible
    from omnitron.core.checkpoint.io import LAYOUT_KEYS

    now = {k: None for k in LAYOUT_KEYS}
    now.update(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, context_parallel_size=1,
               data_parallel_size=2, expert_model_parallel_size=1)
    older = {k: v for k, v in now.items() if k != "expert_model_parallel_size" and not k.startswith("decoder")}
    meta = {"model": {"hidden_size": 8}, "layout": older}
    assert check_compatible(meta, {"hidden_size": 8}, now, "D", reshard=True) == []
    moved = dict(now, tensor_model_parallel_size=1, data_parallel_size=4)
    assert check_compatible(meta, {"hidden_size": 8}, moved, "D", reshard=True) == [
        "tensor_model_parallel_size 2 -> 1", "data_parallel_size 2 -> 4"]
    with pytest.raises(CheckpointError, match="--tensor-model-parallel-size 2, this run uses 1.*checkpoint convert"):
        check_compatible(meta, {"hidden_size": 8}, moved, "D")
