"""Ring attention with a sliding window at cp=2 on CPU: forward + backward time and the work the tiles do.

One spawned world of 2 gloo ranks (1 thread each); per window (none = plain causal), ``ring_attention`` on
``[b=1, --heads, s=--seq, 64]`` fp32 with the backend's block kernel, best of ``--rounds``. Reported per rank:
``s`` the best wall seconds, ``pairs`` the (query, key) pairs its tiles cover over both steps, ``tiles`` and
``cut`` (tiles the window's edge cuts, on the reference kernel with a mask; the rest on the fused kernel).

    python benchmarks/cp_window.py [--seq 4096] [--heads 8] [--windows 0,128,1024] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def work(seq: int, heads: int, windows: list[int], rounds: int) -> dict:
    """This rank's rows: per window, the best fwd+bwd seconds and its tiles' work."""
    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.parallel.context import ring_attention
    from omnitron.core.parallel.context.blocks import backend_kernel
    from omnitron.core.parallel.context.tiles import step_plan
    from omnitron.core.parallel.groups import ParallelGroups

    torch.set_num_threads(1)
    be = get_backend()
    g = ParallelGroups.build(ParallelConfig(context_parallel_size=2), be.collectives)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq // 2, 64, generator=gen) for _ in range(3))
    out = {}
    for left in windows:
        window = (left, 0) if left else None
        times = []
        for _ in range(rounds):
            qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
            t0 = time.perf_counter()
            ring_attention(qq, kk, vv, group=g.cp, collectives=be.collectives, kernel=backend_kernel(be),
                           window=window).sum().backward()
            times.append(time.perf_counter() - t0)
        tiles = [t for i in range(2) for t in step_plan(i, g.cp.rank, 2, seq // 2, True, window)]
        rows = range(seq // 2)
        out[str(left or "none")] = dict(s=round(min(times), 3), tiles=len(tiles),
                                        cut=sum(t.mask is not None for t in tiles),
                                        pairs=sum(len(rows[t.rows]) * len(rows[t.cols]) for t in tiles))
    return out


def main() -> None:
    from omnitron.testing.distributed import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--windows", default="0,128,1024", help="left window sizes; 0 = plain causal")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    res = run_distributed(work, 2, a.seq, a.heads, [int(w) for w in a.windows.split(",")], a.rounds)
    for rank, rows in enumerate(res):
        for window, row in rows.items():
            print(f"rank {rank} window {window:>5}: {row['s']:.3f} s, {row['pairs']:,} pairs, "
                  f"{row['tiles']} tiles ({row['cut']} cut)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"load_average": os.getloadavg(), "ranks": res}, f, indent=1)


if __name__ == "__main__":
    main()
