"""--ckpt-format torch_dist end to end (one 4-process spawn, tiny Llama-style GPT: SwiGLU, RMSNorm, RoPE,
padded vocabulary, tied embedding; dropout off).

Layout A = tp2 x dp2 with the distributed optimizer. The references are independent of the checkpoint
code: the live tensors of the run that saved, and a run of the same 2N iterations never interrupted.

* round trip: A saves at iteration N, a run at A loads it (no step): every weight, optimizer tensor, step
  and tracker RNG state on every rank equals the saver's, bit for bit; continuing N iterations at A gives
  the uninterrupted run's losses exactly;
* another layout: loading A's checkpoint at tp1 x dp4 (plain optimizer) and at pp2 x dp2 (distributed
  optimizer, the tied embedding split over the stages) gives exactly A's full weights and optimizer
  tensors (gathered by the model's own collective gather), and N more iterations match the uninterrupted
  run within the fp32 bound below;
* no gather on save: during a torch_dist save no floating-point tensor crosses any collective and the
  distributed optimizer's gather is never called (the same probe on the old format sees both, so it
  can fail).
"""
from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch

from omnitron.testing.distributed import run_distributed
from test_reshard import _live_full, _same  # the model's collective gather; bit-for-bit nested comparison

N = 2
FMT = ["--ckpt-format", "torch_dist"]
A = ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]
B = {"tp1_dp4": [], "pp2_dp2_zero": ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"]}
# Bound for another layout (fp32, u = 2^-24 ~ 6e-8): a layout change reorders the sums of each matmul
# (length k <= 4 * 32 = 128) and of the gradient reductions over dp. One reordered sum differs by at
# most gamma_k ~ k*u ~ 8e-6 relative in the worst case, ~sqrt(k)*u ~ 7e-7 typically; 4 layers and N = 2
# steps of lr 3e-3 with gradients clipped to 0.05 (each step moves a weight by < 1e-4) keep the loss's
# relative change O(layers * sqrt(k) * u) ~ 3e-6. 1e-5 leaves a 3x margin and is 100x below the loss
# change of one training step here (~1e-3 relative).
RTOL = 1e-5


def _args(layout, save, extra=()):
    return ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--swiglu",
            "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--seq-length", "16",
            "--max-position-embeddings", "16", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200", "--num-workers", "0",
            "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", str(2 * N), "--lr", "3e-3",
            "--lr-warmup-iters", "0", "--clip-grad", "0.05", "--log-interval", "1", "--seed", "5", "--no-tensorboard",
            "--save", save, "--data-cache-path", os.path.join(os.path.dirname(save), "cache"), *FMT, *layout, *extra]


def _snapshot(c) -> dict:
    """This rank's live weights, optimizer tensors (its own slices under the distributed optimizer),
    step and tracker states, cloned."""
    opt = c.optimizer
    return {"model": [{k: v.clone() for k, v in m.state_dict().items()} for m in c.modules],
            "state": {k: [t.clone() for t in v] for k, v in opt.state.items()},
            "masters": [t.clone() for t in opt.masters], "step": opt.step_count,
            "trackers": [m.rng_tracker.get_states() for m in c.modules]}


def _probe_save(c, root: str, fmt: str) -> dict:
    """Save ``c`` in ``fmt`` under a fresh directory, counting the bytes of every tensor a c10d
    collective op receives (seen at the dispatcher, as CommDebugMode does; by dtype class) and the
    distributed optimizer's gathers."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from omnitron.core.optim.distributed import DistributedOptimizer
    from omnitron.core.training import checkpointing

    seen = {"float": 0, "other": 0, "gathers": 0, "ops": set()}

    def count(a):
        for t in a if isinstance(a, (list, tuple)) else [a]:
            if isinstance(t, (list, tuple)):
                count(t)
            elif isinstance(t, torch.Tensor):
                seen["float" if t.is_floating_point() else "other"] += t.numel() * t.element_size()

    class Collectives(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                seen["ops"].add(func.__name__)
                for a in (*args, *(kwargs or {}).values()):
                    count(a)
            return func(*args, **(kwargs or {}))

    gather = DistributedOptimizer._gather

    def counted_gather(self, *a, **kw):
        seen["gathers"] += 1
        return gather(self, *a, **kw)

    DistributedOptimizer._gather = counted_gather
    ck = c.settings.checkpoint
    old = ck.save, ck.ckpt_format
    ck.save, ck.ckpt_format = os.path.join(root, "probe_" + fmt), fmt
    try:
        with Collectives():
            checkpointing.save(c)
    finally:
        ck.save, ck.ckpt_format = old
        DistributedOptimizer._gather = gather
    seen["state_bytes"] = c.optimizer.state_bytes()
    seen["ops"] = sorted(seen["ops"])
    return seen


@contextlib.contextmanager
def _late_first_write(delay_s: float = 2.0):
    """Delay DCP's file writes for iteration 1 by ``delay_s`` (past iteration 2's step, which changes the
    live tensors: only a snapshot taken before the save returned still holds iteration 1's values)."""
    from torch.distributed.checkpoint import filesystem

    write = filesystem.FileSystemWriter.write_data

    def late(self, plan, planner):
        if "iter_0000001" in str(self.path):
            time.sleep(delay_s)
        return write(self, plan, planner)

    filesystem.FileSystemWriter.write_data = late
    try:
        yield
    finally:
        filesystem.FileSystemWriter.write_data = write


@contextlib.contextmanager
def _staging_probe(seen: dict):
    """Record how many staging buffer sets --async-save allocates (``seen["built"]``) and, per iteration,
    the memory of the pieces it hands to the background write (``seen[N]``: sorted data pointers)."""
    from omnitron.core.checkpoint import dist, dist_staging

    init, write = dist_staging.Staging.__init__, dist.write

    def counted(self, *a, **kw):
        seen["built"] = seen.get("built", 0) + 1
        init(self, *a, **kw)

    def recorded(tmp, rank, pieces, *a, **kw):
        seen[int(os.path.basename(tmp).split("_")[1].split(".")[0])] = sorted(
            v.data_ptr() for _, ps in pieces.values() for _, v in ps)
        return write(tmp, rank, pieces, *a, **kw)

    dist_staging.Staging.__init__, dist.write = counted, recorded
    try:
        yield
    finally:
        dist_staging.Staging.__init__, dist.write = init, write


def _async_failure(run) -> str:
    """An --async-save run whose rank 1 fails to write a digest of iteration 2 (after DCP's write, so
    the other ranks' writes succeed): the error this rank raises at the end-of-training commit."""
    import torch.distributed as tdist

    from omnitron.core.checkpoint import CheckpointError, integrity

    write = integrity.write_digest

    def failing(path):
        if tdist.get_rank() == 1 and "iter_0000002" in path:
            raise OSError("disk full (test)")
        return write(path)

    integrity.write_digest = failing
    try:
        run(A, "A_fail", "--exit-interval", str(N), "--save-interval", "1", "--async-save")
    except CheckpointError as err:
        return str(err)
    finally:
        integrity.write_digest = write
    return "no error"


def _worker(root):
    from omnitron.testing.training import worker_runner

    run = worker_runner(_args, root)

    ck = os.path.join(root, "A")
    out = {"full": run(A, "full")["losses"]}
    first = run(A, "A", "--exit-interval", str(N), "--save-interval", "1")
    c = first["components"]
    out["saved"] = _snapshot(c)
    out["probe"] = {fmt: _probe_save(c, root, fmt) for fmt in ("torch_dist", "torch")}
    out["live"] = _live_full(c)
    out["loaded"] = _snapshot(run(A, "A_rt", "--load", ck, "--train-iters", str(N))["components"])
    out["cont_A"] = run(A, "cont_A", "--load", ck)["losses"]
    out["staging"] = {}
    with _late_first_write(), _staging_probe(out["staging"]):
        run(A, "A_async", "--exit-interval", str(N), "--save-interval", "1", "--async-save")
    out["cont_async"] = run(A, "cont_async", "--load", os.path.join(root, "A_async"))["losses"]
    for name, layout in B.items():
        out["live_" + name] = _live_full(run(layout, "loaded_" + name, "--load", ck, "--train-iters", str(N))
                                         ["components"])
        out["cont_" + name] = run(layout, "cont_" + name, "--load", ck)["losses"]
    out["async_failure"] = _async_failure(run)  # last: this run ends in an error
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    return root, run_distributed(_worker, 4, str(root), timeout_s=600)


def test_round_trip_is_bit_exact(results):
    root, res = results
    from omnitron.core.checkpoint import find_latest, read_metadata

    meta = read_metadata(find_latest(str(root / "A")))
    assert meta["ckpt_format"] == "torch_dist" and meta["iteration"] == N and meta["dcp_files"]
    assert set(meta["checksums"]) == {".metadata", *meta["dcp_files"], *meta["shards"],
                                      *(f + ".chunks.json" for f in meta["dcp_files"])}
    for r, rank in enumerate(res):
        assert rank["saved"]["step"] == N
        _same(rank["loaded"], rank["saved"], f"rank {r}")
    full = res[0]["full"]
    assert sorted(full) == list(range(1, 2 * N + 1)) and len(set(full.values())) == 2 * N
    assert res[0]["cont_A"] == {i: v for i, v in full.items() if i > N}


def test_async_save_equals_the_synchronous_one(results):
    """--async-save at every iteration (each save waits for the previous one, the last is committed at the
    end) writes what the synchronous saves wrote, bit for bit -- iteration 1's too, snapshotted while
    iteration 2 changed the live tensors -- and resuming from it continues the uninterrupted run exactly."""
    from omnitron.core.checkpoint import find_latest, read_metadata
    from omnitron.core.checkpoint.io import iter_dir_name, read_shard
    from omnitron.core.checkpoint.reshard import read_full_state

    root, res = results
    assert find_latest(str(root / "A_async")).endswith(iter_dir_name(N))
    for it in range(1, N + 1):
        a, s = (str(root / d / iter_dir_name(it)) for d in ("A_async", "A"))
        fa, fs = read_full_state(a), read_full_state(s)
        assert fa.optimizer.get("exp_avg") and fa.model
        for part in ("model", "optimizer", "optimizer_meta", "scheduler"):
            _same(getattr(fa, part), getattr(fs, part), f"iteration {it} {part}")
        ma, ms = read_metadata(a), read_metadata(s)
        assert (ma["iteration"], ma["consumed_samples"]) == (ms["iteration"], ms["consumed_samples"]) == (it, 4 * it)
        for r in range(4):
            _same(read_shard(a, r), read_shard(s, r), f"iteration {it} rank {r}")
    assert res[0]["cont_async"] == {i: v for i, v in res[0]["full"].items() if i > N}


def test_async_save_reuses_its_staging_buffers(results):
    """The host staging buffers are allocated once (before the first step) and every save copies into
    the same memory: iteration 2's write reads the buffers iteration 1's wrote from. That reuse corrupts
    neither checkpoint: both equal the synchronous saves bit for bit
    (:func:`test_async_save_equals_the_synchronous_one`)."""
    _, res = results
    for r, rank in enumerate(res):
        seen = rank["staging"]
        assert seen["built"] == 1, (r, seen["built"])
        assert seen[1] and seen[1] == seen[N], f"rank {r}: iteration {N} was staged in other memory"


def test_async_save_failure_on_one_rank_commits_nothing(results):
    """A background write that fails on rank 1 only is one CheckpointError on every rank (none hangs);
    nothing is committed: 'latest' stays on iteration 1."""
    from omnitron.core.checkpoint import find_latest

    root, res = results
    for r, rank in enumerate(res):
        msg = rank["async_failure"]
        assert "background save of iteration 2 failed on rank 1" in msg and "'latest' names the previous" in msg, msg
        assert ("disk full (test)" in msg) == (r == 1), msg
        assert "\n" not in msg
    assert find_latest(str(root / "A_fail")).endswith("iter_0000001")
    assert not (root / "A_fail" / "iter_0000002").exists()


def test_async_save_needs_torch_dist(tmp_path):
    from omnitron.core.config.parallel import ConfigError
    from omnitron.core.training.arguments import parse_settings

    args = _args([], str(tmp_path / "ck"), ["--async-save"])
    assert parse_settings(args, 1).checkpoint.async_save
    with pytest.raises(ConfigError, match="^--async-save needs --ckpt-format torch_dist .*add --ckpt-format"):
        parse_settings([*args, "--ckpt-format", "torch"], 1)


def test_other_layouts_read_exactly_and_continue(results):
    _, res = results
    live = {}
    for rank in res:
        for key in ("live", *("live_" + n for n in B)):
            for kind, d in rank[key].items():
                live.setdefault(key, {}).setdefault(kind, {}).update(d)
    assert "exp_avg" in live["live"] and "decoder.layers.3.mlp.linear_fc1.weight" in live["live"]["model"]
    want = {i: v for i, v in res[0]["full"].items() if i > N}
    for name in B:
        _same(live["live_" + name], live["live"], name)
        got = res[0]["cont_" + name]
        assert sorted(got) == sorted(want), name
        for it, loss in want.items():
            assert abs(got[it] - loss) <= RTOL * abs(loss), (name, it, got[it], loss)


def test_save_gathers_no_optimizer_state(results):
    _, res = results
    for r, rank in enumerate(res):
        dist_, old = rank["probe"]["torch_dist"], rank["probe"]["torch"]
        assert dist_["gathers"] == 0 and dist_["float"] == 0 and dist_["ops"], (r, dist_)
        # the probe sees the old format's all-gather of the replicated optimizer state
        assert old["gathers"] > 0 and old["float"] >= old["state_bytes"], (r, old)


def _read_whole(path: str, key: str, shape) -> torch.Tensor:
    """One global tensor read in this process (no process group) through the verified reader."""
    from omnitron.core.checkpoint import dist, read_metadata

    out = torch.zeros(shape)
    dist.read({key: (tuple(shape), [((0,) * len(shape), out)])}, path, read_metadata(path)["checksums"])
    return out


def _chunk_middle(path: str, key: str, name: str) -> int:
    """The middle byte of the first chunk of ``key`` in data file ``name`` (readers verify only what they read)."""
    from omnitron.core.checkpoint import read_metadata
    from omnitron.core.checkpoint.dist_planner import VerifiedReader

    md = VerifiedReader(path, read_metadata(path)["checksums"]).read_metadata()
    info = min((i for idx, i in md.storage_data.items() if idx.fqn == key and i.relative_path == name),
               key=lambda i: i.offset)
    return info.offset + info.length // 2


def test_reader_verifies_and_unpickles_nothing_else(results, tmp_path):
    """A global tensor read alone equals the model's own gather; a flipped byte in a data file or in
    ``.metadata`` is an error naming the file; a ``.metadata`` pickle naming any other class is refused
    even when metadata.json's checksum was rewritten to match it."""
    import json
    import pickle
    import shutil

    from omnitron.core.checkpoint import CheckpointError, find_latest
    from omnitron.core.checkpoint.integrity import file_digest

    root, res = results
    name = "embedding.word_embeddings.weight"
    want = {k: v for r in res for k, v in r["live"]["model"].items()}[name]
    src = find_latest(str(root / "A"))
    assert torch.equal(_read_whole(src, "model/" + name, want.shape), want)
    for victim in ("__0_0.distcp", ".metadata"):
        bad = str(tmp_path / victim.strip("_.")) + "_iter"
        shutil.copytree(src, bad)
        with open(os.path.join(bad, victim), "r+b") as f:  # a data file: inside a chunk of the tensor read
            f.seek(_chunk_middle(src, "model/" + name, victim) if victim.endswith(".distcp") else
                   os.path.getsize(f.name) // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 1]))
        with pytest.raises(CheckpointError, match=f"{victim} is corrupt"):
            _read_whole(bad, "model/" + name, want.shape)
    evil = str(tmp_path / "evil")
    shutil.copytree(src, evil)
    with open(os.path.join(evil, ".metadata"), "wb") as f:
        pickle.dump(os.getcwd, f)  # any callable outside DCP's metadata classes
    meta_file = os.path.join(evil, "metadata.json")
    meta = json.load(open(meta_file))
    meta["checksums"][".metadata"] = file_digest(os.path.join(evil, ".metadata"))
    json.dump(meta, open(meta_file, "w"))
    with pytest.raises(CheckpointError, match="posix.getcwd is not part of DCP's metadata"):
        _read_whole(evil, "model/" + name, want.shape)


def test_offline_readers_read_torch_dist(results, tmp_path):
    """The offline readers take a torch_dist checkpoint: ``read_full_state`` of the tp2 x dp2 torch_dist
    probe save equals the model's own collective gather of the live run (an independent reference) and
    the old-format probe save of the same state; ``checkpoint convert`` to tp1 writes the same old-format
    shards, ``export-hf`` the same files, ``inspect`` succeeds, as from the old-format save; converting
    either to torch_dist (tp2 x pp2) reads back as the same full state."""
    import shutil

    from safetensors.torch import load_file

    from omnitron.cli import main
    from omnitron.commands.checkpoint import resolve
    from omnitron.core.checkpoint import find_latest, read_metadata
    from omnitron.core.checkpoint.io import read_shard
    from omnitron.core.checkpoint.reshard import read_full_state

    root, res = results
    live = {}
    for rank in res:
        for kind, d in rank["live"].items():
            live.setdefault(kind, {}).update(d)
    src = {fmt: find_latest(str(root / ("probe_" + fmt))) for fmt in ("torch_dist", "torch")}
    assert read_metadata(src["torch_dist"]).get("ckpt_format") == "torch_dist"
    assert read_metadata(src["torch"]).get("ckpt_format") is None
    full = {fmt: read_full_state(p) for fmt, p in src.items()}
    _same({"model": full["torch_dist"].model, **full["torch_dist"].optimizer}, live, "read_full_state vs live")
    for part in ("model", "optimizer", "optimizer_meta", "scheduler", "dropped"):
        _same(getattr(full["torch_dist"], part), getattr(full["torch"], part), part)
    out = {}
    for fmt, p in src.items():
        conv, back = str(tmp_path / ("tp1_" + fmt)), str(tmp_path / ("dist_tp1_" + fmt))
        assert main(["checkpoint", "convert", "--load", p, "--save", conv, "--target-tensor-model-parallel-size",
                     "1", "--target-pipeline-model-parallel-size", "1", "--target-ckpt-format", "torch"]) == 0
        # either format converted to torch_dist reads back as the same full state (the format is kept by default)
        for frm in (conv, p):
            kept = read_metadata(resolve(frm)).get("ckpt_format") == "torch_dist"  # the default keeps it
            assert main(["checkpoint", "convert", "--load", frm, "--save", back, "--target-tensor-model-parallel-size",
                         "2", "--target-pipeline-model-parallel-size", "2"] + (
                             [] if kept else ["--target-ckpt-format", "torch_dist"])) == 0
            again = read_full_state(find_latest(back))
            assert again.meta["ckpt_format"] == "torch_dist" and again.meta["layout"]["tensor_model_parallel_size"] == 2
            for part in ("model", "optimizer", "optimizer_meta", "scheduler"):
                _same(getattr(again, part), getattr(full["torch"], part), f"{frm} -> torch_dist {part}")
            shutil.rmtree(back)
        assert main(["checkpoint", "inspect", conv]) == 0
        hf = str(tmp_path / ("hf_" + fmt))
        assert main(["checkpoint", "export-hf", "--load", p, "--out", hf]) == 0
        meta = read_metadata(find_latest(conv))
        assert meta.get("ckpt_format") is None and meta["world_size"] == 1
        out[fmt] = {"shard": read_shard(find_latest(conv), 0), "hf": load_file(os.path.join(hf, "model.safetensors")),
                    "config": open(os.path.join(hf, "config.json")).read()}
    assert out["torch_dist"]["hf"] and out["torch_dist"]["shard"]["optimizer"]["tensors"]
    _same(out["torch_dist"], out["torch"], "converted / exported")
