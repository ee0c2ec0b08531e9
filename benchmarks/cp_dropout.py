"""Ring attention with attention dropout at cp=2 on CPU: peak memory and forward + backward time, before / after.

Each tree (``--before`` a checkout of the engine before counter-based dropout, and this one) runs in its own
subprocess and spawned world of 2 gloo ranks (1 thread each), one after the other in one invocation: per rank,
``ring_attention`` on ``[b=1, --heads, s/2, 64]`` fp32 with the backend's block kernel and ``dropout_p = --p``
(and, in this tree, ``p = 0``: the fused flash kernel, the floor), ``s`` the best fwd+bwd wall seconds of
``--rounds``, ``peak`` the MiB of tensors created during one fwd+bwd and alive together
(:class:`omnitron.kernels.benchmark.PeakTracker`, its own run: the tracking slows ops).

    git archive <rev> omnitron | tar -x -C /tmp/before && cp omnitron/*.so /tmp/before/omnitron/
    python benchmarks/cp_dropout.py --before /tmp/before [--seq 4096] [--heads 4] [--p 0.1] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def work(seq: int, heads: int, ps: list[float], rounds: int) -> dict:
    """This rank's best fwd+bwd seconds and peak MiB per dropout probability."""
    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.parallel.context import ring_attention
    from omnitron.core.parallel.context.blocks import backend_kernel
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.kernels.benchmark import PeakTracker

    torch.set_num_threads(1)
    be = get_backend()
    g = ParallelGroups.build(ParallelConfig(context_parallel_size=2), be.collectives)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq // 2, 64, generator=gen) for _ in range(3))

    def step(p):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        ring_attention(qq, kk, vv, group=g.cp, collectives=be.collectives, kernel=backend_kernel(be),
                       dropout_p=p, seed=1).sum().backward()

    out = {}
    for p in ps:
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            step(p)
            times.append(time.perf_counter() - t0)
        tracker = PeakTracker()
        with tracker:
            step(p)
        out[str(p)] = dict(s=round(min(times), 3), peak_mib=round(tracker.peak / 2 ** 20, 1))
    return out


def run_tree(tree: str, seq: int, heads: int, ps: list[float], rounds: int) -> list[dict]:
    """The per-rank rows of :func:`work` with the engine of ``tree`` (a subprocess)."""
    env = dict(os.environ, PYTHONPATH=tree)
    args = [sys.executable, os.path.abspath(__file__), "--worker", "--seq", str(seq), "--heads", str(heads),
            "--p", ",".join(map(str, ps)), "--rounds", str(rounds)]
    res = subprocess.run(args, env=env, capture_output=True, text=True, check=True, cwd=tree)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default=None, help="a tree of the engine before (its omnitron/ with the .so files)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--p", default="0.1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    ps = [float(x) for x in a.p.split(",")]
    if a.worker:
        from omnitron.testing.distributed import run_distributed

        print(json.dumps(run_distributed(work, 2, a.seq, a.heads, ps, a.rounds)))
        return
    print(f"load average before: {os.getloadavg()}")
    rows = {}
    if a.before:
        rows["before"] = run_tree(a.before, a.seq, a.heads, ps, a.rounds)
    rows["after"] = run_tree(HERE, a.seq, a.heads, ps + [0.0], a.rounds)
    for tree, ranks in rows.items():
        for rank, r in enumerate(ranks):
            for p, row in r.items():
                print(f"{tree:6s} rank {rank} p {p}: fwd+bwd {row['s']:.3f} s, peak {row['peak_mib']:.1f} MiB")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
