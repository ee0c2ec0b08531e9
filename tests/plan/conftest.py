"""Synthetic ``omnitron bench`` reports of known rates for the speed-model and recommendation tests."""
from __future__ import annotations

import json

import pytest


def _report(tmp_path, kind: str, rows: list[dict], threads: int = 1, world: int = 1) -> str:
    from omnitron.bench.report import SCHEMA, VERSION

    rep = {"schema": SCHEMA, "version": VERSION, "kind": kind, "created": "", "command": None,
           "machine": {"device_type": "cpu", "cpu_count": 8, "threads": threads, "world_size": world},
           "rows": rows, "extra": {}}
    path = tmp_path / f"{kind}-{threads}-{world}.json"
    path.write_text(json.dumps(rep))
    return str(path)


def _constant_reports(tmp_path, tflops: float, comm_ms_per_mb: float) -> list[str]:
    """Report paths of known constants: every GEMM and attention at ``tflops``; each collective ``comm_ms_per_mb``
    ms per MB on 2 or 4 ranks (linear through 0); no element-wise report (not priced); 8 cores (1 thread a rank
    at world 8, no time-sharing)."""
    gemm = [{"dtype": "fp32", "shape": "square", "m": s, "n": s, "k": s, "ms": 1.0, "tflops": tflops}
            for s in (64, 512)]
    att = [{"impl": impl, "dtype": "float32", "seq": s, "heads": 2, "head_dim": 8, "causal": True, "ms": 1.0,
            "tflops": tflops} for s in (16, 256) for impl in ("math", "op:reference")]
    comm = [{"op": op, "bytes": nb, "ranks": n, "ms": comm_ms_per_mb * nb / 1e6, "algbw_gbs": 0, "busbw_gbs": 0}
            for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p") for n in (2, 4)
            for nb in (1, 10**6)]
    return [_report(tmp_path, "gemm", gemm), _report(tmp_path, "attention", att), _report(tmp_path, "comm", comm)]


def _constant_rates(tmp_path, tflops: float, comm_ms_per_mb: float):
    """:class:`Rates` of :func:`_constant_reports`."""
    from omnitron.plan.rates import Rates

    return Rates.from_reports(_constant_reports(tmp_path, tflops, comm_ms_per_mb))


@pytest.fixture
def bench_report():
    """``bench_report(tmp_path, kind, rows)`` -> path of a report of those rows."""
    return _report


@pytest.fixture
def constant_rates():
    """``constant_rates(tmp_path, tflops, ms_per_mb)`` -> :class:`Rates` of those constants."""
    return _constant_rates


@pytest.fixture
def constant_reports():
    """``constant_reports(tmp_path, tflops, ms_per_mb)`` -> the report paths behind :func:`constant_rates`."""
    return _constant_reports


def _no_fused_kernels_backend():
    """A stand-in for a device backend (sim's kernel table: its SwiGLU, GeLU and the rest resolve to the reference
    implementations, which the host has too) whose dropout is fused."""
    from types import SimpleNamespace

    return SimpleNamespace(device=lambda: SimpleNamespace(type="sim"),
                           kernels=SimpleNamespace(resolved=lambda op: "reference"))


@pytest.fixture
def reference_kernel_backend(monkeypatch):
    """This process's backend replaced by :func:`_no_fused_kernels_backend` (``omnitron.backends.get_backend``, which
    the plan and its probes read at call time)."""
    import omnitron.backends

    monkeypatch.setattr(omnitron.backends, "get_backend", _no_fused_kernels_backend)
