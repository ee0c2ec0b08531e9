"""``omnitron bench``: the cross-hardware benchmark suite (``omnitron.bench``). One subcommand per question,
every one writing the same JSON schema (``--json``); ``compare`` reads any number of reports and ``all``
runs the whole suite into a folder."""
from __future__ import annotations

import argparse
import sys

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def _common(p, json_help="write the report (omnitron bench JSON schema) here") -> None:
    p.add_argument("--backend", default=None, help="backend to run on (default: $OMNITRON_BACKEND or auto)")
    p.add_argument("--json", default=None, metavar="OUT", help=json_help)


def _bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().rstrip("ib").rstrip("b")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: GEMM, communication, memory, kernels, attention, training")
    b = p.add_subparsers(dest="bench_command", metavar="WHAT")
    g = b.add_parser("gemm", help="GEMM TFLOP/s per dtype (fp32, tf32, bf16, fp16, FP8 per-tensor/row/block)")
    _common(g)
    g.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096], help="square sizes")
    g.add_argument("--model", default=None, help="also the GEMM shapes of this preset's layer (e.g. gpt_1p3b)")
    g.add_argument("--tokens", type=int, default=4096, help="rows of the model's GEMMs (seq x micro-batch)")
    g.add_argument("--dtypes", nargs="+", default=None,
                   help="subset of fp32 tf32 bf16 fp16 fp8-tensor fp8-row fp8-block")
    g.add_argument("--rounds", type=int, default=10)
    g.set_defaults(func=run_gemm)
    c = b.add_parser("comm", help="collectives and p2p over a size sweep: algorithm and bus bandwidth (nccl-tests)")
    _common(c)
    c.add_argument("--nproc-per-node", type=int, default=2, help="local ranks to spawn (ignored under torchrun)")
    c.add_argument("--min-bytes", type=_bytes, default=1 << 10, help="smallest message (e.g. 1K)")
    c.add_argument("--max-bytes", type=_bytes, default=1 << 26, help="largest message (e.g. 1G)")
    c.add_argument("--factor", type=int, default=4, help="size step")
    c.add_argument("--ops", nargs="+", default=None, help="subset of all_reduce all_gather reduce_scatter "
                   "all_to_all broadcast sendrecv p2p, and host_gemm host_stream (how the ranks share the host's "
                   "cores)")
    c.add_argument("--rounds", "--iters", type=int, default=20, help="timed calls per size, back to back (nccl-tests "
                   "-n; fewer where one call is slow)")
    c.add_argument("--warmup-iters", type=int, default=5, help="untimed calls per size first (nccl-tests -w)")
    c.set_defaults(func=run_comm)
    m = b.add_parser("memory", help="device copy / read / write bandwidth")
    _common(m)
    m.add_argument("--max-bytes", type=_bytes, default=1 << 28)
    m.set_defaults(func=run_memory)
    k = b.add_parser("kernels", help="every implementation of every fused op against torch eager")
    _common(k)
    k.add_argument("--ops", nargs="*", default=None, help="ops to run (default: all)")
    k.add_argument("--dtypes", default=None,
                   help="comma list, e.g. float32,bfloat16 (default: both on CPU, bf16 on a GPU)")
    k.add_argument("--size", choices=("tiny", "small", "large"), default=None,
                   help="problem sizes: tiny (smoke tests), small (default on CPU), large (default on a GPU)")
    k.add_argument("--compile", action="store_true", help="also time torch.compile of the reference (slow to build)")
    k.add_argument("--rounds", type=int, default=15, help="timed rounds per case (median reported)")
    k.add_argument("--budget", type=float, default=5.0, help="seconds per case after which rounds stop (min 3 rounds)")
    k.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    k.set_defaults(func=run_kernels)
    a = b.add_parser("attention", help="the engine's attention vs unfused math, fwd+bwd, by sequence length")
    _common(a)
    a.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096])
    a.add_argument("--heads", type=int, default=8)
    a.add_argument("--head-dim", type=int, default=64)
    a.add_argument("--batch", type=int, default=1, help="sequences per call (a model's micro-batch size)")
    a.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    a.set_defaults(func=run_attention)
    e = b.add_parser("elementwise", help="a layer's element-wise ops (dropout, gelu, norms, softmax, add, adamw), "
                     "fwd and bwd, by element count")
    _common(e)
    e.add_argument("--sizes", type=int, nargs="+", default=[1 << 14, 1 << 17, 1 << 20, 1 << 22], help="elements")
    e.add_argument("--ops", nargs="+", default=None, help="subset of dropout gelu silu_mul layer_norm rms_norm "
                   "softmax add cross_entropy adamw")
    e.add_argument("--width", type=int, default=256, help="row width of the norms, softmax and cross-entropy")
    e.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    e.set_defaults(func=run_elementwise)
    t = b.add_parser("train", help="a few iterations of a preset under a layout: tokens/s, TFLOP/s, MFU, split",
                     epilog="flags after -- go to omnitron train (e.g. -- --mock-data --bf16)")
    _common(t)
    t.add_argument("--model", default="gpt2_tiny", help="a preset of omnitron train --model")
    t.add_argument("--layout", default="single", help="e.g. tp2,pp2,dp2 (world = the product)")
    t.add_argument("--iterations", type=int, default=6)
    t.add_argument("train_flags", nargs=argparse.REMAINDER)
    t.set_defaults(func=run_train)
    cmp = b.add_parser("compare", help="tables with ratios and PNG plots from any number of reports")
    cmp.add_argument("reports", nargs="+", help="report files, or `bench all` folders")
    cmp.add_argument("--plots", default=None, metavar="DIR", help="write PNG plots here")
    cmp.set_defaults(func=run_compare)
    cal = b.add_parser("calibrate", help="measured over a device profile's datasheet figures and curves (GEMM, "
                       "memory, intra-node collectives) from reports of this machine")
    cal.add_argument("reports", nargs="+", help="report files, or a `bench all` folder, measured on this machine")
    cal.add_argument("--device", required=True, metavar="PROFILE", help="its device profile (e.g. h200, or a .toml)")
    cal.add_argument("--gpus-per-node", type=int, default=None, help="devices per node (default: the profile's)")
    cal.add_argument("--json", default=None, metavar="OUT", help="write the rows and the summary here")
    cal.set_defaults(func=run_calibrate)
    al = b.add_parser("all", help="the whole suite, one report per kind, into --out DIR")
    al.add_argument("--backend", default=None)
    al.add_argument("--out", required=True, metavar="DIR")
    al.add_argument("--nproc-per-node", type=int, default=None, help="ranks for the comm sweep")
    al.set_defaults(func=run_all)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def _backend(name):
    from omnitron.backends.registry import get_backend

    return get_backend(name)


def _write(kind: str, backend, rows, args, **extra) -> int:
    from omnitron.bench.report import new_report, save

    rep = new_report(kind, backend, rows, **extra)
    if getattr(args, "json", None):
        print(f"wrote {save(rep, args.json)}")
    return 0


def run_gemm(args) -> int:
    from omnitron.bench import gemm

    be = _backend(args.backend)
    dtypes = args.dtypes or list(gemm.DTYPES)
    unknown = [d for d in dtypes if d not in gemm.DTYPES]
    if unknown:
        print(f"omnitron bench gemm: error: unknown dtype {unknown[0]}; use {' '.join(gemm.DTYPES)}", file=sys.stderr)
        return 2
    return _write("gemm", be, gemm.run(be, sizes=args.sizes, dtypes=dtypes, model=args.model, tokens=args.tokens,
                                        rounds=args.rounds), args)


def _ops(what: str, given, known) -> list[str] | None:
    """``given`` (default: all of ``known``), or None after a one-line error naming the choices."""
    ops = given or list(known)
    if any(o not in known for o in ops):
        print(f"omnitron bench {what}: error: ops are {' '.join(known)}", file=sys.stderr)
        return None
    return ops


def run_comm(args) -> int:
    import os

    from omnitron.bench import comm

    ops = _ops("comm", args.ops, comm.OPS + comm.HOST_OPS)
    if ops is None:
        return 2
    be = _backend(args.backend)
    rows = comm.run(be.name, nproc=args.nproc_per_node, ops=ops, byte_sizes=comm.sizes(args.min_bytes, args.max_bytes,
                                                                                      args.factor), rounds=args.rounds,
                     warmup=args.warmup_iters)
    for r in rows:
        where = f" {r['group']:5s}" if "group" in r else ""
        print(f"{r['op']:15s}{where} {r['bytes']:>12d} B x{r['ranks']}: {r['ms']:9.3f} ms  algbw {r['algbw_gbs']:8.3f} "
              f"busbw {r['busbw_gbs']:8.3f} GB/s")
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    return _write("comm", be, rows, args, world_size=rows[0]["ranks"] if rows else args.nproc_per_node)


def run_memory(args) -> int:
    from omnitron.bench import comm, memory

    be = _backend(args.backend)
    return _write("memory", be, memory.run(be, byte_sizes=comm.sizes(1 << 16, args.max_bytes, 16)), args)


def run_kernels(args: argparse.Namespace) -> int:
    import torch

    from omnitron.kernels.benchmark import run

    backend = _backend(args.backend)
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
    return _write("kernels", backend, report["rows"], args, copy_gbs=report["copy_gbs"], size=size,
                  resolved=report["resolved"])


def run_elementwise(args) -> int:
    import torch

    from omnitron.bench import elementwise

    ops = _ops("elementwise", args.ops, elementwise.OPS)
    if ops is None:
        return 2
    be = _backend(args.backend)
    return _write("elementwise", be, elementwise.run(be, sizes=args.sizes, ops=ops, width=args.width,
                                                      dtype=getattr(torch, DTYPES[args.dtype])), args)


def run_attention(args) -> int:
    import torch

    from omnitron.bench import attention

    be = _backend(args.backend)
    dtype = getattr(torch, DTYPES[args.dtype])
    return _write("attention", be, attention.run(be, seqs=args.seqs, heads=args.heads, head_dim=args.head_dim,
                                                  batch=args.batch, dtype=dtype), args)


def run_train(args) -> int:
    from omnitron.bench import train

    flags = [f for f in args.train_flags if f != "--"]
    be = _backend(args.backend)
    try:
        row = train.run(model=args.model, layout=args.layout, iterations=args.iterations, extra=flags,
                        backend=be.name)
    except (ValueError, RuntimeError) as err:
        print(f"omnitron bench train: error: {err}", file=sys.stderr)
        return 2
    print("  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    return _write("train", be, [row], args)


def _report_paths(items: list[str]) -> list[str]:
    import glob
    import os

    out = []
    for item in items:
        out += sorted(glob.glob(os.path.join(item, "*.json"))) if os.path.isdir(item) else [item]
    return out


def run_compare(args) -> int:
    from omnitron.bench import compare
    from omnitron.bench.report import ReportError

    try:
        reports = compare.load_all(_report_paths(args.reports))
    except ReportError as err:
        print(f"omnitron bench compare: error: {err}", file=sys.stderr)
        return 2
    print(compare.tables(reports))
    if args.plots:
        try:
            for path in compare.plots(reports, args.plots):
                print(f"wrote {path}")
        except ImportError:
            print("omnitron bench compare: error: --plots needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 2
    return 0


def run_calibrate(args) -> int:
    from omnitron.plan import calibrate
    from omnitron.bench.report import ReportError, load
    from omnitron.core.config.parallel import ConfigError
    from omnitron.plan.profile import load as load_profile

    try:
        profile = load_profile(args.device)
        reports = [load(p) for p in _report_paths(args.reports)]
        cpu = [r["machine"].get("device_type") for r in reports if r["machine"].get("device_type") == "cpu"]
        if cpu:
            raise ConfigError(f"{len(cpu)} report(s) were measured on a cpu; calibrate an accelerator's reports "
                              f"against its profile ({args.device})")
        result = calibrate.calibrate(profile, reports, args.gpus_per_node)
        if not result["rows"]:
            raise ConfigError("no gemm, memory or intra-node collective rows in the reports given")
    except (ReportError, ConfigError) as err:
        print(f"omnitron bench calibrate: error: {err}", file=sys.stderr)
        return 2
    print(calibrate.format_calibration(result))
    if args.json:
        calibrate.write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0


def run_all(args) -> int:
    from omnitron.bench.suite import KINDS, run_all as suite

    be = _backend(args.backend)
    written = suite(be, args.out, nproc=args.nproc_per_node)
    failed = [k for k in KINDS if k not in written]
    print(f"wrote {len(written)} reports into {args.out}: {', '.join(sorted(written))}"
          + (f"; failed: {', '.join(failed)} (the reasons above)" if failed else ""))
    return 1 if failed else 0  # a folder short of a kind is not the suite: `bench all && bench compare` stops
