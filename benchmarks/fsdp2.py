"""--use-torch-fsdp2 against the distributed optimizer (ZeRO-1) at the same layout: bytes per parameter per rank
and step time, side by side in one gloo world.

Both run the path users run (``build_components`` + ``train_step``: the pipeline schedule, the gradient
reduction, clipping, the fused AdamW) on the same model, data and ``--bf16``, at dp = world size (tp = pp = 1).

Memory, from the tensors each rank holds after a step (deduplicated storages, divided by one replica's
parameter count, max over ranks): parameters (FSDP2: the fp32 sharded DTensors' local storage, padding
included; ZeRO-1: the bf16 parameters), gradients (FSDP2: the fp32 sharded gradients; ZeRO-1: the fp32
``main_grad`` buffers) and the optimizer's states (FSDP2: the Adam moments, the sharded parameters being the
masters; ZeRO-1: fp32 master slices + moments). Beside it the ZeRO formulas for bf16 training:
ZeRO-3 (2 + 2 + 12) / dp and Megatron's distributed optimizer 2 + 4 + 12 / dp. ``peak B``: the peak of the
tensors created inside one whole step (activations, FSDP's all-gathered bf16 layers and their unsharded
gradients, communication buffers, the optimizer's temporaries), counted by the same dispatch-mode accounting
as ``benchmarks/zero_memory.py``; the same activations are in both columns.

``fsdp2`` reduces once per step (unsharded fp32 gradients accumulated over the micro-batches); ``fsdp2-each``
is ``--fsdp2-reduce-every-microbatch`` (sharded accumulation, one reduce-scatter per micro-batch).

Step time: ``--steps`` timed steps per engine after ``--warmup``, the engines alternated in blocks of one step
(ABAB...) so a change in the machine's load falls on both; the median per engine.

    python benchmarks/fsdp2.py [--dp 4] [--layers 4] [--micro-batches 2] [--steps 8] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.zero_memory import TransientBytes  # noqa: E402  (the same accounting)

MODEL = ["--hidden-size", "256", "--num-attention-heads", "4", "--ffn-hidden-size", "1024",
         "--seq-length", "128", "--max-position-embeddings", "128", "--mock-data", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", "4096", "--num-workers", "0", "--micro-batch-size", "2",
         "--optimizer", "adam", "--lr", "1e-4", "--clip-grad", "1.0", "--bf16", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--no-tensorboard", "--seed", "1234", "--eval-interval", "0"]
ENGINES = {"fsdp2": ["--use-torch-fsdp2"], "fsdp2-each": ["--use-torch-fsdp2", "--fsdp2-reduce-every-microbatch"],
           "zero1": ["--use-distributed-optimizer"]}


def _storages(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def held_bytes(c) -> dict:
    """Bytes this rank holds between steps: parameters, gradients, optimizer state (see the docstring)."""
    from omnitron.core.parallel.data import DistributedDataParallel
    from omnitron.core.parallel.data.fsdp import local_shard

    params = [p for m in c.modules for p in m.parameters()]
    if isinstance(c.chunks[0], DistributedDataParallel):
        grads = [b.data for ch in c.chunks for b in ch.buffers]
    else:
        grads = [local_shard(p.grad) for p in params if p.grad is not None]
    return {"params": _storages([local_shard(p.detach()) for p in params]), "grads": _storages(grads),
            "optimizer": c.optimizer.state_bytes(), "numel": sum(p.numel() for p in params)}


def _components(root: str, engine: str, world: int, gbs: int, steps: int, layers: int):
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.components import build_components
    from omnitron.core.training.loop import data_iterator

    argv = MODEL + ["--num-layers", str(layers), "--global-batch-size", str(gbs), "--train-iters", str(steps),
                    "--data-cache-path", f"{root}/{engine}"] + ENGINES[engine]
    c = build_components(parse_settings(argv, world), get_backend())
    return c, data_iterator(c, c.train_data, 0)


def bench_worker(root: str, world: int, gbs: int, steps: int, warmup: int, layers: int) -> dict:
    import torch.distributed as dist

    from omnitron.core.training.step import train_step

    torch.set_num_threads(1)
    runs = {e: _components(root, e, world, gbs, steps + warmup + 1, layers) for e in ENGINES}
    out = {e: {"times": []} for e in ENGINES}
    for e, (c, it) in runs.items():
        mode = TransientBytes()
        with mode:  # the first step: memory accounting (also warms up)
            train_step(c, it)
        out[e].update(held_bytes(c), peak=mode.peak)
    for i in range(warmup + steps):
        for e, (c, it) in runs.items():
            dist.barrier()
            t0 = time.perf_counter()
            train_step(c, it)
            dist.barrier()
            if i >= warmup:
                out[e]["times"].append(time.perf_counter() - t0)
    return out


def main() -> None:
    import tempfile

    from omnitron.testing.distributed import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=2, help="per replica and step")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    gbs = 2 * args.dp * args.micro_batches
    with tempfile.TemporaryDirectory() as root:
        ranks = run_distributed(bench_worker, args.dp, root, args.dp, gbs, args.steps, args.warmup, args.layers,
                                timeout_s=1800)
    dp, rows = args.dp, []
    zero3 = ("ZeRO-3 (2+2+12)/dp", 16 / dp)
    formula = {"fsdp2": zero3, "fsdp2-each": zero3, "zero1": ("ZeRO-1 2+4+12/dp", 6 + 12 / dp)}
    print(f"{args.layers} layers, hidden 256, dp {dp}, {args.micro_batches} micro-batches per replica, --bf16, AdamW; "
          f"bytes per parameter per rank (max over ranks); step time median of {args.steps} (ABAB)")
    print(f"{'engine':>10} | {'param B':>7} {'grad B':>7} {'optim B':>7} {'total':>7} | {'formula':>20} {'':>6} | "
          f"{'peak B':>7} | {'step s':>7}")
    for e in ENGINES:
        worst = max((r[e] for r in ranks), key=lambda m: m["params"] + m["grads"] + m["optimizer"])
        n = worst["numel"]
        per = {k: worst[k] / n for k in ("params", "grads", "optimizer")}
        total = sum(per.values())
        peak = max(r[e]["peak"] for r in ranks) / n
        step = statistics.median(t for r in ranks[:1] for t in r[e]["times"])
        name, value = formula[e]
        rows.append({"engine": e, "dp": dp, **per, "total": total, "formula": value, "peak": peak, "step_s": step,
                     "times": ranks[0][e]["times"], "numel": n})
        print(f"{e:>10} | {per['params']:7.3f} {per['grads']:7.3f} {per['optimizer']:7.3f} {total:7.3f} | "
              f"{name:>20} {value:6.3f} | {peak:7.3f} | {step:7.3f}")
    ratios = ", ".join(f"{r['engine']} {r['step_s'] / rows[-1]['step_s']:.2f}" for r in rows[:-1])
    print(f"parameters per replica: {rows[0]['numel']:,}; step time / zero1's: {ratios}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
