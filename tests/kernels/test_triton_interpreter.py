"""Runs the conformance suite's Triton cases on CPU through Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before the kernels are defined, so the cases run in a child
pytest process (this process may already have imported the kernels without it).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


def test_triton_kernels_conform_under_interpreter(backend_name):
    if backend_name != "cpu":
        pytest.skip("the interpreter run is for CPU; on a GPU the suite tests the Triton kernels natively")
    env = dict(os.environ, TRITON_INTERPRET="1", OMNITRON_REQUIRE_IMPLS="triton", OMNITRON_BACKEND="cpu",
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "triton",
                           str(ROOT / "tests" / "kernels" / "test_conformance.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    passed = int(re.search(r"(\d+) passed", proc.stdout).group(1))
    assert passed >= 30 and "skipped" not in proc.stdout.splitlines()[-1], tail
