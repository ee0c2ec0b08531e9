"""``omnitron plot DIR``: loss and throughput curves from ``DIR/metrics.jsonl`` to PNG files."""
from __future__ import annotations

import argparse
import math
import os
import sys


def register(sub) -> None:
    p = sub.add_parser("plot", help="plot loss and throughput curves of a run (metrics.jsonl) to PNG")
    p.add_argument("run_dir", metavar="DIR", help="a --log-dir / --save directory holding metrics.jsonl")
    p.add_argument("--out", metavar="DIR", help="where the PNGs go (default: DIR)")
    p.set_defaults(func=run)


def read_metrics(path: str) -> tuple[list[dict], list[dict]]:
    """(training records, validation records) from a metrics.jsonl file: a last line cut short (a run being
    written, or killed while writing) is dropped with a warning, a bad line before it is a ValueError naming it
    (as a resumed run reads the file: :func:`omnitron.core.training.metrics.read_records`)."""
    from omnitron.core.training.metrics import read_records

    train, val = [], []
    for _, rec in read_records(path):
        if "val_loss" in rec or "lm_loss" in rec:  # (the test evaluation's record is neither)
            (val if "val_loss" in rec else train).append(rec)
    return train, val


def run(args: argparse.Namespace) -> int:
    path = os.path.join(args.run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        print(f"omnitron plot: error: {path} not found; pass the run's --log-dir (or --save) directory",
              file=sys.stderr)
        return 2
    # the file first: a bad one is named whether or not matplotlib is installed (it needs no plotting)
    try:
        train, val = read_metrics(path)
    except ValueError as err:  # a bad line before the last: named, with the fix
        print(f"omnitron plot: error: {err}", file=sys.stderr)
        return 2
    if not train:
        print(f"omnitron plot: error: {path} holds no training record yet; plot after the first log line",
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
    out = args.out or args.run_dir
    os.makedirs(out, exist_ok=True)
    title = os.path.basename(os.path.abspath(args.run_dir))
    _training_panels(plt, train, val, title).savefig(os.path.join(out, "loss.png"), dpi=120)
    _throughput(plt, train, title).savefig(os.path.join(out, "throughput.png"), dpi=120)
    print(f"wrote {os.path.join(out, 'loss.png')} and {os.path.join(out, 'throughput.png')}")
    return 0


def _training_panels(plt, train: list[dict], val: list[dict], title: str):
    """Loss (training and validation), learning rate and gradient norm against the iteration, one above the
    other on a shared x-axis."""
    fig, (loss, lr, norm) = plt.subplots(3, 1, figsize=(7, 8), sharex=True,
                                         gridspec_kw={"height_ratios": [2, 1, 1]})
    its = [r["iteration"] for r in train]
    loss.plot(its, [math.nan if r["lm_loss"] is None else r["lm_loss"] for r in train],  # None: all skipped
              label="train lm loss")
    if val:
        loss.plot([r["iteration"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    loss.set_ylabel("loss"), loss.legend(), loss.set_title(f"{title}: training")
    lr.plot(its, [r.get("lr") for r in train], color="tab:green")
    lr.set_ylabel("learning rate"), lr.set_ylim(bottom=0)
    kept = [(i, r["grad_norm"]) for i, r in zip(its, train) if r.get("grad_norm") is not None]  # skipped steps: None
    norm.plot([i for i, _ in kept], [g for _, g in kept], color="tab:red")
    norm.set_ylabel("grad norm"), norm.set_xlabel("iteration"), norm.set_ylim(bottom=0)
    for ax in (loss, lr, norm):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _throughput(plt, train: list[dict], title: str):
    """Tokens per second from 0 (a noisy machine's dips look like what they are, not like collapses)."""
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["iteration"] for r in train], [r.get("tokens_per_sec") or 0 for r in train])
    ax.set_xlabel("iteration"), ax.set_ylabel("tokens / s"), ax.set_ylim(bottom=0), ax.grid(alpha=0.3)
    ax.set_title(f"{title}: throughput")
    fig.tight_layout()
    return fig
