"""Kernel benchmark: every implementation of every op against torch eager (the reference), the
torch-native fused op where one exists, and optionally ``torch.compile`` of the reference.

Calls are timed round-robin (one call of each implementation per round) so a noisy machine
slows all of them alike; the median over rounds is reported, with achieved bandwidth (bytes of
every input and output moved once / time) and peak memory allocated during one call (tracked
op by op through a dispatch mode, so it works on any device).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
from torch.utils import _pytree as pytree

from omnitron.kernels.alloc_log import Timeline, peak
from omnitron.kernels.cases import OPS, Case, OpCases, cases
from omnitron.kernels.registry import REFERENCE, implementations


@dataclass
class Row:
    op: str
    dtype: str
    mode: str
    impl: str
    ms: float | None
    """Median over rounds."""
    gbs: float | None
    peak_mib: float | None
    speedup: float | None = None
    """Eager (reference) time / this time."""
    note: str = ""
    min_ms: float | None = None
    """Fastest round (less sensitive to a loaded machine than the median)."""


class PeakTracker(Timeline):
    """Peak bytes of storages created by ops while active (storages that existed before count 0)."""

    @property
    def peak(self) -> int:
        return int(peak(self.events))

    @property
    def cur(self) -> int:
        """Bytes of the storages created while active and still live."""
        freed = {n for op, n in self.events if op is None}
        return sum(n for i, (op, n) in enumerate(self.events) if op is not None and i not in freed)


def _nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))


def _runner(fn, case: Case, mode: str):
    """A no-argument callable doing one forward (and backward) of ``case`` and the bytes it moves once."""
    args, kwargs = case.args, case.kwargs
    if mode == "fwd+bwd":
        args, kwargs = case.copy()
        grads = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor) and a.requires_grad]
        out = fn(*args, **kwargs)
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        gos = [torch.randn_like(o) for o in outs]
        moved = 2 * _nbytes((args, kwargs)) + 2 * _nbytes(outs) + _nbytes(grads)

        def call():
            torch.autograd.grad(fn(*args, **kwargs), grads, gos)
        return call, moved
    if case.inplace:  # updated tensors read and written, the others read (AdamW: p, m, v; g)
        moved = sum((2 if i in case.inplace else 1) * _nbytes(a) for i, a in enumerate(args))
    else:
        with torch.no_grad():
            moved = _nbytes((args, kwargs)) + _nbytes(fn(*args, **kwargs))

    def call():
        with torch.no_grad():
            fn(*args, **kwargs)
    return call, moved


def _candidates(op: str, spec: OpCases, backend, compile_: bool, case: Case) -> tuple[dict, dict[str, str]]:
    """(name -> callable to time, name -> reason it declined these arguments). The backend's kernel table is built
    first: that registers the implementations its ``register_kernels()`` imports (a plug-in's, cpu's flash blocks)."""
    backend.kernels  # noqa: B018 - built once, cached
    impls, declined = {"eager": implementations(op)[REFERENCE].fn}, {}
    if spec.native is not None:
        impls["torch"] = spec.native
    if compile_:
        impls["compile"] = torch.compile(impls["eager"], dynamic=False)
    for name, impl in sorted(implementations(op).items()):
        if name == REFERENCE or (impl.backends is not None and backend.name not in impl.backends):
            continue
        ok, _ = impl.available()
        why = impl.supports(*case.args, **case.kwargs) if ok and impl.supports is not None else None
        if why:
            declined[name] = why
        elif ok:
            impls[name] = impl.fn
    return impls, declined


def bench_case(op: str, case: Case, backend, dtype: torch.dtype, mode: str, *, compile_: bool, rounds: int,
               budget_s: float) -> list[Row]:
    """Rows for every usable implementation of ``op`` on ``case`` (a workload of omnitron/kernels/cases.py
    made in ``dtype``) in ``mode`` (``fwd``, ``fwd+bwd`` or ``step``)."""
    dname = str(dtype).split(".")[-1]
    calls, rows = {}, {}
    impls, declined = _candidates(op, OPS[op], backend, compile_, case)
    for name, why in declined.items():
        rows[name] = Row(op, dname, mode, name, None, None, None, note=f"declined: {why[:80]}")
    for name, fn in impls.items():
        try:
            if case.inplace and name != "eager":  # each optimizer gets its own state
                case = Case(case.label, *case.copy(), grad=case.grad, inplace=case.inplace)
            call, moved = _runner(fn, case, mode)
            call()  # warm-up (compiles where needed)
            call()
            calls[name] = (call, moved)
        except Exception as err:  # an implementation that cannot take this case is reported, not fatal
            rows[name] = Row(op, dname, mode, name, None, None, None, note=f"failed: {str(err).splitlines()[0][:80]}")
    times: dict[str, list[float]] = {name: [] for name in calls}
    start = time.perf_counter()
    for r in range(rounds):
        for name, (call, _) in calls.items():
            backend.synchronize()
            t0 = time.perf_counter()
            call()
            backend.synchronize()
            times[name].append(time.perf_counter() - t0)
        if r >= 2 and time.perf_counter() - start > budget_s:
            break
    for name, (call, moved) in calls.items():
        ms = statistics.median(times[name]) * 1e3
        peak = None
        if name != "compile":
            tracker = PeakTracker()
            with tracker:
                call()
            peak = tracker.peak / 2**20
        rows[name] = Row(op, dname, mode, name, ms, moved / (ms * 1e-3) / 1e9, peak,
                         min_ms=min(times[name]) * 1e3)
    eager = rows.get("eager")
    for row in rows.values():
        if eager is not None and eager.ms and row.ms:
            row.speedup = eager.ms / row.ms
    return list(rows.values())


def copy_bandwidth(backend, size: str) -> float:
    """Device-to-device copy bandwidth in GB/s (read + write), the ceiling for memory-bound kernels."""
    n = {"tiny": 1 << 20, "small": 1 << 25, "large": 1 << 28}[size]
    x = torch.empty(n, dtype=torch.uint8, device=backend.current_device()).fill_(1)
    y = torch.empty_like(x)
    y.copy_(x)
    ts = []
    for _ in range(10):
        backend.synchronize()
        t0 = time.perf_counter()
        y.copy_(x)
        backend.synchronize()
        ts.append(time.perf_counter() - t0)
    return 2 * n / statistics.median(ts) / 1e9


def run(backend, *, ops: list[str] | None, dtypes: list[torch.dtype], size: str, compile_: bool, rounds: int = 15,
        budget_s: float = 3.0, log=print) -> dict:
    """Benchmark every selected op; returns the JSON-able report (machine, copy bandwidth, the kernel table's order
    per op, rows)."""
    import platform

    rows: list[Row] = []
    chosen = [op for op, spec in OPS.items() if spec.bench and (not ops or op in ops)]
    order = resolved(backend, chosen)  # first: a kernel table that cannot be built fails before any timing
    for op in chosen:
        spec = OPS[op]
        for dtype in ((torch.float32,) if spec.float_only else dtypes):
            torch.manual_seed(0)
            (case,) = cases(op, backend.current_device(), dtype, size)
            for mode in (("fwd", "fwd+bwd") if case.grad else ("step",)):
                new = bench_case(op, case, backend, dtype, mode, compile_=compile_, rounds=rounds, budget_s=budget_s)
                rows += new
                log(format_rows(new, header=not rows[: -len(new)]))
    return {
        "machine": {"backend": backend.name, "device": str(backend.current_device()), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "processor": platform.processor() or platform.machine()},
        "copy_gbs": copy_bandwidth(backend, size),
        "resolved": order,
        "rows": [asdict(r) for r in rows],
    }


def resolved(backend, ops: list[str]) -> dict[str, list[str]]:
    """``{op: implementation names}``: those ``backend``'s kernel table tries for ``op``, in order, then the
    reference's row name (``eager``). The engine runs the first that accepts a call, so of a case's rows the first
    of these with a time is what the engine runs there (``omnitron bench compare``'s "kernels as run" table)."""
    table = backend.kernels
    return {op: [impl.name for impl in table.get(op).candidates] + ["eager"] for op in ops}


def format_rows(rows: list[Row], header: bool = True) -> str:
    """Rows as an aligned text table (``-`` where a figure is missing)."""
    def f(v, spec):
        width = int(spec.split(".")[0]) if spec[0].isdigit() else 0
        return "-".rjust(width) if v is None else format(v, spec)

    lines = [f"{'op':26s} {'dtype':9s} {'mode':8s} {'impl':8s} {'ms':>9s} {'min ms':>9s} {'GB/s':>7s} {'peak MiB':>9s} "
             f"{'vs eager':>8s}"] if header else []
    for r in rows:
        lines.append(f"{r.op:26s} {r.dtype:9s} {r.mode:8s} {r.impl:8s} {f(r.ms, '9.3f')} {f(r.min_ms, '9.3f')} "
                     f"{f(r.gbs, '7.1f')} "
                     f"{f(r.peak_mib, '9.1f')} {f(r.speedup, '7.2f')}x {r.note}".rstrip())
    return "\n".join(lines)
