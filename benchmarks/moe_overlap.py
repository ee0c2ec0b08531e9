"""--overlap-moe-expert-parallel-comm: step time with and without the combined forward/backward pairs.

Layouts (``--layouts``): ``ep2``, two processes (ep 2, dp 2), no pipelining; ``ep2xpp2``, four processes
(ep 2, dp 2, pp 2, 1F1B). A GPT with MoE layers (--num-experts 8, top-2); each configuration trains
``--iters`` steps and reports rank 0's median step time of the steps after the first, and the losses (equal
bit for bit with and without the flag).

    python benchmarks/moe_overlap.py [--backend cpu] [--layouts ep2,ep2xpp2] [--iters 6] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _argv(a, root: str, overlap: bool, pp: int) -> list[str]:
    flags = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", "8",
             "--seq-length", str(a.seq), "--max-position-embeddings", str(a.seq), "--mock-data",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024", "--num-workers", "0",
             "--micro-batch-size", "2", "--global-batch-size", str(4 * a.micro_batches), "--num-experts", "8",
             "--moe-router-topk", "2", "--expert-model-parallel-size", "2", "--hidden-dropout", "0",
             "--attention-dropout", "0", "--train-iters", str(a.iters), "--log-interval", "1", "--no-tensorboard",
             "--lr", "1e-4", "--data-cache-path", os.path.join(root, "cache"), "--log-dir", os.path.join(root, "logs"),
             "--pipeline-model-parallel-size", str(pp)]
    return flags + (["--overlap-moe-expert-parallel-comm"] if overlap else [])


def measure(a, overlap: bool, pp: int) -> dict:
    """Worker: train once; rank 0's median step time and the losses."""
    import torch
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as root:
        root = os.path.join(root, str(dist.get_rank()))
        res = train(parse_settings(_argv(a, root, overlap, pp), dist.get_world_size()), get_backend())
        recs = []
        if dist.get_rank() == 0:
            recs = [json.loads(line) for line in open(os.path.join(root, "logs", "metrics.jsonl"))]
    return {"overlap": overlap, "pp": pp, "losses": res["losses"],
            "step_s": statistics.median(r["step_time_s"] for r in recs[1:]) if recs else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cpu")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--layouts", default="ep2,ep2xpp2")
    p.add_argument("--json")
    a = p.parse_args()
    from omnitron.testing.distributed import run_distributed

    print(f"{a.backend}: L={a.layers} h={a.hidden} s={a.seq} b=2 x {a.micro_batches} micro-batches, 8 experts top-2")
    rows = []
    for layout in a.layouts.split(","):
        pp = 2 if layout == "ep2xpp2" else 1
        pair = [run_distributed(measure, 2 * pp, a, overlap, pp, backend=a.backend)[0] for overlap in (False, True)]
        rows += pair
        print(f"{layout}: step {pair[0]['step_s']:.3f} s plain, {pair[1]['step_s']:.3f} s combined (ratio "
              f"{pair[1]['step_s'] / pair[0]['step_s']:.3f}); losses equal: {pair[0]['losses'] == pair[1]['losses']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
