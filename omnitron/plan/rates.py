"""Measured rates the speed model reads: GEMM and attention TFLOP/s, collective times, from ``omnitron bench``
reports (:mod:`omnitron.bench.report`) of the target machine.

Interpolation. A GEMM's rate is interpolated in log-log space over the report's rows of its dtype by the
GEMM's FLOPs (``2 m n k``); an attention call's by its FLOPs over the rows of the implementation the model
takes (``math`` where attention dropout is on: the engine then materialises the scores; the kernel table's
``op:`` otherwise). A collective's time at ``S`` bytes is interpolated linearly between the two measured sizes
around ``S`` of the same op and rank count (the small sizes carry the latency), and scaled linearly by
size beyond the largest row. Out of range of the rows, rates are clamped to the nearest row. Every fallback
(no row of a dtype, no row of a rank count) is recorded in :attr:`Rates.notes` and printed with the plan.

Shared cores. On a CPU report the collectives' times are scaled by ``max(1, P / cores) / max(1, n / cores)``,
``P`` the threads of all the layout's ranks on the host (:attr:`Rates.host_ranks`) and ``n`` the processes
of the measurement (its rank count).

Threads. CPU reports record the intra-op threads they ran with (``machine.threads``); the GEMM and attention
rows of the report whose thread count equals the rank's are used (several reports may be given), else the
nearest, scaled linearly by the thread ratio (noted).
"""
from __future__ import annotations

import bisect
import math
import os
from dataclasses import dataclass, field

from omnitron.bench.report import ReportError, load
from omnitron.core.config.parallel import ConfigError


def report_paths(items: list[str]) -> list[str]:
    """Report files from files and ``bench all`` folders (their ``*.json``)."""
    out = []
    for item in items:
        if os.path.isdir(item):
            out += sorted(os.path.join(item, f) for f in os.listdir(item) if f.endswith(".json"))
        else:
            out.append(item)
    return out


def _loglog(points: list[tuple[float, float]], x: float) -> float:
    """y at x, interpolated in log-log space over sorted (x, y) points; clamped at the ends."""
    logs = [(math.log(px), math.log(py)) for px, py in points]
    return math.exp(_interp(logs, math.log(x), clamp=True))


def _points(rows, flops_of) -> list[tuple[float, float]]:
    """Sorted (flops, tflops) of rows; rows of one flop count averaged in log space."""
    by: dict[float, list[float]] = {}
    for r in rows:
        if r.get("tflops"):
            by.setdefault(flops_of(r), []).append(math.log(r["tflops"]))
    return sorted((x, math.exp(sum(v) / len(v))) for x, v in by.items())


_STAND_IN = {"moe_dispatch": ("add", 3), "fp8_amax": ("add", 1 / 3), "fp8_cast": ("add", 2 / 3),
             "fp8_cast_block": ("add", (3 + 4 / 128) / 6), "copy": ("add", 2 / 3)}
"""Ops a report has no rows of (moe_dispatch: older reports; copy: one read and one write, a reorder; the FP8
quantization's kernels, not measured by the bench: their bytes from a 2-byte source,
:func:`omnitron.plan.fp8.op_bytes`, over an add's 6), priced as passes of another op: (op, passes)."""
CAST_TRANSPOSE = "fp8_cast_transpose_amax"
"""The kernels report's op timing the per-tensor cast-transpose (bf16 read, the FP8 operand and its transpose
written: the bytes :data:`omnitron.plan.fp8.CAST` prices)."""


def cast_transpose_rate(report: dict) -> dict | None:
    """The cast-transpose's measured rate over the same run's copy bandwidth, from an ``omnitron bench kernels``
    report: its :data:`CAST_TRANSPOSE` rows of the ``compile`` implementation (inductor's lowering of the
    reference: what a compiled layer runs, and the speed model prices compiled layers, :mod:`omnitron.plan.fp8`),
    bf16 rows where there are any; None without such a row or without the report's ``copy_gbs``. The hand-written
    kernel's rows (``triton``: the eager path's) are not taken: on the H200 (0.208 of copy) they priced the 1.3B
    FP8 step 0.91x bf16 against 1.09x measured compiled (BENCHMARKS.md, 2026-12-05).
    ``{"fraction", "impl", "gbs", "copy_gbs"}``."""
    copy = report.get("extra", {}).get("copy_gbs")
    rows = [r for r in report["rows"] if r["op"] == CAST_TRANSPOSE and r.get("impl") == "compile" and r.get("gbs")]
    rows = [r for r in rows if r.get("dtype") == "bfloat16"] or rows
    if not copy or not rows:
        return None
    best = max(rows, key=lambda r: r["gbs"])
    return {"fraction": best["gbs"] / copy, "impl": best["impl"], "gbs": best["gbs"], "copy_gbs": copy}


_GEMM_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_GEMM_ROWS = {"fp8": "fp8-tensor"}
"""The bench's rows a dtype of the speed model is priced at (FP8 linears: the per-tensor scaled GEMM)."""


@dataclass
class Rates:
    """The rows of the reports given, grouped by kind; ``threads`` of each GEMM / attention report."""

    gemm: dict[int, list[dict]] = field(default_factory=dict)
    attention: dict[int, list[dict]] = field(default_factory=dict)
    comm: list[dict] = field(default_factory=list)
    elementwise: dict[int, list[dict]] = field(default_factory=dict)
    device_type: str = "cpu"
    cpu_count: int = 1
    notes: list[str] = field(default_factory=list)
    memo: dict = field(default_factory=dict, repr=False)
    """Derived figures computed once per report (the host term of :func:`omnitron.plan.speed.host_layer`)."""
    expert_load: object = None
    """A routing histogram (:class:`omnitron.plan.routing.ExpertLoad`) MoE layers are priced at, or None: balanced."""
    cast_transpose: dict | None = None
    """A kernels report's per-tensor FP8 cast-transpose over its copy (:func:`cast_transpose_rate`), or None."""
    host_ranks: int = 1
    """Intra-op threads of every rank the layout runs on one CPU host (set per prediction): collectives on a CPU
    are CPU work, so rows measured with fewer processes than cores are slowed as the cores get time-shared."""

    @classmethod
    def from_reports(cls, items: list[str]) -> "Rates":
        """Load every report of ``items``; ConfigError when none holds GEMM rows (the one kind required)."""
        r = cls()
        for path in report_paths(items):
            try:
                rep = load(path)
            except ReportError as err:
                raise ConfigError(f"--bench {err}") from None
            m = rep["machine"]
            if rep["kind"] in ("gemm", "attention", "elementwise"):
                getattr(r, rep["kind"]).setdefault(int(m.get("threads") or 1), []).extend(rep["rows"])
                r.device_type, r.cpu_count = m.get("device_type", "cpu"), int(m.get("cpu_count") or 1)
            elif rep["kind"] == "comm":
                r.comm.extend(rep["rows"])
            elif rep["kind"] == "kernels":
                r.cast_transpose = cast_transpose_rate(rep) or r.cast_transpose
        if not r.gemm:
            raise ConfigError(f"--bench {' '.join(items)}: no gemm report among them; run `omnitron bench gemm "
                              "--json gemm.json` (or `omnitron bench all --out DIR`) on the target machine")
        return r

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def bind(self, settings) -> None:
        """The layout being priced (a hierarchical machine needs it to place groups; a report does not)."""

    def _pick(self, table: dict[int, list[dict]], threads: int, what: str) -> tuple[list[dict], float]:
        """(rows, rate factor) for ``threads``-thread ranks: the matching report, else the nearest scaled."""
        if threads in table:
            return table[threads], 1.0
        near = min(table, key=lambda t: (abs(t - threads), t))
        self.note(f"{what}: no report at {threads} threads; the {near}-thread rows scaled by {threads}/{near}")
        return table[near], threads / near

    def gemm_s(self, dtype: str, m: int, n: int, k: int, threads: int = 1) -> float:
        """Seconds of one ``[m,k] @ [k,n]`` GEMM in ``dtype`` (``fp32``, ``bf16``, ...); kept in :attr:`memo` (a
        search asks for the same few shapes thousands of times; the rows never change after loading)."""
        key = ("gemm_s", dtype, m, n, k, threads)
        if key not in self.memo:
            self.memo[key] = self._gemm_s(dtype, m, n, k, threads)
        return self.memo[key]

    def _gemm_s(self, dtype: str, m: int, n: int, k: int, threads: int) -> float:
        rows, f = self._pick(self.gemm, threads, "gemm")
        mine = [r for r in rows if r["dtype"] == _GEMM_ROWS.get(dtype, dtype)]
        if not mine:
            self.note(f"gemm: no {dtype} rows; using fp32's")
            mine = [r for r in rows if r["dtype"] == "fp32"] or rows
        flops = 2.0 * m * n * k
        tflops = _loglog(_points(mine, lambda r: 2.0 * r["m"] * r["n"] * r["k"]), flops) * f
        return flops / (tflops * 1e12)

    def attention_s(self, dtype: str, flops: float, dropout: bool, threads: int = 1, local=None) -> float:
        """Seconds of attention forward + backward worth ``flops`` (the bench's count: 3 x forward): the engine's
        op (``op:*`` rows) at the layer's attention dropout. Reports without dropout rows (before 2026-12-02)
        price attention with dropout at the math path's rows, its dropout left to the element-wise ops
        (:meth:`fused_attention_dropout`)."""
        if not self.attention:
            self.note("attention: no attention report; attention FLOPs at the GEMM rate of a square GEMM of "
                      "the same FLOPs")
            side = round((flops / 6) ** (1 / 3))
            return 3 * self.gemm_s(_GEMM_DTYPE.get(dtype, dtype), side, side, side, threads)
        rows, f = self._pick(self.attention, threads, "attention")
        name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(dtype, dtype)
        if dropout and self.fused_attention_dropout(threads):
            impl = [r for r in rows if r["impl"].startswith("op:") and r.get("dropout", 0.0) > 0]
        else:
            math_path = dropout  # older reports: SDPA with dropout leaves its fused path on a CPU
            impl = [r for r in rows if (r["impl"] == "math") == math_path and r["impl"] != "ring_block"
                    and not r.get("dropout", 0.0)]
        named = [r for r in impl if r["dtype"] == name]
        mine = named or impl or rows
        if not named:
            self.note(f"attention: no {name} rows of the engine's attention{' with dropout' if dropout else ''}; "
                      f"using {mine[0]['dtype']} {mine[0]['impl']}")

        def fl(r):
            return 3 * 4 * r.get("batch", 1) * r["heads"] * r["seq"] ** 2 * r["head_dim"] * (0.5 if r["causal"] else 1)

        return flops / (_loglog(_points(mine, fl), flops) * f * 1e12)

    def fused_attention_dropout(self, threads: int = 1) -> bool:
        """Whether the attention report measured the engine's op with dropout (its rows then include the dropout
        of the probabilities, which the element-wise ops must not count again)."""
        if not self.attention:
            return False
        rows, _ = self._pick(self.attention, threads, "attention")
        return any(r["impl"].startswith("op:") and r.get("dropout", 0.0) > 0 for r in rows)

    def ring_block_s(self, dtype: str, flops: float, causal: bool, dropout: bool, threads: int = 1,
                     head_dim: int | None = None) -> float | None:
        """Seconds of one ring-attention block (forward + backward) worth ``flops`` (the bench's count), from the
        report's ``ring_block`` rows of that mask and dropout (their time holds the dropout's: ``head_dim``
        unused); None when the report has none (older reports)."""
        if not self.attention:
            return None
        rows, f = self._pick(self.attention, threads, "attention")
        name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(dtype, dtype)
        mine = [r for r in rows if r["impl"] == "ring_block" and r["causal"] == causal
                and (r.get("dropout", 0.0) > 0) == dropout]
        named = [r for r in mine if r["dtype"] == name] or mine
        if not named:
            return None

        def fl(r):
            return 3 * 4 * r.get("batch", 1) * r["heads"] * r["seq"] ** 2 * r["head_dim"] * (0.5 if r["causal"] else 1)

        return flops / (_loglog(_points(named, fl), flops) * f * 1e12)

    def elementwise_s(self, op: str, mode: str, elements: float, threads: int = 1) -> float:
        """Seconds of element-wise ``op`` (``mode`` fwd, bwd or step) over ``elements`` elements; 0 without an
        elementwise report (noted)."""
        if not self.elementwise:
            self.note("element-wise ops: no elementwise report (`omnitron bench elementwise`); not priced")
            return 0.0
        rows, f = self._pick(self.elementwise, threads, "elementwise")
        mine = [r for r in rows if r["op"] == op and r["mode"] == mode]
        if not mine and op in _STAND_IN:
            other, passes = _STAND_IN[op]
            self.note(f"element-wise ops: no {op} rows in the report; priced as {passes} {other} passes")
            return passes * self.elementwise_s(other, mode, elements, threads)
        if not mine:
            self.note(f"element-wise ops: no {op} {mode} rows; not priced")
            return 0.0
        return _linear(sorted((r["elements"], r["ms"] * 1e-3) for r in mine), elements) / f

    def host_layer_s(self, mode: str, threads: int = 1) -> float | None:
        """Seconds of the report's ``host_layer`` row (``mode`` fwd or bwd): one engine layer at shapes where its
        arithmetic is nothing (:data:`omnitron.bench.elementwise.HOST_LAYER`); None without one (older reports)."""
        if not self.elementwise:
            return None
        rows, _ = self._pick(self.elementwise, threads, "elementwise")  # host work: not scaled by threads
        mine = [r["ms"] * 1e-3 for r in rows if r["op"] == "host_layer" and r["mode"] == mode]
        return min(mine) if mine else None

    def host_slowdown(self, op: str, busy: int) -> float | None:
        """The comm report's measured slowdown of ``op`` (``host_gemm`` / ``host_stream``) with ``busy`` threads
        working at once: piecewise linear in the measured rank counts from 1.0 at one; past the largest, its
        slowdown times the further time-sharing of the cores. None without rows (older reports)."""
        rows = sorted((r["ranks"], r["slowdown"]) for r in self.comm if r["op"] == op)
        if not rows:
            return None
        if busy <= 1:
            return 1.0
        last_n, last = rows[-1]
        if busy > last_n:
            return last * max(1.0, busy / self.cpu_count) / max(1.0, last_n / self.cpu_count)
        return max(1.0, _interp([(1, 1.0)] + rows, busy, True))  # below 1: the measurement's noise

    def comm_s(self, op: str, nbytes: float, ranks: int, group: str | None = None) -> float:
        """Seconds of one ``op`` (all_reduce, all_gather, reduce_scatter, all_to_all, p2p) of ``nbytes`` over
        ``ranks`` ranks (``nbytes`` as the bench counts it: the buffer, the gathered output, the input). ``group``
        (which of the layout's groups) is for hierarchical machines; one host's report prices every group alike.
        Kept in :attr:`memo` by what decides it (the host's sharing included)."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        key = ("comm_s", op, nbytes, ranks, self.host_ranks if self.device_type == "cpu" else None)
        if key not in self.memo:
            self.memo[key] = self._comm_s(op, nbytes, ranks)
        return self.memo[key]

    def _comm_s(self, op: str, nbytes: float, ranks: int) -> float:
        rows = [r for r in self.comm if r["op"] == op and r.get("group", "world") != "inter"]  # one host's links
        if not rows:
            raise ConfigError(f"--bench: no comm rows of {op}; run `omnitron bench comm --ops {op} ...` on the "
                              "target machine and pass its report too")
        counts = sorted({r["ranks"] for r in rows})
        near = ranks if ranks in counts else min(counts, key=lambda n: (abs(n - ranks), -n))
        if near != ranks:
            self.note(f"comm: no {op} rows at {ranks} ranks; the {near}-rank rows (bus bandwidth kept)")
        pts = sorted((r["bytes"], r["ms"] * 1e-3) for r in rows if r["ranks"] == near)
        t = _linear(pts, nbytes)
        if self.device_type == "cpu":  # the host's cores time-shared by more processes than when measured
            t *= max(1.0, self.host_ranks / self.cpu_count) / max(1.0, near / self.cpu_count)
        if near != ranks and op != "p2p":  # same bus bandwidth: time scales with the bus factor
            from omnitron.bench.comm import bus_factor

            t *= bus_factor(op, ranks) / bus_factor(op, near)
        return t


def _linear(pts: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear time at ``x`` bytes: the first point below, the last two's slope above."""
    return _interp(pts, x, clamp=False)


def _interp(pts: list[tuple[float, float]], x: float, clamp: bool) -> float:
    """Piecewise-linear y at x over sorted points: the first y below them; above, the last y (``clamp``) or the
    last two points' slope (one point: proportional)."""
    xs = [p[0] for p in pts]
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return pts[0][1]
    if i == len(pts):
        if clamp:
            return pts[-1][1]
        if len(pts) == 1 or pts[-2][0] == pts[-1][0]:
            return pts[-1][1] * x / pts[-1][0]
        i -= 1
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    return y0 + (x - x0) * (y1 - y0) / (x1 - x0) if x1 > x0 else y1
