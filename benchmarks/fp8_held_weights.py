"""FP8 weights held outside the compiled layers' graphs against quantized in them (CPU, emulated FP8 GEMMs).

Two copies of one GPT (same seed), tensorwise FP8 on every linear but the output layer, layers compiled with
inductor; one holds its weights' FP8 form outside the graphs (:mod:`omnitron.core.precision.fp8.static_weights`,
what ``omnitron train --torch-compile`` does), the other quantizes them in every layer call. A step: ``--micro-batches``
forward + backward passes, then AdamW. Steps alternate between the two models, so load changes hit both alike;
reported: the median step of each, their ratio, and the losses (equal within FP8's rounding of the same math).

    PYTHONPATH=. python benchmarks/fp8_held_weights.py [--micro-batches 4] [--steps 8] [--threads 1] [--json F]
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

# benchmarks/ is on the path when run as a script
from compile_step import SHAPE, GPTConfig, GPTModel, ParallelGroups, alternate, fp8_model


def build(held: bool, micro_batches: int, micro: int):
    model = GPTModel(GPTConfig(**SHAPE), ParallelGroups.single(), seed=1)
    fp8_model(model, "inductor", held)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, SHAPE["vocab_size"], (micro, SHAPE["seq_length"]), generator=gen)
               for _ in range(micro_batches)]

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for tokens in batches:
            loss = model(tokens, labels=tokens).float().mean() / micro_batches
            loss.backward()
            total += float(loss.detach())
        opt.step()
        return total

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    steps = {name: build(name == "held", a.micro_batches, a.micro) for name in ("held", "in-graph")}
    times, _, losses = alternate(steps, a.steps)  # round 0 compiles
    times = {name: ts[1:] for name, ts in times.items()}
    med = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
    out = dict(shape=SHAPE, micro_batches=a.micro_batches, micro=a.micro, steps=a.steps, threads=a.threads,
               median_ms=med, ratio_held_over_in_graph=med["held"] / med["in-graph"], losses=losses)
    for name in steps:
        print(f"{name:8s} median step {med[name]:8.1f} ms  losses {[round(x, 5) for x in losses[name]]}")
    print(f"held / in-graph: {out['ratio_held_over_in_graph']:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
