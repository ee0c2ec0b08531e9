"""``omnitron plot DIR``: loss and throughput curves from ``DIR/metrics.jsonl`` to PNG files."""
from __future__ import annotations

import argparse
import json
import os
import sys


def register(sub) -> None:
    p = sub.add_parser("plot", help="plot loss and throughput curves of a run (metrics.jsonl) to PNG")
    p.add_argument("run_dir", metavar="DIR", help="a --log-dir / --save directory holding metrics.jsonl")
    p.add_argument("--out", metavar="DIR", help="where the PNGs go (default: DIR)")
    p.set_defaults(func=run)


def read_metrics(path: str) -> tuple[list[dict], list[dict]]:
    """(training records, validation records) from a metrics.jsonl file."""
    train, val = [], []
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                (val if "val_loss" in rec else train).append(rec)
    return train, val


def run(args: argparse.Namespace) -> int:
    path = os.path.join(args.run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        print(f"omnitron plot: error: {path} not found; pass the run's --log-dir (or --save) directory",
              file=sys.stderr)
        return 2
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("omnitron plot: error: matplotlib is not installed; `pip install matplotlib` (or omnitron[dev])",
              file=sys.stderr)
        return 2
    train, val = read_metrics(path)
    out = args.out or args.run_dir
    os.makedirs(out, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["iteration"] for r in train], [r["lm_loss"] for r in train], label="train lm loss")
    if val:
        ax.plot([r["iteration"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    ax.set_xlabel("iteration"), ax.set_ylabel("loss"), ax.legend(), ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss.png"), dpi=120)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["iteration"] for r in train], [r.get("tokens_per_sec") or 0 for r in train])
    ax.set_xlabel("iteration"), ax.set_ylabel("tokens / s"), ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "throughput.png"), dpi=120)
    print(f"wrote {os.path.join(out, 'loss.png')} and {os.path.join(out, 'throughput.png')}")
    return 0
