"""torch_dist balance and chunk integrity at dp4 with the distributed optimizer (one 4-process spawn).

* balance: the weights, which the four data-parallel ranks hold as copies, are written once between them
  (each a quarter of every tensor) and the optimizer slices by their owners: the largest writer's file is at
  most 1.25x the mean (before: data-parallel rank 0 wrote every weight, 1.5-2x the mean);
* integrity per chunk: a flipped byte inside a weight chunk that rank 0 wrote, which every rank reads to
  load, stops the load on every rank with one line naming the file; a reader of one tensor hashes exactly
  the chunks holding it, far fewer bytes than the files.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from omnitron.testing.distributed import run_distributed

LAYOUT = ["--use-distributed-optimizer"]


def _args(layout, save, extra=()):
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            "256", "--num-workers", "0", "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "1",
            "--lr", "1e-3", "--log-interval", "1", "--no-tensorboard", "--save", save, "--save-interval", "1",
            "--data-cache-path", os.path.join(os.path.dirname(save), "cache"), "--ckpt-format", "torch_dist",
            *layout, *extra]


def _flip_byte_in_a_weight_chunk(ckpt: str, key: str) -> str:
    """Flip one byte in the middle of a chunk of ``key`` in rank 0's data file; returns that file's name."""
    from omnitron.core.checkpoint import read_metadata
    from omnitron.core.checkpoint.dist_planner import VerifiedReader

    reader = VerifiedReader(ckpt, read_metadata(ckpt)["checksums"])
    md = reader.read_metadata()
    info = next(i for idx, i in sorted(md.storage_data.items(), key=lambda kv: kv[1].offset)
                if idx.fqn == key and i.relative_path.startswith("__0_"))
    with open(os.path.join(ckpt, info.relative_path), "r+b") as f:
        f.seek(info.offset + info.length // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    return info.relative_path


def _worker(root):
    import torch.distributed as dist

    from omnitron.core.checkpoint import CheckpointError, find_latest
    from omnitron.testing.training import worker_runner

    run = worker_runner(_args, root)
    run(LAYOUT, "ck")
    ckpt = find_latest(os.path.join(root, "ck"))
    rank = dist.get_rank()
    out = {"bytes": os.path.getsize(os.path.join(ckpt, f"__{rank}_0.distcp")), "ckpt": ckpt}
    dist.barrier()
    if rank == 0:
        out["victim"] = _flip_byte_in_a_weight_chunk(ckpt, "model/embedding.word_embeddings.weight")
    dist.barrier()
    try:
        run(LAYOUT, "loaded", "--load", os.path.join(root, "ck"), "--train-iters", "2")
        out["error"] = None
    except CheckpointError as err:
        out["error"] = str(err)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("balance")
    return run_distributed(_worker, 4, str(root), timeout_s=600)


def test_largest_writer_writes_at_most_1_25x_the_mean(results):
    sizes = [r["bytes"] for r in results]
    assert max(sizes) <= 1.25 * sum(sizes) / len(sizes), sizes


def test_a_flipped_byte_in_a_chunk_another_rank_reads_is_caught_on_every_rank(results):
    victim = results[0]["victim"]
    for r, res in enumerate(results):
        msg = res["error"]
        assert msg is not None and f"{victim} is corrupt" in msg and "\n" not in msg, (r, msg)


def test_a_reader_hashes_only_the_chunks_it_reads(results):
    """One tensor read alone: the bytes hashed are at most its chunks' (from DCP's index) and at least its data,
    not the files' (each chunk is read through its block digests: its tensor bytes and archive headers)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from omnitron.core.checkpoint import read_metadata
    from omnitron.core.checkpoint.dist_planner import PieceLoadPlanner, VerifiedReader

    ckpt = results[0]["ckpt"]
    reader = VerifiedReader(ckpt, read_metadata(ckpt)["checksums"])
    md = reader.read_metadata()
    key = "model/decoder.layers.1.mlp.linear_fc2.weight"
    want = sum(i.length for idx, i in md.storage_data.items() if idx.fqn == key)
    shape = tuple(md.state_dict_metadata[key].size)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({key: (shape, [((0,) * len(shape), torch.empty(shape))])}, storage_reader=reader,
                 planner=PieceLoadPlanner(ckpt), no_dist=True)
    files = sum(r["bytes"] for r in results)
    data = math.prod(shape) * md.state_dict_metadata[key].properties.dtype.itemsize
    assert data <= reader.hashed_bytes <= want and 0 < want < files / 8, (reader.hashed_bytes, data, want, files)


def test_a_tp_column_slice_of_a_row_starts_and_ends_on_piece_boundaries():
    """piece_bytes' promise: a row of at least 8 x MIN_PIECE bytes whose element count 8 divides is cut so that a
    column slice at tp 2, 4 or 8 (bytes [k row / tp, (k + 1) row / tp) of every row) starts and ends on piece
    boundaries, so a tensor-parallel reader reads only its own bytes; shorter rows are grouped whole. Reference:
    the divisibility of each slice's bounds, on random widths, dtypes and blocks."""
    import random

    from omnitron.core.checkpoint.dist_slices import MIN_PIECE, piece_bytes

    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    for _ in range(300):
        item = rng.choice([1, 2, 4, 8])
        cols = 8 * rng.randrange(-(-8 * MIN_PIECE // (8 * item)), 4 * MIN_PIECE)
        block = rng.choice([64 << 10, 4 * cols * item, MIN_PIECE * 8])
        piece = piece_bytes((rng.randrange(1, 9), cols), item, block)
        for tp in (2, 4, 8):
            assert (cols * item // tp) % piece == 0, (seed, item, cols, block, piece, tp)
        short = rng.randrange(1, MIN_PIECE // item) * item  # a row under MIN_PIECE bytes: whole rows per piece
        assert piece_bytes((3, short // item), item, block) % short == 0, (seed, short, item, block)


def test_replicas_spread_every_element_of_every_piece_to_exactly_one_writer():
    """_spread's parts over ``count`` replicas cover each piece's elements exactly once (a scalar: one writer), with
    offsets placing each part where it lies in the piece. Reference: a count of writers per element, on random
    pieces (0-dim, leading sizes of 1, rows fewer than the replicas)."""
    import random

    from omnitron.core.checkpoint.dist import _spread

    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    for _ in range(100):
        dims = rng.randrange(0, 4)
        shape = tuple(rng.choice([1, 1, 2, 3, 7]) for _ in range(dims))
        off = tuple(rng.randrange(0, 5) for _ in range(dims))
        whole = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
        count = rng.randrange(1, 6)
        writers = torch.zeros(shape, dtype=torch.int64)
        for index in range(count):
            for o, view in _spread([(off, whole)], index, count):
                at = tuple(slice(a - b, a - b + n) for a, b, n in zip(o, off, view.shape))
                assert torch.equal(whole[at], view), (seed, shape, count, index)
                writers[at] += 1
        assert bool((writers == 1).all()), (seed, shape, count, writers)
