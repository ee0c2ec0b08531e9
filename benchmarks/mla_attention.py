"""MLA's core attention on the CPU: a value head narrower than the query/key head (DeepSeek-V3: 128 against
128 + 64), through PyTorch's SDPA as it is (its math path: the CPU flash kernel needs equal widths) against the
reference kernel's zero-padded values (flash kernel, output trimmed). Causal, fp32, one thread, batch 1, 8 heads,
query/key 48 = 32 + 16 rotated, values 32 (``deepseek_vs_mixtral.py``'s DeepSeek shape); forward + backward of one
call, the best of ``--rounds``, and the peak of the storages the call creates
(:class:`~omnitron.kernels.benchmark.PeakTracker`). The two run alternately in one process.

    python benchmarks/mla_attention.py [--seq 256 1024 2048] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure(fn, q, k, v) -> tuple[float, int]:
    """Seconds and peak bytes of one forward + backward of ``fn(q, k, v)`` on fresh leaves."""
    from omnitron.kernels.benchmark import PeakTracker

    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    with PeakTracker() as tracker:
        t0 = time.perf_counter()
        fn(q, k, v).sum().backward()
        seconds = time.perf_counter() - t0
    return seconds, tracker.peak


def main() -> None:
    from omnitron.kernels.reference.attention import attention

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    paths = {"SDPA as is (math)": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
             "reference, v padded (flash)": lambda q, k, v: attention(q, k, v, causal=True)}
    print("seq | path | fwd+bwd ms (best) | peak MiB")
    for s in a.seq:
        g = torch.Generator().manual_seed(s)
        q, k, v = (torch.randn(1, 8, s, d, generator=g) for d in (48, 48, 32))
        best = {name: (float("inf"), 0) for name in paths}
        for _ in range(a.rounds):
            for name, fn in paths.items():
                sec, peak = measure(fn, q, k, v)
                best[name] = (min(best[name][0], sec), peak)
        for name, (sec, peak) in best.items():
            print(f"{s} | {name} | {sec * 1e3:.1f} | {peak / 2**20:.1f}")


if __name__ == "__main__":
    main()
