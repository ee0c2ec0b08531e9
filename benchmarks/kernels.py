"""Kernel benchmark for BENCHMARKS.md: runs ``omnitron bench kernels`` on this machine's backend,
writes the JSON report, and prints a markdown table (speed-up vs torch eager and vs torch's own
fused op, bandwidth as % of the device copy bandwidth measured in the same run).

    python benchmarks/kernels.py [--backend cpu] [--json kernels-cpu.json] [--compile] [--ops ...]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omnitron.cli import main as cli_main  # noqa: E402


def markdown(report: dict) -> str:
    """Markdown table of a report: one line per (op, dtype, mode, impl)."""
    copy = report["extra"]["copy_gbs"]
    m = report["machine"]
    out = [f"Backend `{m['backend']}` ({m['device_name']}, {m['processor']}, {m['threads']} threads, torch "
           f"{m['torch']}); "
           f"device copy bandwidth {copy:.1f} GB/s.", "",
           "| op | dtype | mode | impl | median ms | min ms | GB/s | % copy BW | peak MiB | vs eager | vs torch |",
           "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    native = {(r["op"], r["dtype"], r["mode"]): r["ms"] for r in report["rows"] if r["impl"] == "torch" and r["ms"]}
    for r in report["rows"]:
        if r["ms"] is None:
            out.append(f"| {r['op']} | {r['dtype']} | {r['mode']} | {r['impl']} | {r['note']} | | | | | | |")
            continue
        nat = native.get((r["op"], r["dtype"], r["mode"]))
        vs_torch = f"{nat / r['ms']:.2f}x" if nat else "-"
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.1f}"
        out.append(f"| {r['op']} | {r['dtype']} | {r['mode']} | {r['impl']} | {r['ms']:.2f} | {r['min_ms']:.2f} | "
                   f"{r['gbs']:.2f} | "
                   f"{100 * r['gbs'] / copy:.0f}% | {peak} | {r['speedup']:.2f}x | {vs_torch} |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default=None)
    p.add_argument("--json", default="kernels.json")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--ops", nargs="*", default=None)
    p.add_argument("--size", default=None)
    p.add_argument("--rounds", default="15")
    p.add_argument("--threads", default=None)
    p.add_argument("--budget", default="5")
    args = p.parse_args()
    argv = ["bench", "kernels", "--json", args.json, "--rounds", args.rounds, "--budget", args.budget]
    argv += ["--backend", args.backend] if args.backend else []
    argv += ["--compile"] if args.compile else []
    argv += ["--size", args.size] if args.size else []
    argv += ["--threads", args.threads] if args.threads else []
    argv += ["--ops", *args.ops] if args.ops else []
    rc = cli_main(argv)
    with open(args.json) as f:
        print("\n" + markdown(json.load(f)))
    return rc


if __name__ == "__main__":
    sys.exit(main())
