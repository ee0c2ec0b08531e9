"""Every collective, checked by value, in one spawned run (spawning costs seconds; checks cost ms).

Values are small integers, so sums are exact in bf16 and fp16, and chosen so that FP8 sums are
exact in e4m3 and e5m2 too. Each rank computes the expected result locally from the rank-value
rule, independently of the collective under test.
"""
from __future__ import annotations

import torch

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _values(rank: int, n: int, dtype, device) -> torch.Tensor:
    """Rank ``r``'s tensor: ``arange(n) + 10 r`` (exact in bf16 for the sizes used here)."""
    return (torch.arange(n, dtype=torch.float32) + 10 * rank).to(device=device, dtype=dtype)


class _Checker:
    def __init__(self, rank: int) -> None:
        self.rank, self.done = rank, []

    def __call__(self, name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if got.dtype != want.dtype:
            raise AssertionError(f"rank {self.rank}: {name}: dtype {got.dtype} != {want.dtype}")
        g = got.view(torch.uint8) if got.dtype.itemsize == 1 and got.is_floating_point() else got
        w = want.view(torch.uint8) if want.dtype.itemsize == 1 and want.is_floating_point() else want
        if not torch.equal(g.cpu(), w.cpu()):
            raise AssertionError(f"rank {self.rank}: {name}: got {got.float().cpu().tolist()} "
                                 f"want {want.float().cpu().tolist()}")
        self.done.append(name)


def _float_checks(c, rank, world, dtype, dev, check) -> None:
    k = 3
    n = world * k
    vals = [_values(r, n, dtype, dev) for r in range(world)]
    total = torch.stack([v.float() for v in vals]).sum(0).to(dtype)
    tag = str(dtype).replace("torch.", "")

    x = vals[rank].clone()
    c.all_reduce(x)
    check(f"all_reduce/sum/{tag}", x, total)
    x = vals[rank].clone()
    c.all_reduce(x, op=c_op("MAX"))
    check(f"all_reduce/max/{tag}", x, vals[world - 1])
    x = vals[rank].clone()
    c.all_reduce(x, op=c_op("AVG"))
    check(f"all_reduce/avg/{tag}", x, (total.float() / world).to(dtype))

    out = torch.empty(k, dtype=dtype, device=dev)
    c.reduce_scatter(out, vals[rank].clone())
    check(f"reduce_scatter/{tag}", out, total[rank * k:(rank + 1) * k])

    out = torch.empty(world * k, dtype=dtype, device=dev)
    c.all_gather(out, vals[rank][:k].clone())
    check(f"all_gather/{tag}", out, torch.cat([v[:k] for v in vals]))

    outs = [torch.empty(r + 1, dtype=dtype, device=dev) for r in range(world)]
    c.all_gather_list(outs, vals[rank][: rank + 1].clone())
    for r in range(world):
        check(f"all_gather_list[{r}]/{tag}", outs[r], vals[r][: r + 1])

    x = vals[rank].clone()
    c.broadcast(x, src=world - 1)
    check(f"broadcast/{tag}", x, vals[world - 1])

    # all_to_all, equal splits: chunk j of rank r holds 100 r + j
    send = torch.tensor([100.0 * rank + j for j in range(world) for _ in range(2)], dtype=dtype, device=dev)
    recv = torch.empty_like(send)
    c.all_to_all(recv, send)
    want = torch.tensor([100.0 * j + rank for j in range(world) for _ in range(2)], dtype=dtype, device=dev)
    check(f"all_to_all/{tag}", recv, want)
    # uneven splits: rank r sends j + 1 elements to rank j
    send = torch.cat([torch.full((j + 1,), 10.0 * rank + j) for j in range(world)]).to(dtype=dtype, device=dev)
    recv = torch.empty(world * (rank + 1), dtype=dtype, device=dev)
    c.all_to_all(recv, send, output_split_sizes=[rank + 1] * world, input_split_sizes=[j + 1 for j in range(world)])
    want = torch.cat([torch.full((rank + 1,), 10.0 * j + rank) for j in range(world)]).to(dtype=dtype, device=dev)
    check(f"all_to_all_uneven/{tag}", recv, want)

    # async handles: issue three, then wait
    a, b = vals[rank].clone(), torch.empty(k, dtype=dtype, device=dev)
    g = torch.empty(world * k, dtype=dtype, device=dev)
    handles = [c.all_reduce(a, async_op=True), c.reduce_scatter(b, vals[rank].clone(), async_op=True),
               c.all_gather(g, vals[rank][:k].clone(), async_op=True)]
    for h in handles:
        h.wait()
    check(f"async/all_reduce/{tag}", a, total)
    check(f"async/reduce_scatter/{tag}", b, total[rank * k:(rank + 1) * k])
    check(f"async/all_gather/{tag}", g, torch.cat([v[:k] for v in vals]))
    _p2p_checks(c, rank, world, vals, tag, check)


def _p2p_checks(c, rank, world, vals, tag, check) -> None:
    if world == 1:
        return  # point-to-point needs a peer
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    got = torch.empty_like(vals[rank])
    for h in c.batch_p2p([("send", vals[rank].clone(), nxt), ("recv", got, prv)]):
        h.wait()
    check(f"batch_p2p_ring/{tag}", got, vals[prv])
    peer = rank ^ 1  # pairs (0,1), (2,3): even ranks send first
    if peer < world:
        got = torch.empty_like(vals[rank])
        if rank % 2 == 0:
            c.send(vals[rank].clone(), peer)
            c.recv(got, peer)
        else:
            c.recv(got, peer)
            c.send(vals[rank].clone(), peer)
        check(f"send_recv/{tag}", got, vals[peer])


def _fp8_checks(c, rank, world, dev, check) -> None:
    pattern = torch.tensor([0.5, 1.0, 2.0, -1.0, 0.0, 4.0])  # every partial sum exact in e4m3 and e5m2
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        tag = str(dtype).replace("torch.", "")
        mine = [(pattern * (r + 1)).to(dtype).to(dev) for r in range(world)]
        x = mine[rank].clone()
        c.all_reduce(x)
        check(f"all_reduce/{tag}", x, (pattern * (world * (world + 1) / 2)).to(dtype).to(dev))
        out = torch.empty(world * 6, dtype=dtype, device=dev)
        c.all_gather(out, mine[rank])
        check(f"all_gather/{tag}", out, torch.cat(mine))
        x = mine[rank].clone()
        c.broadcast(x, src=0)
        check(f"broadcast/{tag}", x, mine[0])
        if world == 1:
            continue
        got = torch.empty_like(mine[rank])
        for h in c.batch_p2p([("send", mine[rank].clone(), (rank + 1) % world), ("recv", got, (rank - 1) % world)]):
            h.wait()
        check(f"batch_p2p/{tag}", got, mine[(rank - 1) % world])


def c_op(name: str):
    from omnitron.backends.collectives import ReduceOp

    return getattr(ReduceOp, name)


def collective_suite() -> dict:
    """Run every check on this rank; returns the names of the checks passed."""
    from omnitron.backends import get_backend

    be = get_backend()
    c = be.collectives
    rank, world = c.rank(), c.world_size()
    if be.device_type != "cpu":
        be.set_device(rank % be.device_count())
    dev = be.device()
    check = _Checker(rank)
    for dtype in FLOATS:
        _float_checks(c, rank, world, dtype, dev, check)
    _fp8_checks(c, rank, world, dev, check)
    # subgroups: even and odd world ranks (every rank creates both, in the same order)
    groups = {p: c.new_group([r for r in range(world) if r % 2 == p]) for p in (0, 1) if p < world}
    members = [r for r in range(world) if r % 2 == rank % 2]
    x = _values(rank, 4, torch.float32, dev)
    c.all_reduce(x, group=groups[rank % 2])
    check("subgroup/all_reduce", x, sum(_values(r, 4, torch.float32, dev) for r in members))
    c.barrier()
    return {"rank": rank, "world": world, "backend": be.name, "checks": check.done,
            "fp8_native": c.fp8_native, "dist_backend": c.dist_backend}
