"""``omnitron bench memory``: the device's copy, read and write bandwidth, the ceiling every memory-bound
kernel is judged against (``omnitron bench compare`` gives kernels as % of the copy figure).

copy: ``y.copy_(x)`` moves 2 x S bytes (read + write); read: ``x.sum()`` (S read, one scalar written);
write: ``x.fill_(v)`` (S written). Sizes double from ``min_bytes`` to ``max_bytes``; GB/s are 1e9 bytes/s.
"""
from __future__ import annotations

import torch

from omnitron.bench.timing import median_ms


def run(backend, *, byte_sizes: list[int], rounds: int = 10, budget_s: float = 1.0, log=print) -> list[dict]:
    dev, rows = backend.current_device(), []
    for nbytes in byte_sizes:
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
        y = torch.empty_like(x)
        size = x.numel() * 4
        for op, fn, moved in (("copy", lambda: y.copy_(x), 2 * size), ("read", lambda: x.sum(), size),
                              ("write", lambda: x.fill_(2.0), size)):
            ms = median_ms(fn, backend, rounds=rounds, budget_s=budget_s)
            rows.append({"op": op, "bytes": size, "ms": ms, "gbs": moved / (ms * 1e-3) / 1e9})
            log(f"memory {op:5s} {size:>12d} B: {ms:9.3f} ms {rows[-1]['gbs']:8.2f} GB/s")
    return rows


def copy_gbs(rows: list[dict]) -> float | None:
    """The copy bandwidth of a memory report at its largest size: the device memory's, launch overhead hidden.
    Not the best over sizes: a copy that fits a cache beats memory (on a 2-core Xeon, 2026-12-01: 64 KiB at
    31.6 GB/s, 256 MiB at 7.9), and kernels on memory-sized tensors are judged against memory's figure."""
    copies = [r for r in rows if r["op"] == "copy" and r.get("gbs")]
    if not copies:
        return None
    largest = max(r["bytes"] for r in copies)
    return max(r["gbs"] for r in copies if r["bytes"] == largest)
