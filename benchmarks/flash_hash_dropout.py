"""One ring-attention block with context parallelism's hash dropout: the fused Triton flash block against the
chunked reference (both with dropout) and the backend's flash kernel without dropout (the floor).

Per kernel: forward + backward of one ``[b, hq, s, d]`` block (``--causal``: the diagonal block of a ring step;
otherwise an off-diagonal one), the median seconds of ``--rounds`` after a warm-up, and the peak bytes allocated
during one forward + backward above what was allocated before it (inputs excluded). ``--check`` first verifies
on the device, in ``--dtype``: the fused kernel's drop positions (forward, and backward's dq, dk, dv) equal the hash's
bit for bit (:mod:`omnitron.testing.dropout_masks`), and its output and gradients at small shapes match the
float64 reference with the same mask. Rows: ``triton p=P`` (fused), ``triton p=0`` (the same kernel without the
hash: its cost), ``reference p=P``, ``<flash> p=0``.

``--tiles fwd=128x64w8s3,dkdv=32x128w4s3,dq=128x32w4s3`` (repeatable) times the fused block again with other tile
sizes (``BMxBN``, warps, pipeline stages) per kernel: the rows ``triton[SPEC]``.

    python benchmarks/flash_hash_dropout.py --backend cuda --check [--seq 4096] [--heads 32] [--kv-heads 8]
"""
from __future__ import annotations

import argparse
import re
import statistics
import time

import torch

FLASH = {"cuda": "cuda_flash", "cpu": "cpu_flash", "sim": "cpu_flash"}


def _block(be, impl: str):
    """(forward, backward) of implementation ``impl`` (import order: the backend registers its own first)."""
    from omnitron.kernels import get_impl

    be.kernels  # noqa: B018 - building the table registers the backend's implementations
    return get_impl("attention_block_forward", impl), get_impl("attention_block_backward", impl)


def _drop(p: float, sq: int, sk: int, device, seed: int = 1234, head0: int = 0):
    from omnitron.kernels.hash_dropout import block_positions

    pos = torch.randperm(4 * max(sq, sk), device=device)
    return block_positions(pos[:sq], pos[sq:sq + sk], seed, p, head0, device)


def check(be, dtype) -> None:
    """Drop positions bit-identical to the hash, and the fused block against the float64 reference."""
    from omnitron.testing import dropout_masks as M

    dev = be.current_device()
    fwd, bwd = _block(be, "triton")
    rfwd, rbwd = _block(be, "reference")
    for causal, (sq, sk) in ((False, (100, 120)), (True, (120, 120))):  # several tiles; head dims <= 128
        drop = _drop(0.25, sq, sk, dev, seed=2 ** 40 + 7, head0=3)
        want = M.expected(drop, 2, 4, sq, sk, causal, dev)
        fk = M.forward_kept(fwd, drop, 2, 4, 2, sq, sk, causal, dtype, dev)
        bk = M.backward_kept(bwd, drop, 2, 4, sq, sk, causal, dtype, dev)
        same = [torch.equal(x, want) for x in (fk, *bk)]
        print(f"check mask causal={causal} {sq}x{sk}: forward, dq, dk, dv bit-identical to the hash: {same}")
        q = torch.randn(2, 4, sq, 64, device=dev)
        k, v = (torch.randn(2, 2, sk, 64, device=dev) for _ in range(2))
        qd, kd, vd = (t.to(dtype) for t in (q, k, v))
        o64, l64 = rfwd(*(t.double() for t in (qd, kd, vd)), causal=causal, scale=0.125, drop=drop)
        o, l = fwd(qd, kd, vd, causal=causal, scale=0.125, drop=drop)
        do = torch.randn_like(o64)
        g64 = rbwd(do, *(t.double() for t in (qd, kd, vd)), o64, l64, causal=causal, scale=0.125, drop=drop)
        g = bwd(do.to(dtype), qd, kd, vd, o64.to(dtype), l64.float(), causal=causal, scale=0.125, drop=drop)
        errs = [float((x.double() - y).abs().max() / y.abs().max()) for x, y in zip((o, l, *g), (o64, l64, *g64))]
        print(f"check {dtype} causal={causal}: max |err| / max |ref| out, lse, dq, dk, dv = "
              + ", ".join(f"{e:.2e}" for e in errs))


def measure(be, fwd, bwd, q, k, v, causal: bool, drop, rounds: int) -> tuple[float, int]:
    """(median seconds of forward + backward, peak bytes allocated above the inputs)."""
    kw = dict(causal=causal, scale=q.shape[-1] ** -0.5, drop=drop)

    def step():
        out, lse = fwd(q, k, v, **kw)
        bwd(torch.ones_like(q) if out.shape == q.shape else torch.ones_like(out), q, k, v, out, lse, **kw)

    step()
    be.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        step()
        be.synchronize()
        times.append(time.perf_counter() - t0)
    base = be.memory_stats()["allocated"]
    be.reset_peak_memory_stats()
    step()
    be.synchronize()
    peak = be.memory_stats()["peak_allocated"]
    return statistics.median(times), (peak - base) if peak is not None and base is not None else -1


def parse_tiles(spec: str) -> dict:
    """``"fwd=128x64w8s3,dq=..."`` -> ``{kind: (BM, BN, {num_warps, num_stages})}`` (kinds left out keep theirs)."""
    out = {}
    for part in filter(None, spec.split(",")):
        m = re.fullmatch(r"(fwd|dkdv|dq)=(\d+)x(\d+)w(\d+)s(\d+)", part.strip())
        if m is None:
            raise SystemExit(f"--tiles {spec!r}: each part is KIND=BMxBNwWARPSsSTAGES, KIND fwd, dkdv or dq")
        out[m[1]] = (int(m[2]), int(m[3]), dict(num_warps=int(m[4]), num_stages=int(m[5])))
    return out


def with_tiles(spec: str):
    """A context in which the fused block uses the tiles of ``spec`` (:func:`parse_tiles`)."""
    import contextlib

    from omnitron.kernels.triton_kernels import flash_block

    @contextlib.contextmanager
    def ctx():
        table, default = parse_tiles(spec), flash_block._tiles
        flash_block._tiles = lambda kind, bd: table.get(kind) or default(kind, bd)
        try:
            yield
        finally:
            flash_block._tiles = default

    return ctx()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--seq", type=int, default=4096, help="rows of the block (both q and k/v)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--check", action="store_true", help="verify masks and accuracy on the device first")
    ap.add_argument("--tiles", action="append", default=[], help="other tile sizes of the fused block (docstring)")
    a = ap.parse_args()
    from omnitron.backends import get_backend

    be = get_backend(a.backend)
    dtype = getattr(torch, a.dtype)
    if a.check:
        check(be, dtype)  # (each dtype compiles its own kernels: about a minute on the H200)
    dev = be.current_device()
    q = torch.randn(a.batch, a.heads, a.seq, a.head_dim, device=dev, dtype=dtype)
    k, v = (torch.randn(a.batch, a.kv_heads, a.seq, a.head_dim, device=dev, dtype=dtype) for _ in range(2))
    drop = _drop(a.p, a.seq, a.seq, dev)
    rows = [("triton", a.p), ("triton", 0.0), ("reference", a.p), (FLASH.get(a.backend, "reference"), 0.0)]
    print(f"block b={a.batch} hq={a.heads} hkv={a.kv_heads} s={a.seq} d={a.head_dim} {a.dtype} causal={a.causal} "
          f"on {a.backend}: forward + backward")
    for impl, p in rows:
        fwd, bwd = _block(be, impl)
        s, peak = measure(be, fwd, bwd, q, k, v, a.causal, drop if p else None, a.rounds)
        print(f"  {impl:>10} p={p:<4}: {s * 1e3:9.2f} ms   peak +{peak / 2 ** 20:9.1f} MiB")
    for spec in a.tiles:
        fwd, bwd = _block(be, "triton")
        with with_tiles(spec):
            for p in (a.p, 0.0):
                s, peak = measure(be, fwd, bwd, q, k, v, a.causal, drop if p else None, a.rounds)
                print(f"  triton[{spec}] p={p:<4}: {s * 1e3:9.2f} ms   peak +{peak / 2 ** 20:9.1f} MiB")


if __name__ == "__main__":
    main()
