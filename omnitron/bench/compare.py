"""``omnitron bench compare A.json B.json ...``: any number of reports, a table per kind with each machine's
figure and its ratio against the first report's, and PNG plots (matplotlib) of bus bandwidth against
message size, GEMM TFLOP/s per dtype and kernel bandwidth as % of the device's copy bandwidth.
"""
from __future__ import annotations

import os

from omnitron.bench.report import ReportError, label, load

# kind: (fields that name a measurement, the figure, True when higher is better, unit)
KEYS = {
    "gemm": (("dtype", "shape"), "tflops", True, "TFLOP/s"),
    "comm": (("op", "bytes", "ranks"), "busbw_gbs", True, "bus GB/s"),
    "memory": (("op", "bytes"), "gbs", True, "GB/s"),
    "kernels": (("op", "dtype", "mode", "impl"), "ms", False, "ms"),
    "attention": (("impl", "dtype", "seq", "causal"), "tflops", True, "TFLOP/s"),
    "train": (("model", "layout", "dtype"), "tokens_per_s", True, "tokens/s"),
}


def load_all(paths: list[str]) -> list[dict]:
    """The reports, each checked; ReportError when one is missing or broken, or when they share no kind."""
    reports = [load(p) for p in paths]
    for rep, path in zip(reports, paths):
        rep["_path"] = path
    kinds = [r["kind"] for r in reports]
    machines = {label(r) for r in reports}
    if len(machines) > 1 and max(kinds.count(k) for k in kinds) < 2:  # several machines, nothing in common
        kinds = ", ".join(f"{os.path.basename(p)}: {r['kind']}" for p, r in zip(paths, reports))
        raise ReportError(f"nothing to compare: every report is of another kind ({kinds}); give reports of the "
                          "same kind, or whole `omnitron bench all` folders")
    return reports


def tables(reports: list[dict]) -> str:
    """One text table per kind: a row per measurement, per machine its figure and the ratio to the first
    machine's (>1 is better on every kind: time ratios are inverted)."""
    out = []
    for kind, (keys, figure, higher, unit) in KEYS.items():
        reps = [r for r in reports if r["kind"] == kind]
        if not reps:
            continue
        names = [label(r) for r in reps]
        out.append(f"== {kind} ({unit}; ratio = vs {names[0]}{'' if higher else ', inverted: >1 is faster'})")
        out.append(" | ".join(["measurement"] + [f"{n}" for n in names]))
        rows = [{tuple(row[k] for k in keys): row for row in r["rows"]} for r in reps]
        order = list(dict.fromkeys(k for rs in rows for k in rs))
        for key in order:
            base = rows[0].get(key, {}).get(figure)
            cells = []
            for rs in rows:
                v = rs.get(key, {}).get(figure)
                if v is None:
                    cells.append("-")
                    continue
                ratio = "" if not base else f" ({(v / base if higher else base / v):.2f}x)"
                cells.append(f"{v:.4g}{ratio}")
            out.append(" | ".join([" ".join(str(k) for k in key)] + cells))
        out.append("")
    return "\n".join(out)


def plots(reports: list[dict], out_dir: str) -> list[str]:
    """PNG files written into ``out_dir`` (the kinds present decide which)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    written = []
    comm = [r for r in reports if r["kind"] == "comm"]
    if comm:
        ops = sorted({row["op"] for r in comm for row in r["rows"]})
        fig, axes = plt.subplots(1, len(ops), figsize=(4 * len(ops), 3.5), squeeze=False)
        for ax, op in zip(axes[0], ops):
            for r in comm:
                pts = sorted((row["bytes"], row["busbw_gbs"]) for row in r["rows"] if row["op"] == op)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label(r))
            ax.set_xscale("log", base=2), ax.set_title(op), ax.set_xlabel("bytes"), ax.set_ylim(bottom=0)
        axes[0][0].set_ylabel("bus bandwidth (GB/s)"), axes[0][0].legend(fontsize=7)
        written.append(_save(fig, out_dir, "comm_busbw.png"))
    gemm = [r for r in reports if r["kind"] == "gemm"]
    if gemm:
        dtypes = list(dict.fromkeys(row["dtype"] for r in gemm for row in r["rows"]))
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / len(gemm)
        for i, r in enumerate(gemm):
            best = [max((row["tflops"] for row in r["rows"] if row["dtype"] == d), default=0) for d in dtypes]
            ax.bar([j + i * width for j in range(len(dtypes))], best, width, label=label(r))
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(dtypes))], dtypes), ax.set_ylabel("best TFLOP/s")
        ax.legend(fontsize=7)
        written.append(_save(fig, out_dir, "gemm_tflops.png"))
    kernels = [r for r in reports if r["kind"] == "kernels" and r["extra"].get("copy_gbs")]
    if kernels:
        fig, ax = plt.subplots(figsize=(9, 4))
        for r in kernels:
            pts = [(f"{row['op']}/{row['dtype']}/{row['mode']}/{row['impl']}", 100 * row["gbs"] / r["extra"]["copy_gbs"])
                   for row in r["rows"] if row.get("gbs") and row["impl"] not in ("eager", "torch", "compile")]
            ax.plot(range(len(pts)), [p[1] for p in pts], "o", label=label(r))
        ax.set_ylabel("% of copy bandwidth"), ax.set_xlabel("kernel (op/dtype/mode/impl, in report order)")
        ax.set_ylim(bottom=0), ax.legend(fontsize=7)
        written.append(_save(fig, out_dir, "kernels_pct_copy.png"))
    plt.close("all")
    return written


def _save(fig, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
