"""The planted bugs of tests/sim/test_sim_planted.py (and test_sim_races.py's cross-stream read) on a real device:
what each one does there.

On sim each bug is reported with a message naming its cause (the tests); on cpu/gloo each runs silently. This
script is the ground truth for that model: it runs the same bugs on a GPU (``--backend cuda``: NCCL, the
CUDA caching allocator) and records what the hardware shows -- a stale or overwritten result, a host read of
garbage, a hang cut by the bound -- each tried several times, since on a GPU they are races. One JSON line
per case to stdout (and ``--out``). The two-rank cases need one device per rank (NCCL refuses two ranks on
one GPU); with fewer they are written as skipped, with that reason.

    python benchmarks/planted_ground_truth.py --backend cuda [--out planted.jsonl] [--tries 5]
    python benchmarks/planted_ground_truth.py --backend sim   # the model, for comparison (cpu: silent)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOUND_S = 60  # a hang longer than this is cut and recorded as "hung"
CHAIN_ENV = "PLANTED_CHAIN"
"""Side of the GEMMs that keep a stream busy (--chain, passed to the workers): 2048 on a GPU (~0.1 s of work);
64 on cpu/sim, which run a kernel when issued (they catch the bugs by order, not by timing)."""


def _device(be):
    """This rank's device (one per rank where there are enough)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    be.set_device(rank % max(be.device_count(), 1))
    return be.current_device()


def _slow_chain(dev, steps: int = 40) -> torch.Tensor:
    """Device work that keeps a stream busy for a while (GEMMs), so later work on it runs late."""
    n = int(os.environ.get(CHAIN_ENV, "2048"))
    w = torch.randn(n, n, device=dev) / n ** 0.5
    for _ in range(steps):
        w = w @ w
    return w


def read_before_wait(tries: int) -> dict:
    """An all-reduce's output read (on the compute stream) before ``wait()``: stale on NCCL?"""
    from omnitron.backends import get_backend

    be = get_backend()
    dev, stale = _device(be), 0
    rank = torch.distributed.get_rank()
    for _ in range(tries):
        x = torch.full((1 << 24,), float(rank + 1), device=dev)
        work = be.collectives.all_reduce(x, async_op=True)
        early = x.clone()  # the bug
        work.wait()
        be.synchronize()
        stale += int(not torch.equal(early, x))
    return {"effect": f"stale result in {stale} of {tries}", "caught": stale > 0}


def freed_without_record_stream(tries: int) -> dict:
    """A tensor read on a side stream, freed without ``record_stream``, its block reused on the main stream."""
    from omnitron.backends import get_backend

    be = get_backend()
    dev, wrong = _device(be), 0
    for _ in range(tries):
        x = torch.randn(1 << 22, device=dev)
        want = x * 2
        side = be.Stream()
        side.wait_stream(be.current_stream())
        with be.stream(side):
            _slow_chain(dev)
            y = x * 2  # runs late on the side stream
        del x  # the bug: no x.record_stream(side)
        torch.zeros(1 << 22, device=dev)  # likely x's block, overwritten on the main stream meanwhile
        be.current_stream().wait_stream(side)
        be.synchronize()
        wrong += int(not torch.equal(y, want))
    return {"effect": f"wrong side-stream result in {wrong} of {tries}", "caught": wrong > 0}


def early_host_read(tries: int) -> dict:
    """A host read of a ``non_blocking`` device-to-host copy before synchronizing."""
    from omnitron.backends import get_backend

    be = get_backend()
    dev, garbage = _device(be), 0
    for _ in range(tries):
        _slow_chain(dev)  # the copy queues behind device work
        x = torch.arange(1 << 24, dtype=torch.float32, device=dev)
        host = x.to("cpu", non_blocking=True)
        early = host.clone()  # the bug
        be.synchronize()
        garbage += int(not torch.equal(early, host))
    return {"effect": f"host read differs from the copy in {garbage} of {tries}", "caught": garbage > 0}


def cross_stream_read(tries: int) -> dict:
    """A side-stream kernel reads what the main stream writes, with no ``wait_stream`` between them."""
    from omnitron.backends import get_backend

    be = get_backend()
    dev, wrong = _device(be), 0
    for _ in range(tries):
        x = torch.randn(1 << 22, device=dev)
        want = x * 2 + 1
        side = be.Stream()
        side.wait_stream(be.current_stream())  # the side stream is ordered after x, not after what follows
        _slow_chain(dev)
        y = x * 2  # runs late on the main stream
        with be.stream(side):
            z = y + 1  # the bug: no side.wait_stream(main) before reading y
        be.current_stream().wait_stream(side)  # y's free (next try) is ordered after the side stream's read
        be.synchronize()
        wrong += int(not torch.equal(z, want))
    return {"effect": f"wrong side-stream result in {wrong} of {tries}", "caught": wrong > 0}


def opposite_orders(tries: int) -> dict:
    """Two groups' all-reduces issued in opposite orders on the two ranks."""
    import torch.distributed as dist

    from omnitron.backends import get_backend

    be = get_backend()
    dev, rank = _device(be), dist.get_rank()
    g1, g2 = dist.new_group([0, 1]), dist.new_group([0, 1])
    a, b = torch.ones(1 << 20, device=dev), torch.ones(1 << 20, device=dev)
    order = [(a, g1), (b, g2)] if rank == 0 else [(b, g2), (a, g1)]
    start = time.perf_counter()
    try:
        works = [dist.all_reduce(t, group=g, async_op=True) for t, g in order]
        for w in works:
            w.wait()
        be.synchronize()
    except RuntimeError as err:
        return {"effect": f"error after {time.perf_counter() - start:.1f} s: {str(err).splitlines()[0][:200]}",
                "caught": True}
    return {"effect": f"completed in {time.perf_counter() - start:.1f} s (no deadlock this time)", "caught": False}


CASES = {"read_before_wait": (read_before_wait, 2), "freed_without_record_stream": (freed_without_record_stream, 1),
         "early_host_read": (early_host_read, 1), "opposite_orders": (opposite_orders, 2),
         "cross_stream_read": (cross_stream_read, 1)}


def run_case(name: str, backend: str, tries: int) -> dict:
    from omnitron.backends import get_backend
    from omnitron.testing.distributed import run_distributed

    fn, world = CASES[name]
    count = get_backend(backend).device_count() if backend != "cpu" else world
    if count < world:
        return {"case": name, "backend": backend, "skipped": f"needs {world} devices (one per rank), {count} here"}
    start = time.perf_counter()
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "OMNITRON_SIM_DEADLOCK_S": "10"}
    try:
        res = run_distributed(fn, world, tries, backend=backend, env=env, timeout_s=BOUND_S)[0]
    except RuntimeError as err:
        hung = "hung" in str(err)
        res = {"effect": ("hung past the bound" if hung else str(err).splitlines()[1][:300]), "caught": True}
    return {"case": name, "backend": backend, **res, "seconds": round(time.perf_counter() - start, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--tries", type=int, default=5)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default=None)
    ap.add_argument("--chain", type=int, default=None,
                    help="GEMM side for the busy stream (default 2048; 64 on cpu/sim)")
    args = ap.parse_args()
    os.environ[CHAIN_ENV] = str(args.chain or (64 if args.backend in ("cpu", "sim") else 2048))
    sys.path.insert(0, ROOT)
    lines = []
    for name in args.cases.split(","):
        line = json.dumps(run_case(name, args.backend, args.tries))
        print(line, flush=True)
        lines.append(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
