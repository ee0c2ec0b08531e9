"""Checkpoint formats at dp with the distributed optimizer: old ``torch`` vs ``torch_dist`` (sync and --async-save).

Setup (not timed): the ~110M GPT of ``benchmarks/reshard.py`` (12 layers, hidden 768, vocab 32000,
fp32, Adam) trains one iteration on ``--dp`` processes (1 thread each) with
``--use-distributed-optimizer``. Then, one after another on the same state, every rank runs the
training loop's ``checkpointing.save`` in each format into its own directory, and
``checkpointing.load`` of each directory back into the live model (same layout):

* ``torch``: the old format (the distributed optimizer all-gathers its state; dp rank 0 writes it);
* ``torch_dist``: DCP, each rank writes its own slices, straight from its buffers (``torch_dist cloned``:
  the same with DCP's copy of every piece, as before ``dist_planner.exact_storage``);
* ``torch_dist async``: ``--async-save``: ``blocked s`` is the save call (the step's wait: a host
  snapshot, then the thread starts), ``s`` the save call plus ``finish_saves`` (write done, committed);
  the saver's process group and its host staging buffers are made beforehand (``checkpointing.prepare_saves``,
  as training does before its first step); a second async save (into the same buffers) is timed too.

Per rank: seconds, bytes of the files it wrote, bytes of all its write calls (``/proc/self/io`` wchar: files
and the gloo sockets, the background thread included), and the
peak RSS over the RSS before the operation (freed heap returned first, ``malloc_trim``; the high-water mark
reset through ``/proc/self/clear_refs`` just before; read after the commit), beside the rank's own state
(its weights + its optimizer slices) and the replicated optimizer state the old format gathers. Page cache warm, local
disk.

Then (``--reshard``, default on) a second spawn at another layout (``RESHARD``: dp2 x tp2, distributed
optimizer) trains one iteration to build its state and times ``checkpointing.load`` of the old and the
``torch_dist`` directory (both saved at dp4): the old format assembles every rank's shard from full tensors,
torch_dist reads each rank's slices.

``--rates``: instead of the above, one spawn at dp ``--dp`` x tp ``--tp`` (distributed optimizer) times the
synchronous ``torch_dist`` save and its load (same layout) per rank, with the rank's bytes: files it wrote, and
``rchar`` (bytes its read calls returned: the data files, plus DCP's small planning messages over gloo) for
the load; GB/s is bytes / seconds (10**9 bytes).

    python benchmarks/checkpoint.py [--dp 4] [--no-reshard] [--workdir DIR] [--json FILE]
    python benchmarks/checkpoint.py --rates --dp 2 --tp 2 [--json FILE]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from context_parallel import dump_json, print_table  # noqa: E402
from reshard import MODEL, _io, _rss_kib  # noqa: E402

VARIANTS = (("torch", "torch", False), ("torch_dist cloned", "torch_dist", False), ("torch_dist", "torch_dist", False),
            ("torch_dist async", "torch_dist", True), ("torch_dist async 2nd", "torch_dist", True))
LOADS = ("torch", "torch_dist")
# "torch_dist cloned": the save as before 2026-12-01's change, DCP cloning every piece that views a larger
# storage (dist_planner.exact_storage undone), beside the zero-copy save on the same state


def _measured(fn) -> dict:
    """Seconds, bytes written and the peak RSS over the starting RSS (MiB) of ``fn()``; ``fn`` may return
    a dict of more figures (merged)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # return what earlier operations freed, so it is not reused unseen
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base, io0, t = _rss_kib()["VmRSS"], _io(), time.perf_counter()
    extra = fn() or {}
    seconds, io1, rss = time.perf_counter() - t, _io(), _rss_kib()
    return {"s": seconds, "written": io1["wchar"] - io0["wchar"], "peak_over_mib": (rss["VmHWM"] - base) / 1024,
            **extra}


def _own_files_bytes(path: str, rank: int) -> int:
    """Bytes of the files rank ``rank`` wrote into checkpoint directory ``path`` (rank 0: the metadata too)."""
    mine = [f"rank_{rank:05d}.pt"] + [f for f in os.listdir(path) if f.startswith(f"__{rank}_")]
    if rank == 0:
        mine += [f for f in (".metadata", "metadata.json") if os.path.exists(os.path.join(path, f))]
    return sum(os.path.getsize(os.path.join(path, f)) for f in mine)


def bench_worker(root: str, dp: int) -> dict:
    from omnitron.backends import get_backend
    from omnitron.core.checkpoint import dist_planner
    from omnitron.core.training import checkpointing
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    torch.set_num_threads(1)
    be = get_backend()
    c = train(parse_settings(MODEL + ["--global-batch-size", str(dp), "--use-distributed-optimizer",
                                      "--data-cache-path", os.path.join(root, "cache"), "--seed", "1"], dp),
              be)["components"]
    ck, out = c.settings.checkpoint, {}
    out["weights"] = sum(p.numel() * p.element_size() for m in c.modules for p in m.parameters())
    out["opt_slice"] = c.optimizer.state_bytes()
    out["opt_full"] = sum(sum(p.numel() for p in c.optimizer.params) * 4 for _ in c.optimizer.state)
    for name, fmt, async_ in VARIANTS:
        ck.save, ck.ckpt_format, ck.async_save = os.path.join(root, name.replace(" ", "_")), fmt, async_
        checkpointing.prepare_saves(c)  # as training does before its first step (not timed)
        be.collectives.barrier()

        def save():
            t = time.perf_counter()
            checkpointing.save(c)
            blocked = time.perf_counter() - t
            checkpointing.finish_saves(c)
            return {"blocked_s": blocked}

        zero_copy = dist_planner.exact_storage
        if name.endswith("cloned"):
            dist_planner.exact_storage = lambda v: v
        try:
            out["save " + name] = _measured(save)
        finally:
            dist_planner.exact_storage = zero_copy
        out["save " + name]["disk"] = _own_files_bytes(os.path.join(ck.save, "iter_0000001"), c.groups.rank)
    ck.save, ck.async_save = None, False
    for name in LOADS:
        ck.load = os.path.join(root, name.replace(" ", "_"))
        be.collectives.barrier()
        out["load " + name] = _measured(lambda: checkpointing.load(c) and None)
    out["files"] = {name: sorted(os.listdir(os.path.join(root, name.replace(" ", "_"), "iter_0000001")))
                    for name, _, _ in VARIANTS}
    return out


RESHARD = ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]


def reshard_worker(root: str, world: int) -> dict:
    """Load both synchronous saves of :func:`bench_worker` under ``RESHARD`` (dp = world / 2)."""
    from omnitron.backends import get_backend
    from omnitron.core.training import checkpointing
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    torch.set_num_threads(1)
    be = get_backend()
    c = train(parse_settings(MODEL + ["--global-batch-size", str(world // 2), *RESHARD, "--data-cache-path",
                                      os.path.join(root, "cache"), "--seed", "2"], world), be)["components"]
    out = {"weights": sum(p.numel() * p.element_size() for m in c.modules for p in m.parameters()),
           "opt_slice": c.optimizer.state_bytes()}
    for name in LOADS:
        c.settings.checkpoint.load = os.path.join(root, name.replace(" ", "_"))
        be.collectives.barrier()
        out["load " + name + " -> tp2 dp" + str(world // 2)] = _measured(lambda: checkpointing.load(c) and None)
    return out


def rate_worker(root: str, dp: int, tp: int) -> dict:
    """torch_dist save and load seconds and bytes of this rank at dp x tp (``--rates``)."""
    from omnitron.backends import get_backend
    from omnitron.core.training import checkpointing
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    torch.set_num_threads(1)
    be = get_backend()
    c = train(parse_settings(MODEL + ["--global-batch-size", str(dp), "--use-distributed-optimizer",
                                      "--tensor-model-parallel-size", str(tp), "--data-cache-path",
                                      os.path.join(root, "cache"), "--seed", "1"], dp * tp), be)["components"]
    ck = c.settings.checkpoint
    ck.save, ck.ckpt_format, ck.async_save = os.path.join(root, "rates"), "torch_dist", False
    be.collectives.barrier()
    out = {"save": _measured(lambda: checkpointing.save(c) and None)}
    out["save"]["bytes"] = _own_files_bytes(os.path.join(ck.save, "iter_0000001"), c.groups.rank)
    ck.save, ck.load = None, os.path.join(root, "rates")
    be.collectives.barrier()
    read0 = _io()["rchar"]
    out["load"] = _measured(lambda: checkpointing.load(c) and None)
    out["load"]["bytes"] = _io()["rchar"] - read0
    return out


def rates(args) -> None:
    """``--rates``: the per-rank table of torch_dist save / load seconds and GB/s."""
    from omnitron.testing.distributed import run_distributed

    root = args.workdir or tempfile.mkdtemp(prefix="omnitron_ckpt_")
    try:
        res = run_distributed(rate_worker, args.dp * args.tp, root, args.dp, args.tp, threads=1, timeout_s=1800)
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    rows = [{"what": what, "rank": rank, "s": r[what]["s"], "mib": r[what]["bytes"] / 2 ** 20,
             "gbs": r[what]["bytes"] / r[what]["s"] / 1e9, "peak": r[what]["peak_over_mib"]}
            for what in ("save", "load") for rank, r in enumerate(res)]
    print(f"torch_dist at dp{args.dp} x tp{args.tp}, distributed optimizer, {args.dp * args.tp} processes x 1 thread")
    print_table(rows, [("what", "what", ""), ("rank", "rank", "d"), ("s", "s", ".2f"), ("MiB", "mib", ".0f"),
                       ("GB/s", "gbs", ".3f"), ("peak RSS over start MiB", "peak", ".0f")])
    dump_json(args.json, {"dp": args.dp, "tp": args.tp, "rows": rows})


def main() -> None:
    from omnitron.testing.distributed import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary directory)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-reshard", dest="reshard", action="store_false", help="skip the load under tp2")
    ap.add_argument("--rates", action="store_true", help="torch_dist save/load seconds and GB/s at --dp x --tp only")
    ap.add_argument("--tp", type=int, default=1, help="with --rates: the tensor-parallel size")
    args = ap.parse_args()
    if args.rates:
        rates(args)
        return
    root = args.workdir or tempfile.mkdtemp(prefix="omnitron_ckpt_")
    t0 = time.perf_counter()
    try:
        res = run_distributed(bench_worker, args.dp, root, args.dp, threads=1, timeout_s=1800)
        if args.reshard:
            for r, more in zip(res, run_distributed(reshard_worker, args.dp, root, args.dp, threads=1,
                                                    timeout_s=1800)):
                r.update({k: v for k, v in more.items() if k.startswith("load")}, own_reshard=more)
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    mib = 2 ** 20
    r0 = res[0]
    print(f"~{r0['weights'] / 4e6:.1f}M parameters, fp32 + Adam, dp{args.dp} with the distributed optimizer, "
          f"{args.dp} processes x 1 thread; per rank: weights {r0['weights'] / mib:.0f} MiB, own optimizer slices "
          f"{r0['opt_slice'] / mib:.0f} MiB (own state {(r0['weights'] + r0['opt_slice']) / mib:.0f} MiB), replicated "
          f"optimizer state {r0['opt_full'] / mib:.0f} MiB; whole run {time.perf_counter() - t0:.0f} s")
    rows = []
    loads = sorted(k for k in r0 if k.startswith("load ") and " -> " in k)
    for what in [f"save {n}" for n, _, _ in VARIANTS] + [f"load {n}" for n in LOADS] + loads:
        for rank, r in enumerate(res):
            m = r[what]
            mine = r["own_reshard"] if " -> " in what else r  # under the other layout: that rank's own state
            own = (mine["weights"] + mine["opt_slice"]) / mib
            rows.append({"what": what, "rank": rank, "s": m["s"], "blocked": m.get("blocked_s"),
                         "disk": m["disk"] / mib if "disk" in m else None, "written": m["written"] / mib,
                         "peak": m["peak_over_mib"], "own": own,
                         "ratio": m["peak_over_mib"] / own})
    print_table(rows, [("what", "what", ""), ("rank", "rank", "d"), ("s", "s", ".2f"), ("blocked s", "blocked", ".2f"),
                       ("files MiB", "disk", ".0f"),
                       ("wchar MiB", "written", ".0f"), ("peak RSS over start MiB", "peak", ".0f"),
                       ("own state MiB", "own", ".0f"), ("peak / own", "ratio", ".2f")])
    print("files per iteration directory:", {k: v for k, v in r0["files"].items()})
    dump_json(args.json, {"dp": args.dp, "rows": rows, "ranks": res})


if __name__ == "__main__":
    main()
