"""Checkpoint directories: atomic commit, latest pointer, pruning, compatibility errors, RNG capture."""
from __future__ import annotations

import hashlib
import json
import os
import random

import numpy as np
import pytest
import torch

from omnitron.backends import get_backend
from omnitron.core.checkpoint import (CheckpointError, check_compatible, find_latest, get_rng_state, load_checkpoint,
                                      read_metadata, save_checkpoint, set_rng_state)
from omnitron.core.checkpoint.io import list_checkpoints


def _save(d, it, value, keep=None):
    shard = {"w": torch.full((3,), float(value)), "step": it, "nested": {"a": [1, 2.5, "x"]}}
    meta = {"model": {"hidden_size": 8}, "layout": {"tensor_model_parallel_size": 1}, "consumed_samples": it * 4}
    return save_checkpoint(str(d), it, shard, meta, rank=0, world_size=1, barrier=lambda: None, keep_last_n=keep)


def test_save_load_latest_and_prune(tmp_path):
    for it in (10, 20, 30):
        _save(tmp_path, it, it, keep=2)
    assert list_checkpoints(str(tmp_path)) == [20, 30]
    assert open(tmp_path / "latest").read() == "iter_0000030"
    path = find_latest(str(tmp_path))
    meta, shard = load_checkpoint(path, 0)
    assert meta["iteration"] == 30 and meta["consumed_samples"] == 120 and meta["shards"] == ["rank_00000.pt"]
    assert torch.equal(shard["w"], torch.full((3,), 30.0)) and shard["nested"]["a"] == [1, 2.5, "x"]
    assert not any(n.endswith(".tmp") for n in os.listdir(tmp_path))


def test_killed_save_resumes_from_previous(tmp_path):
    _save(tmp_path, 10, 1)
    # a save of iteration 20 killed half-way: temp dir with a partial shard, pointer untouched
    os.makedirs(tmp_path / "iter_0000020.tmp")
    (tmp_path / "iter_0000020.tmp" / "rank_00000.pt").write_bytes(b"\x80\x02partial")
    assert find_latest(str(tmp_path)).endswith("iter_0000010")
    _save(tmp_path, 20, 2)  # the next save clears the stale temp dir
    assert find_latest(str(tmp_path)).endswith("iter_0000020")
    assert find_latest(str(tmp_path / "nothing")) is None
    (tmp_path / "latest").write_text("iter_0000099")
    with pytest.raises(CheckpointError, match="missing or incomplete"):
        find_latest(str(tmp_path))


def test_partial_saves_of_other_iterations_are_removed(tmp_path):
    """A save killed half-way (SIGKILL after a scheduler's grace time) at an iteration the resumed run never saves
    again (a save on a stop signal, between intervals) left its iter_N.tmp, a checkpoint's worth of disk, for good
    (--keep-last-n does not see it either). The next save removes every partial one; a complete iter_N.tmp (killed
    between its metadata and its rename: complete, --ckpt-step loads it) stays. Fails without the fix: 1234's
    partial directory is still there after the save of 2000."""
    _save(tmp_path, 1000, 1)
    os.makedirs(tmp_path / "iter_0001234.tmp")
    (tmp_path / "iter_0001234.tmp" / "rank_00000.pt").write_bytes(os.urandom(4096))
    complete = str(_save(tmp_path / "other", 1500, 3))
    os.rename(complete, tmp_path / "iter_0001500.tmp")  # committed, but its rename never happened
    (tmp_path / "latest").write_text("iter_0001000")
    assert find_latest(str(tmp_path)).endswith("iter_0001000") and list_checkpoints(str(tmp_path)) == [1000]
    _save(tmp_path, 2000, 2, keep=5)
    left = sorted(os.listdir(tmp_path))
    assert "iter_0001234.tmp" not in left and "iter_0001500.tmp" in left, left
    assert list_checkpoints(str(tmp_path)) == [1000, 2000]
    with pytest.raises(CheckpointError, match=r"--ckpt-step 1234: .* \(complete: 1000, 2000\)"):
        find_latest(str(tmp_path), step=1234)
    assert find_latest(str(tmp_path), step=1500).endswith("iter_0001500.tmp")


@pytest.mark.skipif(not hasattr(__import__("signal"), "SIGXFSZ"), reason="RLIMIT_FSIZE is POSIX")
def test_a_save_past_the_file_size_limit_says_so_in_one_line(tmp_path):
    """A file-size limit (RLIMIT_FSIZE: ``ulimit -f``, a scheduler's) cuts a shard short: torch's writer says only
    "unexpected pos", and the save left a traceback and its partial iter_N.tmp. Now one CheckpointError line names
    the limit (errno EFBIG) and that nothing was committed, the partial directory is gone and 'latest' names the
    previous checkpoint, which loads. Fails without the fix: a RuntimeError ("unexpected pos ...")."""
    import resource

    _save(tmp_path, 1, 1)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    limit = 64 << 10
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))  # CPython ignores SIGXFSZ: writes fail with EFBIG
    try:
        with pytest.raises(CheckpointError) as failed:
            save_checkpoint(str(tmp_path), 2, {"w": torch.randn(limit // 2)}, {"model": {}, "layout": {}}, rank=0,
                            world_size=1, barrier=lambda: None)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    line = str(failed.value)
    assert "\n" not in line and "saving iter_0000002 failed" in line and f"RLIMIT_FSIZE / ulimit -f, of {limit} " \
        "bytes" in line and "'latest' still names the previous checkpoint" in line, line
    assert not os.path.exists(tmp_path / "iter_0000002.tmp")
    assert find_latest(str(tmp_path)).endswith("iter_0000001")


def test_refuses_pickled_objects(tmp_path):
    _save(tmp_path, 1, 1)
    path = tmp_path / "iter_0000001" / "rank_00000.pt"
    torch.save({"evil": object()}, path)
    # whoever can replace a shard can rewrite metadata.json too: the checksum must not be the only guard
    meta_path = tmp_path / "iter_0000001" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["checksums"]["rank_00000.pt"] = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(Exception, match="(?i)weights_only|unsupported|global"):
        load_checkpoint(str(tmp_path / "iter_0000001"), 0)


def test_compatibility_errors_name_the_flag(tmp_path):
    _save(tmp_path, 5, 0)
    meta = read_metadata(find_latest(str(tmp_path)))
    meta["model"] = {"hidden_size": 8}
    meta["layout"] = {"tensor_model_parallel_size": 2, "data_parallel_size": 1}
    check_compatible(meta, {"hidden_size": 8}, {"tensor_model_parallel_size": 2, "data_parallel_size": 1}, "D")
    with pytest.raises(CheckpointError, match="--hidden-size 8, this run 16"):
        check_compatible(meta, {"hidden_size": 16}, meta["layout"], "D")
    with pytest.raises(CheckpointError, match="--tensor-model-parallel-size 2, this run uses 1"):
        check_compatible(meta, {"hidden_size": 8}, {"tensor_model_parallel_size": 1, "data_parallel_size": 1}, "D")
    # a checkpoint written before --add-qkv-bias existed (no key) is one without the bias
    check_compatible(meta, {"hidden_size": 8, "add_qkv_bias": False}, meta["layout"], "D")
    with pytest.raises(CheckpointError, match="--add-qkv-bias False, this run True"):
        check_compatible(meta, {"hidden_size": 8, "add_qkv_bias": True}, meta["layout"], "D")


@pytest.mark.parametrize("layout, run, num_experts, split", [
    ({"expert_tensor_parallel_size": 1}, {}, 4, 1),  # import-hf at tp2: whole experts, no run settings
    ({"expert_tensor_parallel_size": 1}, {"expert_tensor_parallel_size": None}, 4, 1),  # the record wins
    ({"expert_tensor_parallel_size": 2}, {"expert_tensor_parallel_size": None}, 4, 2),  # a training run at tp2
    ({}, {"expert_tensor_parallel_size": None}, 4, 2),  # older than the record: unset means tp (training's default)
    ({}, {"expert_tensor_parallel_size": 1}, 4, 1),
    ({}, {}, 4, 1),  # an older import (no run settings): whole experts
    ({}, {"expert_tensor_parallel_size": None}, None, 1),  # a dense model
])
def test_expert_split_of_a_checkpoint_is_what_its_writer_recorded(layout, run, num_experts, split):
    """The experts' tensor-parallel split a checkpoint's shards hold (what resharding, inspect, export and generate
    read) is its layout's record, the run's flat setting only for checkpoints older than that record; a resume
    compares it with the run's own split."""
    from omnitron.core.checkpoint.io import saved_expert_tp

    meta = {"model": {"hidden_size": 8, "num_experts": num_experts}, "config": run,
            "layout": {"tensor_model_parallel_size": 2, "data_parallel_size": 1, **layout}}
    assert saved_expert_tp(meta) == split
    now = {"tensor_model_parallel_size": 2, "data_parallel_size": 1, "expert_tensor_parallel_size": 2}
    assert check_compatible(meta, meta["model"], now, "D", reshard=True) == \
        ([] if split == 2 else ["expert_tensor_parallel_size 1 -> 2"])


def test_rng_round_trip(tmp_path):
    from omnitron.core.parallel.tensor.random import RNGTracker

    be = get_backend("cpu")
    tracker = RNGTracker(be)
    tracker.add("model-parallel", 77)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.randn()  # leave a cached gaussian around
    state = get_rng_state(be, tracker)
    torch.save(state, tmp_path / "rng.pt")

    def draw():
        with tracker.fork():
            t = torch.rand(3)
        # numpy: the cached gaussian, then uniforms from the key's saved position (randn above moved it off 0)
        return random.random(), float(np.random.randn()), np.random.random(3).tolist(), torch.rand(3), t

    first = draw()
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True), be, tracker)
    second = draw()
    assert first[:3] == second[:3] and torch.equal(first[3], second[3]) and torch.equal(first[4], second[4])
