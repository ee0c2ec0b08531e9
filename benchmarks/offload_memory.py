"""Activation offloading: peak device memory saved and step cost, on a backend with a device allocator.

One process trains a GPT (--num-layers L, hidden H, sequence S, micro-batch B) for a few steps without
offloading and with ``--cpu-offloading-num-layers N`` for each N given; per run the peak allocated device
memory (the backend's allocator, after the first step: the optimizer state exists then) and the median
step time of the later steps, plus the host bytes the offloader copied per step. On ``sim`` the device
is host memory behind a stream-ordered allocator and copies are memcpys, so the memory column is what a
GPU would save while the time column is the host cost of the extra copies and hooks, not PCIe time.

    python benchmarks/offload_memory.py --backend sim [--layers 4 --offload 1 2 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _argv(a, root: str, offload: int) -> list[str]:
    flags = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", "8",
             "--seq-length", str(a.seq), "--max-position-embeddings", str(a.seq), "--mock-data",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024", "--num-workers", "0",
             "--micro-batch-size", str(a.micro_batch), "--global-batch-size", str(a.micro_batch),
             "--train-iters", str(a.iters), "--log-interval", "1", "--no-tensorboard", "--lr", "1e-4",
             "--data-cache-path", os.path.join(root, "cache"), "--log-dir", os.path.join(root, f"logs{offload}")]
    return flags + (["--cpu-offloading-num-layers", str(offload)] if offload else [])


def measure(a, offload: int) -> dict:
    """Worker: train once; peak memory, step times and offloaded bytes per step."""
    import torch

    from omnitron.backends import get_backend
    from omnitron.core.parallel.data.wrapper import unwrap_model
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    torch.set_num_threads(1)
    be = get_backend()
    with tempfile.TemporaryDirectory() as root:
        res = train(parse_settings(_argv(a, root, offload), 1), be)
        recs = [json.loads(line) for line in open(os.path.join(root, f"logs{offload}", "metrics.jsonl"))]
    model = unwrap_model(res["components"].modules[0])
    stats = model.offloader.stats if model.offloader else None
    return {"offload_layers": offload, "peak_bytes": be.memory_stats()["peak_allocated"],
            "step_s": statistics.median(r["step_time_s"] for r in recs[1:]),
            "host_bytes_per_step": (stats.activation_bytes + stats.weight_bytes) // a.iters if stats else 0,
            "loss": res["losses"][a.iters]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="sim")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--offload", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--json")
    a = p.parse_args()
    from omnitron.testing.distributed import run_distributed

    rows = [run_distributed(measure, 1, a, n, backend=a.backend)[0] for n in [0, *a.offload]]
    base = rows[0]
    print(f"{a.backend}: GPT L={a.layers} h={a.hidden} s={a.seq} b={a.micro_batch}, {a.iters} steps")
    print("| offloaded layers | peak MiB | saved MiB | host MiB/step | step s | step x | last loss |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['offload_layers']} | {r['peak_bytes'] / 2**20:.1f} | "
              f"{(base['peak_bytes'] - r['peak_bytes']) / 2**20:.1f} "
              f"| {r['host_bytes_per_step'] / 2**20:.1f} | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f} "
              f"| {r['loss']!r} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
