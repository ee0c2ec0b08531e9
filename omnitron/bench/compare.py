"""``omnitron bench compare A.json B.json ...``: any number of reports, tables (:data:`TABLES`: one per kind, the
comm report's host rows apart, and the kernels once more as run: per case the implementation each machine's engine
runs by default) with each machine's figure and its ratio against the first report's, and PNG
plots (matplotlib) of bus bandwidth against message size (a line per report and group), GEMM TFLOP/s per dtype
and kernel bandwidth as % of the device's copy bandwidth.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

from omnitron.bench.comm import HOST_OPS  # rows of how ranks share a host's cores: no bandwidth, a slowdown
from omnitron.bench.report import ReportError, label, labels, legend, load


@dataclass(frozen=True)
class Table:
    """One table of :func:`tables`: the rows of reports of ``kind`` that ``rows`` keeps, matched across reports
    by the fields ``keys`` (a row lacking one takes ``defaults``' value, the report's ``extra`` its
    ``extra_keys``), each report's ``figure`` (``higher``: True when higher is better) in ``unit``."""

    name: str
    kind: str
    keys: tuple[str, ...]
    figure: str
    higher: bool
    unit: str
    rows: Callable[[dict], bool] = lambda row: True
    defaults: dict = field(default_factory=dict)
    extra_keys: tuple[str, ...] = ()
    pick: Callable[[dict], list[dict]] | None = None
    """The report's rows to show (default: those ``rows`` keeps)."""
    show: str | None = None
    """A row field printed after each figure (the implementation a row timed)."""
    empty: str = "no rows"
    """What the title says of a report of ``kind`` with no row here."""

    def picked(self, rep: dict) -> list[dict]:
        return self.pick(rep) if self.pick is not None else [row for row in rep["rows"] if self.rows(row)]

    def key(self, rep: dict, row: dict) -> tuple:
        """What names ``row`` of ``rep``: rows of two reports with equal keys measured the same problem."""
        return (tuple(row.get(k, self.defaults.get(k)) for k in self.keys)
                + tuple(f"{k} {rep['extra'].get(k)}" for k in self.extra_keys))


def _as_run(rep: dict) -> list[dict]:
    """Per case (op, dtype, mode) of a kernels report, the row of the implementation the engine runs there by
    default: the first of the report's ``resolved`` order (the backend's kernel table) that did not decline the
    case; none where that one failed, and none at all in a report without ``resolved`` (made before reports kept
    it)."""
    order, cases = rep["extra"].get("resolved"), {}
    if not isinstance(order, dict):
        return []
    for row in rep["rows"]:
        cases.setdefault((row["op"], row["dtype"], row["mode"]), {})[row["impl"]] = row
    out = []
    for (op, _, _), rows in cases.items():
        names = order.get(op)
        for name in names if isinstance(names, list) else ():
            row = rows.get(name)
            if row is None or (row["ms"] is None and str(row.get("note", "")).startswith("declined")):
                continue  # not timed here, or it declined the case: the engine tries the next
            if row["ms"] is not None:  # (a first choice that failed: the engine would fail too, no figure)
                out.append(row)
            break
    return out


TABLES = (
    Table("gemm", "gemm", ("dtype", "shape", "m", "n", "k"), "tflops", True, "TFLOP/s"),
    Table("comm", "comm", ("group", "op", "bytes", "ranks"), "busbw_gbs", True, "bus GB/s",
          rows=lambda row: row["op"] not in HOST_OPS, defaults={"group": "world"}),
    Table("comm host", "comm", ("op", "ranks"), "slowdown", False, "all ranks at once / rank 0 alone",
          rows=lambda row: row["op"] in HOST_OPS, empty="no host rows"),
    Table("memory", "memory", ("op", "bytes"), "gbs", True, "GB/s"),
    Table("kernels", "kernels", ("op", "dtype", "mode", "impl"), "ms", False, "ms", extra_keys=("size",)),
    Table("kernels as run", "kernels", ("op", "dtype", "mode"), "ms", False, "ms of the implementation the engine "
          "runs by default on each machine", extra_keys=("size",), pick=_as_run, show="impl",
          empty="no record of the implementations the engine runs (a report older than it)"),
    Table("attention", "attention", ("impl", "dtype", "seq", "heads", "head_dim", "batch", "causal", "dropout"),
          "tflops", True, "TFLOP/s", defaults={"batch": 1, "dropout": 0.0}),
    Table("elementwise", "elementwise", ("op", "mode", "elements", "width", "dtype"), "ms", False, "ms"),
    Table("train", "train", ("model", "layout", "dtype", "global_batch_size", "seq_length", "extra_flags"),
          "tokens_per_s", True, "tokens/s"),
)
"""Every table; a key names the whole problem (sizes, dropout, the group's ranks), so no two rows of one report
share one and rows of two reports are put side by side only where they measured the same thing."""


def load_all(paths: list[str]) -> list[dict]:
    """The reports, each checked; ReportError when one is missing or broken, or when they share no kind."""
    reports = [load(p) for p in paths]
    for rep, path in zip(reports, paths):
        rep["_path"] = path
        names = [k for k in ("backend", "device_name") if not isinstance(rep["machine"].get(k), str)]
        if names:  # what a column is named by (label)
            raise ReportError(f"{path}: the machine has no {names[0]!r} (a report that omnitron bench wrote has)")
    kinds = [r["kind"] for r in reports]
    machines = {label(r) for r in reports}
    if len(machines) > 1 and max(kinds.count(k) for k in kinds) < 2:  # several machines, nothing in common
        kinds = ", ".join(f"{os.path.basename(p)}: {r['kind']}" for p, r in zip(paths, reports))
        raise ReportError(f"nothing to compare: every report is of another kind ({kinds}); give reports of the "
                          "same kind, or whole `omnitron bench all` folders")
    return reports


def tables(reports: list[dict]) -> str:
    """One text table per :data:`TABLES` entry with rows: a row per measurement, per machine its figure and the
    ratio to the first machine's (>1 is better on every table: ratios of lower-is-better figures are inverted)."""
    out, columns, name_of = [], [], _names(reports)
    sources = list(dict.fromkeys(map(_source, reports)))
    for t in TABLES:
        reps = [r for r in reports if r["kind"] == t.kind and t.picked(r)]
        if not reps:
            continue
        names = [name_of[id(r)] for r in reps]
        columns += zip(names, reps)
        rows = [{t.key(r, row): row for row in t.picked(r)} for r in reps]
        why = [f"no row lines up, {w}" for w in [_nothing_lines_up(t, reps, rows)] if w]
        why += _absent(t, sources, reps, reports)
        out.append(f"== {t.name} ({t.unit}; ratio = vs {names[0]}{'' if t.higher else ', inverted: >1 is better'})"
                   + (f": {'; '.join(why)}" if why else ""))
        out.append(" | ".join([" ".join(t.keys + t.extra_keys)] + names))
        for key in dict.fromkeys(k for rs in rows for k in rs):
            base = rows[0].get(key, {}).get(t.figure)
            cells = []
            for rs in rows:
                v = rs.get(key, {}).get(t.figure)
                if v is None:
                    cells.append("-")
                    continue
                ratio = "" if not base or not v else f" ({(v / base if t.higher else base / v):.2f}x)"
                cells.append(f"{v:.4g}{f' {rs[key][t.show]}' if t.show else ''}{ratio}")
            out.append(" | ".join([" ".join(str(k) for k in key)] + cells))
        out.append("")
    return "\n".join(["machines:"] + [f"  {line}" for line in legend(columns)] + [""] + out)


def _source(rep: dict) -> str:
    """Where ``rep`` came from: the folder of its file (a `bench all` folder is one machine's run), else its
    machine's :func:`label`; a table no report of a source is in says so (a folder made before that kind existed
    gave a one-sided table without a word)."""
    return (os.path.dirname(rep["_path"]) or ".") if rep.get("_path") else label(rep)


def _absent(t: Table, sources: list[str], reps: list[dict], reports: list[dict]) -> list[str]:
    """What ``t``'s title says of the sources none of ``reps`` came from: those without a report of its kind, and
    those whose report of it has no row here (``t.empty``)."""
    shown, have = {_source(r) for r in reps}, {_source(r) for r in reports if r["kind"] == t.kind}
    missing = [s for s in sources if s not in shown]
    out = [f"absent in {', '.join(s for s in missing if s not in have)}"] if set(missing) - have else []
    return out + ([f"{t.empty} in {', '.join(s for s in missing if s in have)}"] if set(missing) & have else [])


def _names(reports: list[dict]) -> dict[int, str]:
    """Each report's column name (by ``id``), numbered among the reports of its kind only: folders of `bench all`
    reports give one report per kind and machine, so machine 1 is ``#1`` in every table."""
    out = {}
    for kind in dict.fromkeys(r["kind"] for r in reports):
        same = [r for r in reports if r["kind"] == kind]
        out.update(zip(map(id, same), labels(same)))
    return out


def _nothing_lines_up(t: Table, reps: list[dict], rows: list[dict]) -> str | None:
    """Why no measurement of ``t`` is in two of the reports (None when one is, or with one report): the world
    sizes of comm reports, else each key whose values no two reports share."""
    if len(reps) < 2 or any(sum(key in rs for rs in rows) > 1 for rs in rows for key in rs):
        return None
    worlds = [r["machine"].get("world_size") for r in reps]
    if t.kind == "comm" and len(set(worlds)) > 1:
        return f"the world sizes differ: {', '.join(map(str, worlds))}"
    names = t.keys + t.extra_keys
    differ = []
    for i, name in enumerate(names):
        values = [{key[i] for key in rs} for rs in rows]
        if all(not (a & b) for j, a in enumerate(values) for b in values[j + 1:]):
            shown = ["/".join(sorted(str(v).removeprefix(f"{name} ") for v in vs)) for vs in values]
            differ.append(f"{name} differs: {', '.join(shown)}")
    return "; ".join(differ) or f"no measurement is in two reports (rows match on {' '.join(names)})"


def plots(reports: list[dict], out_dir: str) -> list[str]:
    """PNG files written into ``out_dir`` (the kinds present decide which)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    name_of = _names(reports)
    written = []
    comm = [r for r in reports if r["kind"] == "comm"]
    if comm:
        ops = sorted({row["op"] for r in comm for row in r["rows"] if row["op"] not in HOST_OPS})
        fig, axes = plt.subplots(1, max(len(ops), 1), figsize=(4 * max(len(ops), 1), 3.5), squeeze=False)
        for ax, op in zip(axes[0], ops):
            for r in comm:
                for group in dict.fromkeys(row.get("group", "world") for row in r["rows"] if row["op"] == op):
                    pts = sorted((row["bytes"], row["busbw_gbs"]) for row in r["rows"]
                                 if row["op"] == op and row.get("group", "world") == group)
                    name = name_of[id(r)] + ("" if group == "world" else f" {group}")
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
            ax.set_xscale("log", base=2), ax.set_title(op), ax.set_xlabel("bytes"), ax.set_ylim(bottom=0)
        axes[0][0].set_ylabel("bus bandwidth (GB/s)"), axes[0][0].legend(fontsize=7)
        written.append(_save(fig, out_dir, "comm_busbw.png"))
    gemm = [r for r in reports if r["kind"] == "gemm"]
    if gemm:
        dtypes = list(dict.fromkeys(row["dtype"] for r in gemm for row in r["rows"]))
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / len(gemm)
        for i, r in enumerate(gemm):
            best = [max((row["tflops"] for row in r["rows"] if row["dtype"] == d and row["tflops"] is not None),
                        default=float("nan")) for d in dtypes]  # a dtype the report lacks: no bar, not a zero
            ax.bar([j + i * width for j in range(len(dtypes))], best, width, label=name_of[id(r)])
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(dtypes))], dtypes), ax.set_ylabel("best TFLOP/s")
        ax.legend(fontsize=7)
        written.append(_save(fig, out_dir, "gemm_tflops.png"))
    kernels = [r for r in reports if r["kind"] == "kernels" and r["extra"].get("copy_gbs")]
    if kernels:
        fig, ax = plt.subplots(figsize=(9, 4))
        for r in kernels:
            pts = [(f"{row['op']}/{row['dtype']}/{row['mode']}/{row['impl']}",
                    100 * row["gbs"] / r["extra"]["copy_gbs"])
                   for row in r["rows"] if row.get("gbs") and row["impl"] not in ("eager", "torch", "compile")]
            ax.plot(range(len(pts)), [p[1] for p in pts], "o", label=name_of[id(r)])
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
