"""``omnitron bench comm``: collectives and point-to-point over a size sweep, as nccl-tests measures them.

For a message of ``S`` bytes taking ``t`` seconds (the slowest rank's median), the algorithm bandwidth
is ``S / t`` and the bus bandwidth ``algbw x factor`` with nccl-tests' factors for ``n`` ranks (what
each link carries, so figures compare across rank counts):

============== ============================== ==============
op             S                              factor
============== ============================== ==============
all_reduce     the buffer                     2 (n - 1) / n
all_gather     the gathered output            (n - 1) / n
reduce_scatter the input (n shards)           (n - 1) / n
all_to_all     the buffer each rank exchanges (n - 1) / n
broadcast      the buffer                     1
p2p            the message (pairs 2i -> 2i+1) 1
============== ============================== ==============

Runs on the world torchrun gives (``WORLD_SIZE`` set), else spawns ``--nproc-per-node`` local ranks.
Latency at small sizes is the ``ms`` of the smallest messages.

Two ops measure how the ranks share one host's cores rather than a link (what a CPU's layouts pay beyond their
own work): ``host_gemm`` (a 256 x 256 x 256 float32 GEMM) and ``host_stream`` (an add over 4M float32
elements, past the caches), each timed on rank 0 alone while the others wait, then on every rank at once.
Their rows carry ``alone_ms`` and ``slowdown`` (at once / alone, the slowest rank): 1.0 on ranks with cores of
their own, about 2 for two ranks on the two hyperthreads of one core, and at least ``ranks / cores`` beyond.
"""
from __future__ import annotations

import json
import os
import socket
import tempfile

import torch

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p")
HOST_OPS = ("host_gemm", "host_stream")


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor of ``op`` at ``n`` ranks."""
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "p2p"):
        return 1.0
    raise ValueError(f"unknown op {op!r}; ops are {', '.join(OPS)}")


def sizes(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    out, s = [], max(min_bytes, 4)
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out


def _call(op: str, coll, nbytes: int, rank: int, world: int, device):
    """A closure running ``op`` once on ``nbytes`` (float32 elements, rounded to a multiple of the world)."""
    n = max(nbytes // 4 // world * world, world)
    if op == "all_reduce":
        x = torch.ones(n, device=device)
        return lambda: coll.all_reduce(x), n * 4
    if op == "all_gather":
        x, out = torch.ones(n // world, device=device), torch.empty(n, device=device)
        return lambda: coll.all_gather(out, x), n * 4
    if op == "reduce_scatter":
        x, out = torch.ones(n, device=device), torch.empty(n // world, device=device)
        return lambda: coll.reduce_scatter(out, x), n * 4
    if op == "all_to_all":
        x, out = torch.ones(n, device=device), torch.empty(n, device=device)
        return lambda: coll.all_to_all(out, x), n * 4
    if op == "broadcast":
        x = torch.ones(n, device=device)
        return lambda: coll.broadcast(x, src=0), n * 4
    x = torch.ones(n, device=device)
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    if peer >= world:  # an odd world's last rank sits out (it still joins the barrier)
        return (lambda: None), n * 4
    return ((lambda: coll.send(x, peer)) if rank % 2 == 0 else (lambda: coll.recv(x, peer))), n * 4


def measure(backend, rank: int, world: int, ops, byte_sizes, rounds: int, budget_s: float) -> list[dict]:
    """Every (op, size) on this rank; the slowest rank's median decides (collective)."""
    from omnitron.backends.collectives import ReduceOp
    from omnitron.bench.timing import median_ms

    coll, device, rows = backend.collectives, backend.current_device(), []
    for op in ops:
        if op in HOST_OPS:
            rows.append(_host_row(op, backend, rank, world, budget_s))
            continue
        if op == "p2p" and world < 2:
            continue
        for nbytes in byte_sizes:
            fn, actual = _call(op, coll, nbytes, rank, world, device)

            def step(fn=fn):
                fn()
                coll.barrier()  # every rank ends the round together: the slowest one's time counts

            ms = torch.tensor([median_ms(step, backend, rounds=rounds, budget_s=budget_s)], dtype=torch.float64,
                              device=device)
            coll.all_reduce(ms, op=ReduceOp.MAX)
            t = float(ms.item())
            algbw = actual / (t * 1e-3) / 1e9
            rows.append({"op": op, "bytes": actual, "ranks": world, "ms": t, "algbw_gbs": algbw,
                         "busbw_gbs": algbw * bus_factor(op, world)})
    return rows


def _per_call_ms(fn, backend, seconds: float) -> float:
    """Mean ms of ``fn`` called back to back for ``seconds`` of wall time (after one warm-up call)."""
    import time

    fn()
    backend.synchronize()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    backend.synchronize()
    return (time.perf_counter() - t0) * 1e3 / n


def _host_row(op: str, backend, rank: int, world: int, budget_s: float) -> dict:
    """A :data:`HOST_OPS` row: rank 0 calling the op back to back alone (the others wait in a barrier), then
    every rank at once over the same wall-clock window, so the ranks' work overlaps throughout. Collective."""
    from omnitron.backends.collectives import ReduceOp

    coll, dev = backend.collectives, backend.current_device()
    if op == "host_gemm":
        a, b = (torch.randn(256, 256, device=dev) for _ in range(2))

        def fn():
            torch.mm(a, b)
    else:
        a, b = (torch.randn(1 << 22, device=dev) for _ in range(2))

        def fn():
            torch.add(a, b)
    window = max(0.2, min(1.0, budget_s))
    alone = _per_call_ms(fn, backend, window) if rank == 0 else 0.0
    coll.barrier()
    ms = torch.tensor([_per_call_ms(fn, backend, window)], dtype=torch.float64, device=dev)
    coll.all_reduce(ms, op=ReduceOp.MAX)
    both = torch.tensor([alone], dtype=torch.float64, device=dev)
    coll.all_reduce(both, op=ReduceOp.MAX)
    t, one = float(ms.item()), float(both.item())
    return {"op": op, "bytes": 0, "ranks": world, "ms": t, "alone_ms": one, "slowdown": t / one,
            "algbw_gbs": 0.0, "busbw_gbs": 0.0}


def _worker(rank: int, world: int, port: int, backend_name: str | None, ops, byte_sizes, rounds, budget_s, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from omnitron.backends import get_backend

    backend = get_backend(backend_name)
    backend.collectives.init_process_group(rank, world)
    rows = measure(backend, rank, world, ops, byte_sizes, rounds, budget_s)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    backend.collectives.barrier()
    torch.distributed.destroy_process_group()


def run(backend_name: str | None, *, nproc: int, ops, byte_sizes, rounds: int = 10, budget_s: float = 1.0) -> list[dict]:
    """The sweep on torchrun's world (every rank returns the rows) or on ``nproc`` spawned local ranks."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        from omnitron.backends import get_backend

        backend = get_backend(backend_name)
        backend.collectives.init_process_group()
        return measure(backend, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), ops, byte_sizes, rounds,
                       budget_s)
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(nproc, port, backend_name, list(ops), list(byte_sizes), rounds, budget_s, out),
                 nprocs=nproc, join=True)
        with open(out) as f:
            return json.load(f)
