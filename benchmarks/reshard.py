"""Offline checkpoint resharding (``omnitron checkpoint convert``): time, peak host memory and bytes, vs saving.

Setup (not timed): a GPT-2 style model of ~110M parameters (12 layers, hidden 768, 12 heads,
vocab 32000, fp32, Adam) trains one iteration on mock data in one process and saves (tp1 x pp1,
with the Adam moments); that checkpoint is converted once to tp2 x pp2, which is the source ``A``
(the same shards a tp2 x pp2 run would write, minus RNG state).

Measured, interleaved over ``--rounds``: ``save`` (the training loop's ``checkpointing.save`` of the
live model + optimizer, one process writing the whole checkpoint, fsync included, in the process
that trained it); ``convert tp2pp2 -> tp1pp1`` (A -> B) and ``convert tp1pp1 -> tp2pp2`` (B -> A'),
each :func:`~omnitron.core.checkpoint.reshard.convert` (what ``omnitron checkpoint convert`` runs)
in a fresh spawned process with 2 threads. Per conversion: wall seconds, split into ``read`` (loading
every source shard and merging it into full tensors: ``read_full_state``), ``write`` (``torch.save``
+ fsync of each new shard) and ``cut`` (the rest: skeleton models, cutting the full tensors into the
new shards, metadata); ``peak RSS`` the child's
high-water resident set (VmHWM) and ``over baseline`` that minus its RSS after imports (the
conversion's own peak); ``read`` / ``written`` the bytes the child read and wrote through system
calls (``/proc/self/io`` rchar / wchar; page-cache hits count as reads), beside the size of the
checkpoint on disk. The last round's A' is compared with A, and B with the trained tp1 checkpoint,
tensor by tensor (model weights, Adam moments, dtypes): ``bit-exact`` yes/no.

    python benchmarks/reshard.py [--rounds 2] [--workdir DIR] [--json FILE]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from context_parallel import dump_json, print_table  # noqa: E402

MODEL = ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12", "--seq-length", "128",
         "--max-position-embeddings", "128", "--vocab-size", "32000", "--tokenizer-type", "NullTokenizer",
         "--mock-data", "--num-workers", "0", "--micro-batch-size", "1", "--global-batch-size", "1",
         "--train-iters", "1", "--lr", "1e-4", "--optimizer", "adam", "--log-interval", "1", "--no-tensorboard",
         "--eval-iters", "0"]


def _proc(field_file: str, keys: tuple[str, ...]) -> dict[str, int]:
    out = {}
    with open(field_file) as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in keys:
                out[k] = int(v.split()[0])
    return out


def _io() -> dict[str, int]:
    return _proc("/proc/self/io", ("rchar", "wchar"))


def _rss_kib() -> dict[str, int]:
    return _proc("/proc/self/status", ("VmRSS", "VmHWM"))


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _clocked(fn, totals: dict, key: str):
    """``fn`` that adds the seconds of each call to ``totals[key]``."""
    def run(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - t
    return run


def convert_child(src: str, dst: str, tp: int, pp: int, queue) -> None:
    """In a fresh process: convert ``src`` to tp x pp under ``dst``; put the measurements on ``queue``."""
    torch.set_num_threads(2)
    import importlib

    reshard = importlib.import_module("omnitron.core.checkpoint.reshard")
    ckpt_io = importlib.import_module("omnitron.core.checkpoint.io")
    phases = {"read_s": 0.0, "write_s": 0.0}
    reshard.read_full_state = _clocked(reshard.read_full_state, phases, "read_s")
    ckpt_io._write_file = _clocked(ckpt_io._write_file, phases, "write_s")
    base, io0 = _rss_kib()["VmRSS"], _io()
    t = time.perf_counter()
    out = reshard.convert(src, dst, reshard.Layout(tp=tp, pp=pp))
    seconds = time.perf_counter() - t
    io1, rss = _io(), _rss_kib()
    queue.put({"s": seconds, "peak_mib": rss["VmHWM"] / 1024, "over_base_mib": (rss["VmHWM"] - base) / 1024,
               "read": io1["rchar"] - io0["rchar"], "written": io1["wchar"] - io0["wchar"], "out": out,
               "cut_s": seconds - phases["read_s"] - phases["write_s"], **phases})


def convert_measured(src: str, dst: str, tp: int, pp: int) -> dict:
    import multiprocessing as mp

    if os.path.exists(dst):
        shutil.rmtree(dst)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=convert_child, args=(src, dst, tp, pp, queue))
    p.start()
    res = queue.get(timeout=600)
    p.join()
    res["disk"] = _dir_bytes(res["out"])
    return res


def _tensors(path: str) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor of checkpoint ``path``, keyed by shard, chunk and name."""
    from omnitron.core.checkpoint.io import read_metadata, read_shard

    out = {}
    for r in range(read_metadata(path)["world_size"]):
        shard = read_shard(path, r)
        for c, sd in enumerate(shard["model"]):
            out.update({f"{r}.model{c}.{k}": v for k, v in sd.items() if torch.is_tensor(v)})
        for name, entry in shard["optimizer"]["tensors"].items():
            out.update({f"{r}.{name}.{kind}": v for kind, v in entry.items()})
    return out


def bit_exact(a: str, b: str) -> bool:
    ta, tb = _tensors(a), _tensors(b)
    return ta.keys() == tb.keys() and all(ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]) for k in ta)


def _same_as_trained(trained: str, converted: str) -> bool:
    """The tp1 conversion against the trained tp1 checkpoint (model weights and optimizer tensors;
    the trained one also holds RNG state and extra state the conversion does not carry)."""
    tt, tc = _tensors(trained), _tensors(converted)
    return bool(tc) and all(k in tt and tt[k].dtype == v.dtype and torch.equal(tt[k], v) for k, v in tc.items())


def bench_worker(root: str, rounds: int) -> dict:
    from omnitron.backends import get_backend
    from omnitron.core.checkpoint.io import find_latest
    from omnitron.core.training import checkpointing
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    torch.set_num_threads(2)
    save_dir = os.path.join(root, "trained")
    res = train(parse_settings(MODEL + ["--save", save_dir, "--data-cache-path", os.path.join(root, "cache")], 1),
                get_backend())
    c = res["components"]
    params = sum(p.numel() for m in c.modules for p in m.parameters())
    trained = find_latest(save_dir)
    a = convert_measured(trained, os.path.join(root, "A"), 2, 2)["out"]
    rows: dict[str, list[dict]] = {"save (training loop, tp1pp1)": [], "convert tp2pp2 -> tp1pp1": [],
                                   "convert tp1pp1 -> tp2pp2": []}
    b = back = None
    for _ in range(rounds):
        io0, t = _io(), time.perf_counter()
        path = checkpointing.save(c)
        seconds, io1 = time.perf_counter() - t, _io()
        rows["save (training loop, tp1pp1)"].append({"s": seconds, "written": io1["wchar"] - io0["wchar"],
                                                     "disk": _dir_bytes(path)})
        down = convert_measured(a, os.path.join(root, "B"), 1, 1)
        b = down["out"]
        rows["convert tp2pp2 -> tp1pp1"].append(down)
        up = convert_measured(b, os.path.join(root, "A2"), 2, 2)
        back = up["out"]
        rows["convert tp1pp1 -> tp2pp2"].append(up)
    return {"params": params, "rows": rows, "round_trip_exact": bit_exact(a, back),
            "tp1_equals_trained": _same_as_trained(trained, b), "source_bytes": _dir_bytes(a)}


def summarize(res: dict) -> list[dict]:
    out = []
    for name, runs in res["rows"].items():
        row = {"what": name}
        for k in ("s", "read_s", "cut_s", "write_s", "peak_mib", "over_base_mib", "read", "written", "disk"):
            vals = [r[k] for r in runs if k in r]
            if vals:
                row[k] = statistics.median(vals)
        for k in ("read", "written", "disk"):
            if k in row:
                row[k] /= 2**20
        out.append(row)
    save = out[0]["s"]
    for row in out:
        row["vs_save"] = row["s"] / save
    return out


def run_checkpoint_bench(worker, description: str, rounds: int, prefix: str):
    """(parsed ``--rounds --workdir --json``, ``worker(root, rounds)``'s result from one spawned process
    with 2 threads); ``root`` is ``--workdir`` or a temporary directory removed afterwards."""
    from omnitron.testing.distributed import run_distributed

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary directory)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    root = args.workdir or tempfile.mkdtemp(prefix=prefix)
    try:
        return args, run_distributed(worker, 1, root, args.rounds, threads=2, timeout_s=1200)[0]
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    args, res = run_checkpoint_bench(bench_worker, __doc__.splitlines()[0], 2, "omnitron_reshard_")
    rows = summarize(res)
    print(f"GPT-2 style, {res['params'] / 1e6:.1f}M parameters, fp32 + Adam; checkpoint on disk "
          f"{res['source_bytes'] / 2**20:.0f} MiB (tp2 x pp2); median of {args.rounds} interleaved rounds")
    print_table(rows, [("what", "what", ""), ("s", "s", ".2f"), ("vs save", "vs_save", ".2f"),
                       ("read s", "read_s", ".2f"), ("cut s", "cut_s", ".2f"), ("write s", "write_s", ".2f"),
                       ("peak RSS MiB", "peak_mib", ".0f"), ("over baseline MiB", "over_base_mib", ".0f"),
                       ("read MiB", "read", ".0f"), ("written MiB", "written", ".0f"), ("on disk MiB", "disk", ".0f")])
    print(f"bit-exact: tp2pp2 -> tp1pp1 -> tp2pp2 equals the source: {res['round_trip_exact']}; "
          f"tp1pp1 conversion equals the trained tp1pp1 checkpoint: {res['tp1_equals_trained']}")
    dump_json(args.json, {"rows": rows, **{k: v for k, v in res.items() if k != "rows"}})


if __name__ == "__main__":
    main()
