"""``omnitron bench comm``: collectives and point-to-point over a size sweep, as nccl-tests measures them.

Each rank runs on its own device (``LOCAL_RANK`` under torchrun, the spawned rank's index otherwise, modulo
the devices the backend sees). Per (group, op, size): ``--warmup-iters`` calls, the device synchronized and
the ranks aligned by one barrier, then ``--iters`` calls back to back timed as one span (no barrier and no
synchronization inside it, only one after the last call), the time per call averaged over the ranks as
nccl-tests reports it by default (its ``-a 1``; over the ranks taking part: an odd group's last rank sits out
``p2p``). For a message of ``S`` bytes taking ``t`` seconds the algorithm bandwidth is ``S / t``
and the bus bandwidth ``algbw x factor`` with nccl-tests' factors for ``n`` ranks (what each link carries,
so figures compare across rank counts; nccl-tests' ``doc/PERFORMANCE.md``):

============== ============================== ==============
op             S                              factor
============== ============================== ==============
all_reduce     the buffer                     2 (n - 1) / n
all_gather     the gathered output            (n - 1) / n
reduce_scatter the input (n shards)           (n - 1) / n
all_to_all     the buffer each rank exchanges (n - 1) / n
broadcast      the buffer                     1
sendrecv       the message (to rank + 1,      1
               from rank - 1, at once)
p2p            the message (pairs 2i -> 2i+1) 1
============== ============================== ==============

nccl-tests times each collective out of place and in place; here all_reduce and broadcast run in place (the one
buffer), all_gather, reduce_scatter, all_to_all and sendrecv out of place.

Groups (``group`` of each row): ``world``, all ranks; on more than one node (``LOCAL_WORLD_SIZE`` below the
world) also ``intra``, the ranks of each node (every node's group at once), and ``inter``, the ranks of one
local index on every node (every rail at once), so intra- and inter-node links are reported apart.

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
import tempfile
import time
from dataclasses import dataclass

import torch

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "sendrecv", "p2p")
HOST_OPS = ("host_gemm", "host_stream")


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor of ``op`` at ``n`` ranks."""
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "p2p", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown op {op!r}; ops are {', '.join(OPS)}")


def sizes(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    out, s = [], max(min_bytes, 4)
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out


@dataclass(frozen=True)
class Group:
    """One group a sweep runs on: its ``kind`` (world, intra, inter), the world ranks of this rank's instance
    (``ranks``), the process group handle (None: the world) and where it lies (``local`` per node, ``nodes``)."""

    kind: str
    ranks: tuple[int, ...]
    handle: object
    local: int
    nodes: int


def groups(coll, rank: int, world: int, per_node: int) -> list[Group]:
    """The :class:`Group` s of the module docstring holding ``rank`` (every rank creates every group, in one
    order, as process groups require)."""
    per_node = per_node if 0 < per_node <= world and world % per_node == 0 else world
    nodes = world // per_node
    out = [Group("world", tuple(range(world)), None, per_node, nodes)]
    if nodes == 1:
        return out
    for kind, sets in (("intra", [range(n * per_node, (n + 1) * per_node) for n in range(nodes)]),
                       ("inter", [range(i, world, per_node) for i in range(per_node)])):
        for members in sets:
            handle = coll.new_group(list(members))
            if rank in members:
                mine = Group(kind, tuple(members), handle, per_node if kind == "intra" else 1,
                             1 if kind == "intra" else nodes)
        out.append(mine)
    return out


def _call(op: str, coll, nbytes: int, rank: int, g: Group, device):
    """A closure running ``op`` once over group ``g`` on ``nbytes`` (float32 elements, a multiple of the group),
    the bytes ``S`` it counts and whether this rank takes part (all do but the last of an odd group's ``p2p``)."""
    n_ranks, me = len(g.ranks), g.ranks.index(rank)
    n = max(nbytes // 4 // n_ranks * n_ranks, n_ranks)
    grp = g.handle
    x = torch.ones(n, device=device)
    if op == "all_reduce":
        return lambda: coll.all_reduce(x, group=grp), n * 4, True
    if op == "all_gather":
        part, out = torch.ones(n // n_ranks, device=device), torch.empty(n, device=device)
        return lambda: coll.all_gather(out, part, group=grp), n * 4, True
    if op == "reduce_scatter":
        out = torch.empty(n // n_ranks, device=device)
        return lambda: coll.reduce_scatter(out, x, group=grp), n * 4, True
    if op == "all_to_all":
        out = torch.empty(n, device=device)
        return lambda: coll.all_to_all(out, x, group=grp), n * 4, True
    if op == "broadcast":
        return lambda: coll.broadcast(x, src=g.ranks[0], group=grp), n * 4, True
    if op == "sendrecv":  # nccl-tests' sendrecv: to the next rank and from the previous one, in one batch
        into = torch.empty(n, device=device)
        nxt, prv = g.ranks[(me + 1) % n_ranks], g.ranks[(me - 1) % n_ranks]
        return lambda: [h.wait() for h in coll.batch_p2p([("send", x, nxt), ("recv", into, prv)])], n * 4, True
    peer = me + 1 if me % 2 == 0 else me - 1
    if peer >= n_ranks:  # an odd group's last rank sits out
        return (lambda: None), n * 4, False
    peer = g.ranks[peer]
    return ((lambda: coll.send(x, peer)) if me % 2 == 0 else (lambda: coll.recv(x, peer))), n * 4, True


def timed_s(fn, coll, backend, warmup: int, iters: int, group=None, clock=time.perf_counter) -> float:
    """Seconds per call of ``fn`` as nccl-tests times it: ``warmup`` calls, the device synchronized and the
    group aligned by one barrier, then ``iters`` calls back to back between two clock reads with one
    synchronization after the last (nothing else inside the span)."""
    for _ in range(warmup):
        fn()
    backend.synchronize()
    coll.barrier(group=group)
    t0 = clock()
    for _ in range(iters):
        fn()
    backend.synchronize()
    return (clock() - t0) / iters


def _agreed(coll, value: float, device, op, group=None, mean: bool = False, weight: float = 1.0) -> float:
    """``value`` reduced over ``group`` (max, or with ``mean`` the mean over the ranks of ``weight`` 1: those
    taking part; an odd group's idle ``p2p`` rank would pull the mean towards its own nothing), so every rank
    decides alike."""
    from omnitron.backends.collectives import ReduceOp

    if not mean:
        t = torch.tensor([value], dtype=torch.float64, device=device)
        coll.all_reduce(t, op=ReduceOp.MAX, group=group)
        return float(t.item())
    t = torch.tensor([value * weight, weight], dtype=torch.float64, device=device)
    coll.all_reduce(t, op=ReduceOp.SUM, group=group)
    return float(t[0].item()) / float(t[1].item())


def measure(backend, rank: int, world: int, ops, byte_sizes, rounds: int, budget_s: float, *, warmup: int = 5,
            per_node: int | None = None) -> list[dict]:
    """Every (group, op, size) on this rank (collective): ``rounds`` timed iterations at most, fewer where one
    call's pilot time (the slowest rank's) times ``rounds`` would exceed ``budget_s``."""
    coll, device, rows = backend.collectives, backend.current_device(), []
    for op in (o for o in ops if o in HOST_OPS):
        rows.append(_host_row(op, backend, rank, world, budget_s))
    for g in groups(coll, rank, world, per_node or world):
        size = len(g.ranks)
        for op in (o for o in ops if o not in HOST_OPS):
            if size < 2:
                continue
            for nbytes in byte_sizes:
                fn, actual, part = _call(op, coll, nbytes, rank, g, device)
                pilot = _agreed(coll, timed_s(fn, coll, backend, 1, 1, g.handle), device, op, g.handle)
                iters = max(1, min(rounds, int(budget_s / max(pilot, 1e-9))))
                t = _agreed(coll, timed_s(fn, coll, backend, warmup, iters, g.handle), device, op, g.handle, True,
                            float(part))
                algbw = actual / t / 1e9
                rows.append({"op": op, "bytes": actual, "ranks": size, "ms": t * 1e3, "algbw_gbs": algbw,
                             "busbw_gbs": algbw * bus_factor(op, size), "group": g.kind, "local": g.local,
                             "nodes": g.nodes, "iters": iters})
    return rows


def placement(backend, rank: int) -> int:
    """Put this rank on its own device: ``LOCAL_RANK`` (torchrun) or ``rank`` (spawned), modulo the devices the
    backend sees; returns the index."""
    index = int(os.environ.get("LOCAL_RANK", rank)) % max(1, backend.device_count())
    backend.set_device(index)
    return index


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


def _worker(rank: int, world: int, port: int, backend_name: str | None, ops, byte_sizes, rounds, budget_s, out,
            warmup: int = 5):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.pop("LOCAL_RANK", None)  # a spawned rank's own index places it
    torch.set_num_threads(1)
    from omnitron.backends import get_backend
    from omnitron.core.training.workers import client_store

    backend = get_backend(backend_name)
    index = placement(backend, rank)
    backend.collectives.init_process_group(rank, world, store=client_store(port, world, 300.0))
    rows = measure(backend, rank, world, ops, byte_sizes, rounds, budget_s, warmup=warmup)
    rows = _with_devices(backend, rows, index, world)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    backend.collectives.barrier()
    backend.collectives.destroy()  # joins the gloo groups' threads while the interpreter is whole


def _with_devices(backend, rows: list[dict], index: int, world: int) -> list[dict]:
    """``rows`` with ``devices``: the device each world rank's buffers were on (all-gathered; collective): the
    current device the sweep allocated on, ``index`` (the placement) where the device type has no index."""
    dev = backend.current_device()
    index = index if dev.index is None else dev.index
    mine, every = (torch.tensor([index], dtype=torch.int64, device=dev),
                   torch.empty(world, dtype=torch.int64, device=dev))
    backend.collectives.all_gather(every, mine)
    names = [f"{dev.type}:{i}" for i in every.tolist()]
    return [dict(r, devices=names) for r in rows]


def run(backend_name: str | None, *, nproc: int, ops, byte_sizes, rounds: int = 20, budget_s: float = 1.0,
        warmup: int = 5) -> list[dict]:
    """The sweep on torchrun's world (every rank returns the rows) or on ``nproc`` spawned local ranks:
    ``warmup`` untimed and up to ``rounds`` timed calls per size (nccl-tests' ``-w`` and ``-n``)."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        from omnitron.backends import get_backend

        backend = get_backend(backend_name)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        index = placement(backend, rank)
        backend.collectives.init_process_group()
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        rows = measure(backend, rank, world, ops, byte_sizes, rounds, budget_s, warmup=warmup, per_node=per_node)
        return _with_devices(backend, rows, index, world)
    import torch.multiprocessing as mp

    from omnitron.core.training.workers import host_store

    store = host_store(nproc, 300.0)  # held here: no rank races another process for the port
    port = store.port
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(nproc, port, backend_name, list(ops), list(byte_sizes), rounds, budget_s, out, warmup),
                 nprocs=nproc, join=True)
        with open(out) as f:
            return json.load(f)
