"""Predicted (omnitron.plan) vs measured activation bytes of one micro-batch, every stage, tp1 layouts of the
tiny GPT/Llama shapes and gpt2_tiny's layer at 100M-model width (hidden 768, 12 heads); the measured side is
the distinct storages autograd saves in a real forward of each stage (omnitron.plan.measure).

    PYTHONPATH=. python benchmarks/plan_memory.py
"""
from __future__ import annotations

import time

from omnitron.core.training.arguments import parse_settings
from omnitron.plan.measure import stage_microbatch_bytes
from omnitron.plan.memory import chunk_layers, microbatch_bytes, model_config

TINY = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
        "--max-position-embeddings", "256", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200"]
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--num-query-groups", "2",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--ffn-hidden-size", "352"]
WIDE = ["--num-layers", "4", "--hidden-size", "768", "--num-attention-heads", "12", "--seq-length", "256",
        "--max-position-embeddings", "256", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]
PP2 = ["--pipeline-model-parallel-size", "2"]
LAYOUTS = {
    "tiny pp1": (1, TINY),
    "tiny pp1 mbs2 s256": (1, TINY + ["--micro-batch-size", "2", "--seq-length", "256"]),
    "tiny pp1 selective": (1, TINY + ["--recompute-granularity", "selective"]),
    "tiny pp2 full uniform2": (2, TINY + PP2 + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                                "--recompute-num-layers", "2"]),
    "tiny pp2 full block1 s256": (2, TINY + PP2 + ["--recompute-granularity", "full", "--recompute-method", "block",
                                                   "--recompute-num-layers", "1", "--seq-length", "256"]),
    "tiny pp2 vp2": (2, TINY + PP2 + ["--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "4"]),
    "llama-tiny pp1 bf16": (1, TINY + LLAMA + ["--bf16"]),
    "llama-tiny pp2 mbs2": (2, TINY + LLAMA + PP2 + ["--micro-batch-size", "2"]),
    "h768 pp1": (1, WIDE),
    "h768 pp2 selective": (2, WIDE + PP2 + ["--recompute-granularity", "selective"]),
    "h768 pp2 bf16 mbs2": (2, WIDE + PP2 + ["--bf16", "--micro-batch-size", "2"]),
    "h768 pp1 full uniform1": (1, WIDE + ["--recompute-granularity", "full", "--recompute-method", "uniform"]),
}


STEP = {name: argv for name, (world, argv) in LAYOUTS.items() if world == 1}


def step_peak(argv: list[str], root: str) -> tuple[int, int]:
    """(bytes of every storage created during one training step at its peak, predicted activations + logits +
    recompute):
    one process, a warm step first; the parameters, gradient buffers and optimizer state exist before and
    count 0 (omnitron.kernels.benchmark.PeakTracker), so the peak is activations plus backward transients."""
    import torch

    from omnitron.backends import get_backend
    from omnitron.core.training.components import build_components
    from omnitron.core.training.loop import data_iterator
    from omnitron.core.training.step import train_step
    from omnitron.kernels.benchmark import PeakTracker
    from omnitron.plan.memory import estimate

    torch.set_num_threads(1)
    s = parse_settings(argv + ["--num-workers", "0", "--train-iters", "3", "--no-tensorboard", "--data-cache-path",
                               root], 1)
    c = build_components(s, get_backend())
    it = data_iterator(c, c.train_data, 0)
    train_step(c, it)
    tracker = PeakTracker()
    with tracker:
        train_step(c, it)
    e = estimate(s)[0]
    return tracker.peak, e.activations + e.logits + e.recompute


def main() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        print(f"{'layout (one process)':28s} {'predicted MiB':>14s} {'step peak MiB':>14s} {'error':>8s}")
        for name, argv in STEP.items():
            peak, pred = step_peak(argv, root)
            print(f"{name:28s} {pred / 2**20:14.3f} {peak / 2**20:14.3f} {100 * (pred / peak - 1):+7.2f}%")
    micro()


def micro() -> None:
    print(f"{'layout':28s} {'stage':>8s} {'predicted MiB':>14s} {'measured MiB':>13s} {'error':>8s}")
    worst, start = 0.0, time.perf_counter()
    for name, (world, argv) in LAYOUTS.items():
        s = parse_settings(argv, world)
        cfg = model_config(s)
        layers = chunk_layers(s, cfg)
        pp, vp = s.parallel.pipeline_model_parallel_size, s.parallel.virtual_pipeline_model_parallel_size or 1
        for key, real in stage_microbatch_bytes(s, cfg).items():
            acts, logits = microbatch_bytes(s, cfg, layers[key], last=key == (pp - 1, vp - 1), first=key == (0, 0))
            err = (acts + logits) / real - 1
            worst = max(worst, abs(err))
            print(f"{name:28s} {str(key):>8s} {(acts + logits) / 2**20:14.3f} {real / 2**20:13.3f} {100 * err:+7.3f}%")
    print(f"worst |error| {100 * worst:.3f}% over {len(LAYOUTS)} layouts, {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
