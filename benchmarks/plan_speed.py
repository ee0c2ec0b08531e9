"""Predicted (``omnitron plan --bench``) against measured step time of small layouts of the tiny GPT on this CPU.

1. a CPU bench report sized for ~1 minute (``omnitron bench gemm``, ``attention`` and ``elementwise`` at 1
   thread, ``comm`` at 2 and 4 ranks), written to ``OUT/report/``;
2. every layout of :data:`LAYOUTS` trained for a few steps through ``omnitron train`` (mock data, one intra-op
   thread a rank: world 1 as well, so no layout runs OpenMP threads that spin against the machine's other
   jobs), the median step time of the steps after the first (``omnitron.bench.train.run``), in ``--passes``
   passes over all layouts; a layout's fastest pass counts (on a shared machine, others' work only slows a run:
   one layout's passes differed by up to 35% on 2026-12-02);
3. the speed model's prediction for each layout from that report, the error, and the predicted best against
   the measured best.

    PYTHONPATH=. python benchmarks/plan_speed.py [--out benchmarks/results/plan_speed] [--skip-report]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MODEL = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "4096", "--num-workers", "0",
         "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "4",
         "--global-batch-size", "16", "--threads-per-process", "1"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
LAYOUTS = {  # name: (layout, extra flags)
    "single": ("", []),
    "tp2": ("tp2", []),
    "dp2": ("dp2", []),
    "pp2": ("pp2", []),
    "cp2": ("cp2", []),
    "dp2 distopt": ("dp2", ["--use-distributed-optimizer"]),
    "single recompute": ("", ["--recompute-granularity", "full", "--recompute-method", "uniform"]),
    "pp2 mbs2": ("pp2", ["--micro-batch-size", "2"]),
    "tp2 sp": ("tp2", ["--sequence-parallel"]),
    "dp4": ("dp4", []),
    "tp2 pp2": ("tp2,pp2", []),
    "tp2 dp2": ("tp2,dp2", []),
    "moe dp2": ("dp2", MOE),
    "moe ep2": ("dp2,ep2", MOE),
    "moe tp2": ("tp2", MOE),
}
ITERATIONS = 5


def _omnitron(args: list[str], env: dict | None = None) -> None:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "omnitron", *args], check=True, env={**os.environ, **(env or {})},
                   stdout=subprocess.DEVNULL)
    print(f"  omnitron {' '.join(args)}: {time.perf_counter() - t0:.0f} s", flush=True)


def make_report(out: str) -> None:
    """The CPU bench report the predictions read (sizes around the tiny model's GEMMs and messages)."""
    os.makedirs(out, exist_ok=True)
    for t in (1,):  # every run below uses 1 thread a rank (--threads-per-process 1)
        one = {"OMP_NUM_THREADS": str(t)}
        _omnitron(["bench", "gemm", "--dtypes", "fp32", "--sizes", "64", "128", "256", "512", "1024",
                   "--model", "gpt2_tiny", "--tokens", "1024", "--rounds", "10",
                   "--json", f"{out}/gemm-t{t}.json"], one)
        _omnitron(["bench", "attention", "--dtype", "fp32", "--seqs", "128", "256", "512", "--heads", "4",
                   "--head-dim", "32", "--batch", "4", "--json", f"{out}/attention-t{t}.json"], one)
        _omnitron(["bench", "elementwise", "--sizes", "16384", "262144", "1048576", "4194304",
                   "--json", f"{out}/elementwise-t{t}.json"], one)
    for n in (2, 4):
        _omnitron(["bench", "comm", "--nproc-per-node", str(n), "--ops", "all_reduce", "all_gather", "reduce_scatter",
                   "all_to_all", "p2p", "host_gemm", "host_stream", "--min-bytes", "1K", "--max-bytes", "16M",
                   "--rounds", "5",
                   "--json", f"{out}/comm-{n}.json"])


def settings_for(layout: str, extra: list[str]):
    from omnitron.bench.train import parse_layout
    from omnitron.core.training.arguments import parse_settings

    dims, world = parse_layout(layout)
    flags = ["--model", "gpt2_tiny", *MODEL, *extra]
    named = (("tp", "--tensor-model-parallel-size"), ("pp", "--pipeline-model-parallel-size"),
             ("cp", "--context-parallel-size"), ("ep", "--expert-model-parallel-size"))
    flags += [f for key, flag in named if dims[key] > 1 for f in (flag, str(dims[key]))]
    return parse_settings(flags, world)


def measure(name: str, layout: str, extra: list[str]) -> dict:
    from omnitron.bench.train import run

    row = run(model="gpt2_tiny", layout=layout, iterations=ITERATIONS, extra=MODEL + extra, backend="cpu")
    row["name"] = name
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/plan_speed")
    ap.add_argument("--skip-report", action="store_true", help="reuse OUT/report")
    ap.add_argument("--only", nargs="*", default=None, help="layout names to run")
    ap.add_argument("--passes", type=int, default=2, help="measure every layout this many times, one pass over all "
                    "layouts after another; each layout's fastest pass counts (others' work only ever slows a run)")
    args = ap.parse_args()
    from omnitron.plan.rates import Rates
    from omnitron.plan.speed import predict

    t0 = time.perf_counter()
    report = os.path.join(args.out, "report")
    if not args.skip_report:
        make_report(report)
    print(f"load average before the runs: {os.getloadavg()[0]:.2f}", flush=True)
    names = [n for n in LAYOUTS if not args.only or n in args.only]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for p in range(args.passes):
        for name in names:
            layout, extra = LAYOUTS[name]
            before = os.getloadavg()[0]
            row = measure(name, layout, extra)
            row.update(load_before=before, load=os.getloadavg()[0], measured_pass=p + 1)
            runs[name].append(row)
            print(f"  pass {p + 1} {name:18s} {row['step_ms']:8.1f} ms  load {before:.1f}-{row['load']:.1f}",
                  flush=True)
    rows = []
    for name in names:
        rates = Rates.from_reports([report])
        pred = predict(settings_for(*LAYOUTS[name]), rates)
        row = min(runs[name], key=lambda r: r["step_ms"])
        row.update(predicted_ms=pred.total * 1e3, breakdown_ms={k: v * 1e3 for k, v in pred.breakdown().items()},
                   notes=pred.notes, passes_ms=[r["step_ms"] for r in runs[name]])
        rows.append(row)
        print(f"{name:18s} measured {row['step_ms']:8.1f} ms (passes {' '.join(f'{v:.0f}' for v in row['passes_ms'])}) "
              f"predicted {row['predicted_ms']:8.1f} ms error "
              f"{100 * (row['predicted_ms'] / row['step_ms'] - 1):+6.1f}%  "
              + " ".join(f"{k} {v:.0f}" for k, v in row["breakdown_ms"].items()), flush=True)
    summarize(rows)
    with open(os.path.join(args.out, "rows.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"total {time.perf_counter() - t0:.0f} s, load average {os.getloadavg()[0]:.2f}")


def summarize(rows: list[dict]) -> None:
    """Worst error, the share within 25%, and the predicted best against the measured best (tokens/s)."""
    if not rows:
        return
    errs = [abs(r["predicted_ms"] / r["step_ms"] - 1) for r in rows]
    best_m = min(rows, key=lambda r: r["step_ms"])
    best_p = min(rows, key=lambda r: r["predicted_ms"])
    gap = best_p["step_ms"] / best_m["step_ms"] - 1
    print(f"within 25%: {sum(e <= 0.25 for e in errs)}/{len(rows)}; worst |error| {100 * max(errs):.1f}%; "
          f"median |error| {100 * sorted(errs)[len(errs) // 2]:.1f}%")
    print(f"predicted best: {best_p['name']} (measured {best_p['step_ms']:.1f} ms); measured best: {best_m['name']} "
          f"({best_m['step_ms']:.1f} ms); the predicted best is {100 * gap:.1f}% slower than the measured best")


if __name__ == "__main__":
    main()
