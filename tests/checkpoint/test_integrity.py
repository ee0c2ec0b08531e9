"""Checkpoint integrity: per-shard checksums, crash-safe re-saves, a lost ``latest``, corrupt metadata
(Megatron's pickled files: test_untrusted_pickles.py)."""
from __future__ import annotations

import hashlib
import json
import logging
import os

import pytest
import torch

from omnitron.core.checkpoint import CheckpointError, find_latest, load_checkpoint, read_metadata
from omnitron.core.checkpoint import integrity
from omnitron.core.checkpoint.io import list_checkpoints, save_checkpoint, write_checkpoint


def _shard(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g, dtype=torch.float64), "step": seed}


def _save(d, it, seed, world_size=1):
    meta = {"model": {"hidden_size": 8}, "layout": {"tensor_model_parallel_size": 1}, "consumed_samples": it}
    if world_size == 1:
        return save_checkpoint(str(d), it, _shard(seed), meta, rank=0, world_size=1, barrier=lambda: None)
    return write_checkpoint(str(d), it, ((r, _shard(seed + r)) for r in range(world_size)), meta,
                            world_size=world_size)


def _one_line(err) -> str:
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg


def test_checksums_recorded_and_a_flipped_byte_is_named(tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    path = _save(tmp_path, 7, seed, world_size=2)
    meta = read_metadata(path)
    for name in ("rank_00000.pt", "rank_00001.pt"):  # the recorded digest is the file's, computed independently
        assert meta["checksums"][name] == "sha256:" + hashlib.sha256(open(os.path.join(path, name), "rb").read()
                                                                     ).hexdigest()
    assert not any(n.endswith(".sha256") for n in os.listdir(path))  # folded into metadata.json
    assert torch.equal(load_checkpoint(path, 1)[1]["w"], _shard(seed + 1)["w"])
    victim = os.path.join(path, "rank_00001.pt")
    data = bytearray(open(victim, "rb").read())
    pos = int.from_bytes(os.urandom(4), "little") % len(data)
    data[pos] ^= 1 << (pos % 8)  # one bit anywhere in the file
    open(victim, "wb").write(bytes(data))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, 1)
    assert "rank_00001.pt is corrupt" in _one_line(err) and "earlier iteration" in str(err.value)
    load_checkpoint(path, 0)  # the other shard still verifies


def test_resave_has_no_window_without_a_complete_latest(tmp_path, monkeypatch):
    """Every rename and replace of a re-save is watched: before and after each one, ``latest``
    resolves to a complete checkpoint whose shard verifies and is the old or the new one."""
    _save(tmp_path, 20, 1)
    old, new = _shard(1)["w"], _shard(2)["w"]
    seen = []

    def check():
        shard = load_checkpoint(find_latest(str(tmp_path)), 0)[1]["w"]
        seen.append("old" if torch.equal(shard, old) else "new" if torch.equal(shard, new) else "other")

    for name in ("rename", "replace"):
        real = getattr(os, name)

        def watched(a, b, _real=real):
            check()
            _real(a, b)
            check()
        monkeypatch.setattr(os, name, watched)
    _save(tmp_path, 20, 2)
    monkeypatch.undo()
    assert "other" not in seen and seen[0] == "old" and seen[-1] == "new", seen
    assert sorted(os.listdir(tmp_path)) == ["iter_0000020", "latest"]


def test_death_between_the_renames_loads_and_is_repaired(tmp_path, monkeypatch):
    _save(tmp_path, 20, 1)
    real = os.rename

    class Killed(BaseException):
        pass

    def dies_on_second(a, b):
        if a.endswith(".tmp"):
            raise Killed  # the process dies after moving the old directory aside
        real(a, b)
    monkeypatch.setattr(os, "rename", dies_on_second)
    with pytest.raises(Killed):
        _save(tmp_path, 20, 2)
    monkeypatch.undo()
    assert not os.path.exists(tmp_path / "iter_0000020")
    path = find_latest(str(tmp_path))  # the new, complete copy (still named .tmp)
    assert torch.equal(load_checkpoint(path, 0)[1]["w"], _shard(2)["w"])
    assert list_checkpoints(str(tmp_path)) == [20]
    _save(tmp_path, 30, 3)  # the next save finishes the interrupted swap first
    assert sorted(os.listdir(tmp_path)) == ["iter_0000020", "iter_0000030", "latest"]
    assert torch.equal(load_checkpoint(str(tmp_path / "iter_0000020"), 0)[1]["w"], _shard(2)["w"])


def test_lost_latest_falls_back_to_the_newest_complete(tmp_path, caplog):
    for it in (10, 20):
        _save(tmp_path, it, it)
    os.makedirs(tmp_path / "iter_0000030")  # committed name, but its metadata is gone
    torch.save(_shard(30), tmp_path / "iter_0000030" / "rank_00000.pt")
    os.remove(tmp_path / "latest")
    with caplog.at_level(logging.WARNING, logger="omnitron.checkpoint"):
        path = find_latest(str(tmp_path))
    assert path.endswith("iter_0000020") and load_checkpoint(path, 0)[0]["iteration"] == 20
    assert "no 'latest' pointer; loading the newest complete checkpoint, iter_0000020" in caplog.text
    assert "skipping iter_0000030" in caplog.text
    for it in (10, 20):
        os.remove(tmp_path / f"iter_{it:07d}" / "metadata.json")
    with pytest.raises(CheckpointError) as err:
        find_latest(str(tmp_path))
    assert "no 'latest' pointer and no complete checkpoint" in _one_line(err) and "metadata.json" in str(err.value)


def test_a_megatron_checkpoint_given_to_load_names_the_import(tmp_path):
    """Megatron's layout (iter_N/mp_rank_00/model_optim_rng.pt and its tracker file) under --load: the error says
    what it is and the command that converts it, not that omnitron's metadata is missing."""
    import random

    it = random.randrange(1, 10**6)
    os.makedirs(tmp_path / f"iter_{it:07d}" / "mp_rank_00")
    (tmp_path / f"iter_{it:07d}" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"not read")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text(str(it))
    with pytest.raises(CheckpointError) as err:
        find_latest(str(tmp_path))
    assert "is a Megatron-LM checkpoint" in _one_line(err) and "omnitron checkpoint import-megatron" in str(err.value)


def test_a_megatron_torch_dist_checkpoint_given_to_load_names_the_import(tmp_path):
    """Megatron's default --ckpt-format torch_dist (iter_N/metadata.json naming its sharded backend, as Megatron-Core's
    dist_checkpointing writes it, beside common.pt and DCP's files) under --load: the same one-line error naming the
    import, not that omnitron's metadata is corrupt (metadata.json exists there, so the tracker check never runs)."""
    import random

    it = random.randrange(1, 10**6)
    d = tmp_path / f"iter_{it:07d}"
    os.makedirs(d)
    (d / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                 "common_backend": "torch", "common_backend_version": 1}))
    for name in ("common.pt", "__0_0.distcp", ".metadata"):
        (d / name).write_bytes(b"not read")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text(str(it))
    with pytest.raises(CheckpointError) as err:
        read_metadata(find_latest(str(tmp_path), quiet=True))
    one = _one_line(err)
    assert "is a Megatron-LM checkpoint (--ckpt-format torch_dist" in one and "corrupt" not in one
    assert f"omnitron checkpoint import-megatron --load {tmp_path} " in one and "not carried" in one


@pytest.mark.parametrize("content,message", [
    (b"\x00\x9f{garbage", "metadata.json is not valid JSON"),
    (b"[1, 2]", "metadata.json lacks everything"),
    (json.dumps({"iteration": 3, "format_version": 1}).encode(), "metadata.json lacks world_size, shards, model"),
])
def test_garbage_metadata_is_one_line(tmp_path, content, message):
    path = _save(tmp_path, 3, 3)
    open(os.path.join(path, "metadata.json"), "wb").write(content)
    with pytest.raises(CheckpointError) as err:
        read_metadata(path)
    assert message in _one_line(err) and path in str(err.value)


def test_bad_latest_and_missing_shard(tmp_path):
    path = _save(tmp_path, 4, 4, world_size=2)
    os.remove(os.path.join(path, "rank_00001.pt"))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, 1)
    assert "shard rank_00001.pt is missing" in _one_line(err)
    (tmp_path / "latest").write_bytes(b"\xff\xfe../../etc")
    with pytest.raises(CheckpointError) as err:
        find_latest(str(tmp_path))
    assert "not an iter_NNNNNNN directory name" in _one_line(err)


def test_digest_sidecar_missing_is_refused(tmp_path):
    d = tmp_path / "x"
    d.mkdir()
    (d / "rank_00000.pt").write_bytes(os.urandom(100))
    with pytest.raises(integrity.IntegrityError, match="left no sha256 digest"):
        integrity.collect_digests(str(d), ["rank_00000.pt"])


def test_train_load_errors_are_one_line(tmp_path, capsys, caplog):
    """``omnitron train --load``: a flipped byte, garbage metadata.json, a missing shard and a flipped or
    deleted DCP ``.metadata`` (the default torch_dist format) each end the run with one line naming the
    file and exit code 2 (all but the missing shard before any worker starts). Read inside a worker
    (``dist.read``), a bad ``.metadata`` is one CheckpointError and DCP logs no traceback of its fallback."""
    import shutil

    from omnitron.cli import main

    def train(*extra):
        capsys.readouterr()
        rc = main(["train", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
                   "--seq-length", "16", "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type",
                   "NullTokenizer", "--vocab-size", "100", "--num-workers", "0", "--micro-batch-size", "2",
                   "--global-batch-size", "4", "--no-tensorboard", "--data-cache-path", str(tmp_path / "cache"),
                   *extra])
        err = capsys.readouterr().err.strip()
        return rc, err

    save = str(tmp_path / "ck")
    assert train("--train-iters", "1", "--save", save)[0] == 0
    it = os.path.join(save, "iter_0000001")
    for name, damage, words in (("rank_00000.pt", "flip", "rank_00000.pt is corrupt: its sha256"),
                                ("metadata.json", b"{\"iteration\": 1,", "metadata.json is not valid JSON"),
                                ("rank_00000.pt", None, "shard rank_00000.pt is missing"),
                                (".metadata", "flip", ".metadata is corrupt: its sha256"),
                                (".metadata", None, ".metadata is missing")):
        broken = str(tmp_path / "broken")
        shutil.rmtree(broken, ignore_errors=True)
        shutil.copytree(save, broken)
        target = os.path.join(broken, "iter_0000001", name)
        if damage == "flip":
            data = bytearray(open(target, "rb").read())
            data[len(data) // 2] ^= 0x10
            open(target, "wb").write(bytes(data))
        elif damage is None:
            os.remove(target)
        else:
            open(target, "wb").write(damage)
        rc, err = train("--train-iters", "2", "--load", broken, "--use-checkpoint-opt_param-scheduler")
        assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert err.startswith("omnitron train: error: ") and words in err and "iter_0000001" in err, err
        if name == ".metadata":
            _dist_read_is_one_line(os.path.join(broken, "iter_0000001"), it, words, caplog)
    resumed = train("--train-iters", "2", "--load", save, "--use-checkpoint-opt_param-scheduler")
    assert resumed[0] == 0 and os.path.isdir(it)  # the intact copy resumes


def _dist_read_is_one_line(broken: str, intact: str, words: str, caplog) -> None:
    """``dist.read`` (what each rank runs) of checkpoint ``broken``: one CheckpointError, no DCP log record."""
    from omnitron.core.checkpoint import dist
    from omnitron.core.checkpoint.dist_planner import VerifiedReader

    checksums = read_metadata(intact)["checksums"]
    key = "model/embedding.word_embeddings.weight"
    shape = tuple(VerifiedReader(intact, checksums).read_metadata().state_dict_metadata[key].size)
    caplog.clear()
    with pytest.raises(CheckpointError) as err, caplog.at_level(logging.DEBUG):
        dist.read({key: (shape, [((0,) * len(shape), torch.zeros(shape))])}, broken, checksums, collective=False)
    assert words in _one_line(err) and not [r for r in caplog.records if r.exc_info], caplog.records


@pytest.mark.parametrize("fmt", ["torch_dist", "torch", "async"])
def test_full_disk_during_a_save_is_one_line_and_leaves_no_partial_directory(tmp_path, capsys, monkeypatch, fmt):
    """The disk fills up while iteration 2 is written (the write raises ENOSPC after part of its bytes, as a
    full filesystem does): one line saying so, exit 2, no ``iter_0000002.tmp`` left, ``latest`` on iteration 1."""
    import errno

    import torch.distributed.checkpoint.filesystem as dcp_fs

    from omnitron.cli import main
    from omnitron.core.checkpoint import io

    def full(path: str) -> bool:
        return "iter_0000002.tmp" in str(path)

    if fmt in ("torch_dist", "async"):  # async: DCP's write on the background thread
        real_item = dcp_fs._write_item

        def write_item(transforms, stream, data, *args, **kwargs):
            if full(getattr(stream, "name", "")):
                stream.write(b"\0" * 100)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_item(transforms, stream, data, *args, **kwargs)

        monkeypatch.setattr(dcp_fs, "_write_item", write_item)
    else:
        real_file = io._write_file

        def write_file(path, write):
            if full(path):
                open(path, "wb").write(b"\0" * 100)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_file(path, write)

        monkeypatch.setattr(io, "_write_file", write_file)
    save = tmp_path / "ck"
    rc = main(["train", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
               "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
               "100", "--num-workers", "0", "--micro-batch-size", "2", "--global-batch-size", "4", "--no-tensorboard",
               "--data-cache-path", str(tmp_path / "cache"), "--train-iters", "2", "--save-interval", "1",
               *(["--ckpt-format", "torch_dist", "--async-save"] if fmt == "async" else ["--ckpt-format", fmt]),
               "--save", str(save)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("omnitron")]
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"omnitron train: error: {save}: the disk is full (") and "saving iter_0000002; the " \
        "partial iter_0000002.tmp was removed and 'latest' still names the previous checkpoint" in err[0], err
    assert sorted(os.listdir(save)) == ["iter_0000001", "latest", "metrics.jsonl", "omnitron.lock"]
    assert (save / "latest").read_text() == "iter_0000001"


def test_a_short_write_counts_as_a_full_disk_only_when_space_is_low(tmp_path, monkeypatch):
    """torch's zip writer reports a short write as "unexpected pos A vs B": a full disk when little space is left
    (below ``LOW_SPACE_BYTES``), another fault otherwise; ENOSPC anywhere in the chain always is one."""
    import errno

    from omnitron.core.checkpoint import io

    short = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")
    wrapped = CheckpointError("torch_dist save failed")
    wrapped.__context__ = OSError(errno.ENOSPC, "No space left on device")
    free = {"bytes": io.LOW_SPACE_BYTES - 1}
    monkeypatch.setattr(io, "_free_bytes", lambda d: free["bytes"])
    assert io.disk_full(short, str(tmp_path)) and io.disk_full(wrapped, str(tmp_path))
    free["bytes"] = io.LOW_SPACE_BYTES
    assert not io.disk_full(short, str(tmp_path)) and io.disk_full(wrapped, str(tmp_path))
    assert not io.disk_full(ValueError("bad shape"), str(tmp_path))


def test_chunk_index_hashes_each_range_and_the_whole_file_in_one_pass(tmp_path):
    """Reference: hashlib over the file's bytes and over each slice. A flipped byte fails only the chunk
    holding it; the index is JSON with its own digest beside it."""
    data = os.urandom(5000)
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(data)
    ranges = [(0, 1200), (1200, 3000), (4200, 800)]
    integrity.write_chunk_index(str(path), ranges)
    index = integrity.read_chunk_index(str(path) + integrity.CHUNK_INDEX)
    assert index == {(o, n): "sha256:" + hashlib.sha256(data[o:o + n]).hexdigest() for o, n in ranges}
    assert (tmp_path / "__0_0.distcp.sha256").read_text() == "sha256:" + hashlib.sha256(data).hexdigest()
    assert (tmp_path / "__0_0.distcp.chunks.json.sha256").exists()
    bad = bytearray(data)
    bad[1500] ^= 1  # inside the second chunk
    path.write_bytes(bytes(bad))
    for o, n in ranges[::2]:
        integrity.verify_range(str(path), o, n, index[(o, n)])
    with pytest.raises(integrity.IntegrityError, match=r"__0_0.distcp is corrupt: bytes 1200..4200"):
        integrity.verify_range(str(path), 1200, 3000, index[(1200, 3000)])


def test_block_index_packs_each_chunks_digests_and_refuses_a_malformed_one(tmp_path):
    """Reference: hashlib per block (64 KiB blocks; row-aligned pieces keep PIECE_HEX hex characters). The parsed
    index holds one bytes object of raw digests per chunk, item j equal to block j's digest; digests of unequal
    length, odd length or not hexadecimal are refused in one line naming the chunk."""
    block = integrity.BLOCK
    data = os.urandom(2 * block + 777)
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(data)
    ranges = [(0, len(data) - 100), (len(data) - 100, 100)]
    integrity.write_chunk_index(str(path), ranges)
    index = str(path) + integrity.CHUNK_INDEX
    size, algorithm, chunks = integrity.read_block_index(index)
    assert (size, algorithm) == (block, "sha256")
    for o, n in ranges:
        layout, digests = chunks[(o, n)]
        want = [hashlib.sha256(data[o + a:o + min(a + block, n)]).digest() for a in range(0, n, block)]
        assert layout is None and isinstance(digests.raw, bytes) and len(digests) == len(want)
        assert [digests[j] for j in range(len(digests))] == want
    # a row-aligned chunk: a header block, 300-byte pieces, a trailer block; PIECE_HEX hex characters a digest
    layout = (64, 300, 64 + 300 * 7 + 50)
    integrity.write_chunk_index(str(path), [(0, 4000)], layouts={(0, 4000): layout})
    _, _, chunks = integrity.read_block_index(index)
    bounds = integrity.block_bounds(4000, layout, block)
    assert chunks[(0, 4000)][0] == layout and chunks[(0, 4000)][1].width == integrity.PIECE_HEX // 2
    assert [chunks[(0, 4000)][1][j] for j in range(len(bounds) - 1)] == [
        hashlib.sha256(data[a:b]).digest()[:integrity.PIECE_HEX // 2] for a, b in zip(bounds, bounds[1:])]
    short = json.loads(open(index).read())
    short["blocks"]["0:4000"]["digests"] = [d[:integrity.PIECE_HEX - 2] for d in short["blocks"]["0:4000"]["digests"]]
    with open(index, "w") as f:
        json.dump(short, f)
    with pytest.raises(integrity.IntegrityError, match="chunk 0:4000 has a malformed block layout or digests shorter"):
        integrity.read_block_index(index)
    integrity.write_chunk_index(str(path), ranges)
    raw = json.loads(open(index).read())
    key = f"{ranges[0][0]}:{ranges[0][1]}"
    for bad, match in ((lambda d: d[:-1] + [d[-1][:-2]], "unequal or odd"), (lambda d: [x[:-1] for x in d], "odd"),
                       (lambda d: ["zz" + x[2:] for x in d], "not hexadecimal")):
        broken = json.loads(json.dumps(raw))
        broken["blocks"][key] = bad(raw["blocks"][key])
        with open(index, "w") as f:
            json.dump(broken, f)
        with pytest.raises(integrity.IntegrityError, match=f"chunk {key}: .*{match}.*re-save the checkpoint"):
            integrity.read_block_index(index)


@pytest.mark.parametrize("name", ["../outside.distcp", "{outside}", "sub/__0_0.distcp", ".."])
def test_dcp_data_file_outside_the_checkpoint_is_refused(tmp_path, name):
    """DCP's ``.metadata`` names each tensor's data file; one that is not a bare name in the checkpoint directory
    (its checksum may be forged beside it in metadata.json) is refused before anything is read. The reference is
    torch's own reader, which follows the name and loads the tensor from outside."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from omnitron.core.checkpoint.dist_planner import read_dcp_metadata

    w = torch.randn(int.from_bytes(os.urandom(1), "little") + 1, dtype=torch.float64)
    it = tmp_path / "ck" / "iter_0000001"
    dcp.save({"w": w}, storage_writer=FileSystemWriter(str(it)), no_dist=True)
    outside = tmp_path / "ck" / "outside.distcp"
    os.replace(it / "__0_0.distcp", outside)
    os.makedirs(it / "sub")
    md = read_dcp_metadata(str(it))
    for info in md.storage_data.values():
        info.relative_path = name.format(outside=outside)
    (it / ".metadata").write_bytes(pickle.dumps(md))
    if name.startswith("../") or name.startswith("{"):  # live: torch's reader loads the tensor from outside
        got = {"w": torch.zeros_like(w)}
        dcp.load(got, storage_reader=FileSystemReader(str(it)), no_dist=True)
        assert torch.equal(got["w"], w)
    with pytest.raises(CheckpointError) as err:
        read_dcp_metadata(str(it))
    assert f"{it}/.metadata: data file" in _one_line(err) and "is not a file name in the checkpoint's" in str(err.value)


def test_block_bounds_cut_the_tensor_bytes_every_piece_and_the_ends_once():
    """block_bounds' definition, on random chunks: without a layout a block every ``block`` bytes (the last
    shorter); with ``(start, piece, end)`` the header ``[0, start)`` one block (if any), the tensor's bytes cut every
    ``piece`` bytes from ``start`` (the last piece shorter), the trailer ``[end, length)`` one block (if any).
    Reference: the boundaries walked one by one. (A reader of a column slice reads exactly the pieces it needs only
    when every piece boundary is there: the writer and the reader share this function, so a dropped boundary is
    invisible to a round trip.)"""
    import random

    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    for _ in range(200):
        length = rng.randrange(1, 5000)
        start = rng.choice([0, rng.randrange(0, length + 1)])
        end = rng.choice([length, rng.randrange(start, length + 1)])
        piece, block = rng.randrange(1, 300), rng.randrange(1, 700)
        want, at = ([0] if start else []), start
        while at < end:
            want.append(at)
            at += piece
        want += [end] + ([length] if end < length else [])
        assert integrity.block_bounds(length, (start, piece, end), block) == want, (seed, length, start, piece, end)
        plain, at = [], 0
        while at < length:
            plain.append(at)
            at += block
        assert integrity.block_bounds(length, None, block) == plain + [length], (seed, length, block)


@pytest.mark.parametrize("size", [0, -65536])
def test_block_index_with_a_block_size_under_one_byte_is_refused(tmp_path, size):
    """A chunk index whose block size is not positive (corrupt or crafted) cannot cut a chunk into blocks: refused
    as an IntegrityError naming the size, before a reader divides by it or walks ``range(0, n, size)`` (a
    ValueError there, or an endless read)."""
    data = os.urandom(3000)
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(data)
    integrity.write_chunk_index(str(path), [(0, 3000)])
    index = str(path) + integrity.CHUNK_INDEX
    raw = json.loads(open(index).read())
    raw["blocks"]["size"] = size
    with open(index, "w") as f:
        json.dump(raw, f)
    with pytest.raises(integrity.IntegrityError, match=f"block size {size} or algorithm 'sha256' is not valid"):
        integrity.read_block_index(index)


@pytest.mark.parametrize("key, value, what", [
    ("world_size", 0, "an integer >= 1"), ("world_size", True, "an integer >= 1"), ("iteration", -1, "an integer >= 0"),
    ("consumed_samples", 2.5, "an integer >= 0"), ("shards", "rank_0.pt", "a list of file names"),
    ("ckpt_format", "zip", '"torch" or "torch_dist"'), ("checksums", {"rank_0.pt": 7}, "an object of file name")])
def test_a_metadata_field_just_outside_its_type_is_named(tmp_path, key, value, what):
    """Each field omnitron reads is checked before use: a value just past its range (a world of 0 ranks, a negative
    iteration, a fraction of a sample, a bool for a count, ...) is refused in one line naming the field, its value
    and what it must be."""
    path = _save(tmp_path, 3, 3)
    meta = json.loads(open(os.path.join(path, "metadata.json")).read())
    meta[key] = value
    open(os.path.join(path, "metadata.json"), "w").write(json.dumps(meta))
    with pytest.raises(CheckpointError) as err:
        read_metadata(path)
    assert f"'{key}' is {json.dumps(value)}, not {what}" in _one_line(err), err.value
