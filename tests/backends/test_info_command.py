"""``omnitron info``: backends that cannot run here exit non-zero and say why; cpu describes itself."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from omnitron.cli import main
from omnitron.backends import registry

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("name, reason", [("musa", "torch_musa is not installed"),
                                          ("cuda", "this torch build has no CUDA")])
def test_unusable_backend_exits_nonzero_with_reason(monkeypatch, capsys, name, reason):
    if (torch.version.cuda if name == "cuda" else importlib.util.find_spec("torch_musa")) is not None:
        pytest.skip(f"{name} may be usable on this machine")
    monkeypatch.setenv("OMNITRON_BACKEND", name)
    registry.reset_cache()
    assert main(["info"]) != 0
    out = capsys.readouterr().out
    assert f"backend {name!r} cannot run here: " in out and reason in out
    assert "cpu" in out and "usable" in out  # every backend is listed with its state


def test_info_on_cpu_prints_capabilities_and_kernel_table(monkeypatch, capsys):
    monkeypatch.setenv("OMNITRON_BACKEND", "cpu")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for needle in ("selected: cpu", "fp8_gemm", "rms_norm", "versions:"):
        assert needle in out


@pytest.mark.skipif(importlib.util.find_spec("torch_musa") is not None, reason="torch_musa is installed here")
def test_console_command_exit_code():
    """The real command line, in a fresh process (what a user types)."""
    env = {**os.environ, "OMNITRON_BACKEND": "musa", "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-m", "omnitron", "info"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "torch_musa is not installed" in proc.stdout + proc.stderr
