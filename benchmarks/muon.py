"""Muon against AdamW on the bundled corpus: loss at equal tokens and step time, one run side by side.

Each variant trains the small GPT of ``examples/moby_dick_tp2_pp2.yaml`` (gpt2_tiny, the corpus BPE) in one
process (tp1 x pp1, one thread) for ``--iters`` iterations, same data, same seed, same learning-rate schedule;
the variants run one after the other in this invocation. Loss at equal tokens: the training loss at the same
iterations (every variant sees the same batches), and the validation loss at the end. Step time: wall time of
each ``train_step``, median over steps 2..iters-1 (the first warms up, the last also evaluates); and, measured
interleaved so that the machine's load hits the variants alike, the median time of a training step (15 rounds)
and of the optimizer step alone (random gradients, 30 rounds).

    python benchmarks/muon.py [--iters 200 --out benchmarks/results/muon]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

VARIANTS = {
    "adam": ["--optimizer", "adam"],
    "muon": ["--optimizer", "muon"],  # Megatron's defaults: momentum 0.9, quintic x5, spectral scale, bf16 NS
    "muon_scale0.2": ["--optimizer", "muon", "--muon-extra-scale-factor", "0.2"],  # update RMS ~ AdamW's
    "muon_fp32": ["--optimizer", "muon", "--muon-fp32-matmul-prec", "high"],  # fp32 Newton-Schulz
}


def _args(variant: str, iters: int, root: str) -> list[str]:
    return ["--config", os.path.join(ROOT, "examples", "moby_dick_tp2_pp2.yaml"), "--tensor-model-parallel-size", "1",
            "--pipeline-model-parallel-size", "1", "--train-iters", str(iters), "--eval-interval", str(iters),
            "--save-interval", str(10 * iters), "--save", os.path.join(root, variant), "--log-interval", "50",
            "--no-tensorboard", *VARIANTS[variant]]


def run(variant: str, iters: int) -> dict:
    """One training; its per-iteration losses, validation and step times."""
    import torch

    from omnitron.backends import get_backend
    from omnitron.core.training import loop
    from omnitron.core.training.arguments import parse_settings

    torch.set_num_threads(1)
    times: list[float] = []
    inner = loop.train_step

    def timed(*a, **kw):
        t0 = time.perf_counter()
        out = inner(*a, **kw)
        times.append(time.perf_counter() - t0)
        return out

    loop.train_step = timed
    try:
        with tempfile.TemporaryDirectory() as root:
            res = loop.train(parse_settings(_args(variant, iters, root), 1), get_backend("cpu"))
    finally:
        loop.train_step = inner
    losses = [res["losses"][k] for k in sorted(res["losses"])]
    return {"variant": variant, "flags": VARIANTS[variant], "iters": iters, "losses": losses,
            "validation": res.get("validation"), "median_step_s": statistics.median(times[1:-1]),
            "load_avg": os.getloadavg()}


def interleaved_ms(variants: list[str], rounds: int = 15) -> dict[str, dict[str, float]]:
    """Per variant, median ms of one ``train_step`` and of one ``optimizer.step`` alone (random gradients, twice
    the rounds), the variants interleaved round by round so that the machine's load hits them alike."""
    import torch

    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.components import build_components
    from omnitron.core.training.loop import data_iterator
    from omnitron.core.training.step import train_step

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    runs, steps, opts = {}, {v: [] for v in variants}, {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as root:
        for v in variants:
            c = build_components(parse_settings(_args(v, 10 * rounds, root), 1), get_backend("cpu"))
            c.consumed_samples = 0
            runs[v] = (c, data_iterator(c, c.train_data, 0))
        for _ in range(rounds):
            for v, (c, it) in runs.items():
                t0 = time.perf_counter()
                train_step(c, it)
                steps[v].append(time.perf_counter() - t0)
        for v, (c, _) in runs.items():
            for p in c.optimizer.params:
                p.main_grad.copy_(torch.randn(p.shape, generator=gen))
        for _ in range(2 * rounds):
            for v, (c, _) in runs.items():
                t0 = time.perf_counter()
                c.optimizer.step(1e-4)
                opts[v].append(time.perf_counter() - t0)
    return {v: {"step_ms": statistics.median(steps[v][1:]) * 1e3, "optimizer_step_ms": statistics.median(opts[v]) * 1e3}
            for v in variants}


def report(entries: list[dict]) -> str:
    base = entries[0]
    marks = [i for i in (25, 50, 100, 150, 200, 300, 400) if i <= base["iters"]]
    lines = ["variant | " + " | ".join(f"loss@{i} (mean of 10)" for i in marks) +
             " | validation | median step ms (in its run) | step ms interleaved | optimizer step ms interleaved"]
    for e in entries:
        at = [sum(e["losses"][i - 10:i]) / 10 for i in marks]
        val = e["validation"][-1]["val_loss"] if e["validation"] else float("nan")
        times = [f"{e[k] * scale:.{digits}f} (x{e[k] / base[k]:.2f})"
                 for k, scale, digits in (("median_step_s", 1e3, 0), ("step_ms", 1, 0), ("optimizer_step_ms", 1, 1))]
        lines.append(" | ".join([e["variant"], *(f"{x:.4f}" for x in at), f"{val:.4f}", *times]))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--out", default="benchmarks/results/muon")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    entries = []
    for v in a.variants:
        entries.append(run(v, a.iters))
        print(f"{v}: done, load average {entries[-1]['load_avg']}", flush=True)
    for e, (v, ms) in zip(entries, interleaved_ms(a.variants).items()):
        e.update(ms)
    stem = os.path.join(a.out, f"muon-cpu-{time.strftime('%Y-%m-%d')}")
    text = report(entries)
    print(text)
    for ext, body in ((".json", json.dumps(entries, indent=1)), (".txt", text + "\n")):
        with open(stem + ext, "w") as f:
            f.write(body)

if __name__ == "__main__":
    main()
