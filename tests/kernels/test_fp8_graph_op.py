"""The Triton FP8 cast-transpose inside a compiled graph (the opt-in ``triton_graph`` implementation): one opaque
``omnitron::`` operator, not a graph break and not the reference's strided pointwise kernel.

Run on CPU through Triton's interpreter in a child process (``TRITON_INTERPRET=1`` must be set before the kernels
are defined). Inside: both ops traced with ``fullgraph=True`` (a break fails the trace), the graph holding the
custom op, and every output bit-identical to the plain-torch reference (the kernel's integer rounding is exact:
tests/kernels/test_conformance.py holds it to the reference the same way).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import torch
    from omnitron.kernels.reference import fp8 as ref
    from omnitron.kernels.triton_kernels import fp8 as tri

    ops = []
    def record(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    x = (torch.randn(96, 80, generator=g) * 3).to(torch.bfloat16)
    for fmt in ("e4m3", "e5m2"):
        amax = torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)
        want = ref.fp8_cast_transpose_from_amax(x, amax, fmt, 1)
        got = torch.compile(lambda x, a: tri.graph_cast_transpose_from_amax(x, a, fmt, 1), backend=record,
                            fullgraph=True)(x, amax)
        scale = torch.tensor(0.37)
        want2 = ref.fp8_cast_transpose_amax(x, scale, fmt)
        got2 = torch.compile(lambda x, s: tri.graph_cast_transpose_amax(x, s, fmt), backend=record,
                             fullgraph=True)(x, scale)
        for w, o in zip((*want, *want2), (*got, *got2)):
            assert w.dtype == o.dtype and w.shape == o.shape, (w.dtype, o.dtype, w.shape, o.shape)
            assert torch.equal(w.view(torch.uint8) if w.element_size() == 1 else w,
                               o.view(torch.uint8) if o.element_size() == 1 else o), fmt
    from omnitron.kernels import implementations
    for op in ("fp8_cast_transpose_from_amax", "fp8_cast_transpose_amax"):  # opt-in: the default stays measured
        impls = implementations(op)
        assert not impls["triton"].traceable and impls["triton_graph"].traceable, op
    print("OPS", sorted(set(ops)))
""")


def test_triton_cast_transpose_is_one_graph_op_and_exact(backend_name):
    if backend_name != "cpu":
        pytest.skip("the interpreter run is for CPU; on a GPU the compiled training runs exercise the op natively")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ops = proc.stdout.split("OPS", 1)[1]
    assert "omnitron.fp8_cast_transpose_from_amax" in ops and "omnitron.fp8_cast_transpose_amax" in ops, ops
