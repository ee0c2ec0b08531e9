"""``omnitron bench``: ``kernels`` times every fused-op implementation against torch eager;
``compare A.json B.json`` prints two benchmark reports (two machines) side by side."""
from __future__ import annotations

import argparse
import json

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: fused kernels, report comparison")
    bsub = p.add_subparsers(dest="bench_command", metavar="WHAT")
    k = bsub.add_parser("kernels", help="time every implementation of every fused op against torch eager")
    k.add_argument("--backend", default=None, help="backend to run on (default: $OMNITRON_BACKEND or auto)")
    k.add_argument("--ops", nargs="*", default=None, help="ops to run (default: all)")
    k.add_argument("--dtypes", default=None, help="comma list, e.g. float32,bfloat16 (default: both on CPU, bf16 on a GPU)")
    k.add_argument("--size", choices=("tiny", "small", "large"), default=None,
                   help="problem sizes: tiny (smoke tests), small (default on CPU), large (default on a GPU)")
    k.add_argument("--compile", action="store_true", help="also time torch.compile of the reference (slow to build)")
    k.add_argument("--rounds", type=int, default=15, help="timed rounds per case (median reported)")
    k.add_argument("--budget", type=float, default=5.0, help="seconds per case after which rounds stop (min 3 rounds)")
    k.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    k.add_argument("--json", default=None, metavar="OUT", help="write the report as JSON")
    k.set_defaults(func=run_kernels)
    c = bsub.add_parser("compare", help="print two JSON reports side by side")
    c.add_argument("a")
    c.add_argument("b")
    c.set_defaults(func=run_compare)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def run_kernels(args: argparse.Namespace) -> int:
    import torch

    from omnitron.backends.registry import get_backend
    from omnitron.kernels.benchmark import run

    backend = get_backend(args.backend)
    if args.threads:
        torch.set_num_threads(args.threads)
    on_cpu = backend.device_type == "cpu"
    names = (args.dtypes or ("float32,bfloat16" if on_cpu else "bfloat16")).split(",")
    try:
        dtypes = [getattr(torch, DTYPES[n.strip()]) for n in names]
    except KeyError as err:
        raise SystemExit(f"--dtypes: unknown dtype {err}; use {sorted(set(DTYPES))}") from None
    size = args.size or ("small" if on_cpu else "large")
    report = run(backend, ops=args.ops, dtypes=dtypes, size=size, compile_=args.compile, rounds=args.rounds,
                 budget_s=args.budget)
    print(f"\ncopy bandwidth: {report['copy_gbs']:.1f} GB/s on {report['machine']['device']} "
          f"({report['machine']['threads']} threads, torch {report['machine']['torch']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def run_compare(args: argparse.Namespace) -> int:
    reports = []
    for path in (args.a, args.b):
        with open(path) as f:
            reports.append(json.load(f))
    a, b = ({(r["op"], r["dtype"], r["mode"], r["impl"]): r for r in rep["rows"]} for rep in reports)
    for name, rep in zip("AB", reports):
        m = rep["machine"]
        print(f"{name}: {m['backend']} {m['device']} {m['processor']} torch {m['torch']}, copy {rep['copy_gbs']:.1f} GB/s")

    def f(row, key, spec):
        return "-" if row is None or row.get(key) is None else format(row[key], spec)

    print(f"{'op':26s} {'dtype':9s} {'mode':8s} {'impl':8s} {'A ms':>9s} {'B ms':>9s} {'A GB/s':>7s} {'B GB/s':>7s} "
          f"{'A %copy':>7s} {'B %copy':>7s} {'A/B':>6s}")
    for key in list(a) + [k for k in b if k not in a]:
        ra, rb = a.get(key), b.get(key)
        pa = f"{100 * ra['gbs'] / reports[0]['copy_gbs']:.0f}%" if ra and ra.get("gbs") else "-"
        pb = f"{100 * rb['gbs'] / reports[1]['copy_gbs']:.0f}%" if rb and rb.get("gbs") else "-"
        ratio = f"{ra['ms'] / rb['ms']:.2f}" if ra and rb and ra.get("ms") and rb.get("ms") else "-"
        print(f"{key[0]:26s} {key[1]:9s} {key[2]:8s} {key[3]:8s} {f(ra, 'ms', '9.3f')} {f(rb, 'ms', '9.3f')} "
              f"{f(ra, 'gbs', '7.1f')} {f(rb, 'gbs', '7.1f')} {pa:>7s} {pb:>7s} {ratio:>6s}")
    return 0
