"""The supported torch range is one fact in three places: ``torch_range.TESTED``, ``setup.py``'s
``install_requires`` and ``omnitron info``; the C++ extension's version checks picked the path the
running torch needs."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from omnitron.backends import registry, torch_range
from omnitron.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_setup_py_states_the_tested_range():
    text = open(os.path.join(ROOT, "setup.py")).read()
    (lo, hi), = re.findall(r'"torch>=(\d+\.\d+),<(\d+\.\d+)"', text)
    (a, b), (c, d) = torch_range.TESTED
    assert (lo, hi) == (f"{a}.{b}", f"{c}.{d + 1}")


@pytest.mark.parametrize("version, inside, stack", [
    ("2.9.1+cu128", True, "torch_musa v2.9"), ("2.11.0", True, "MUSA SDK 5.2"), ("2.13.0+cpu", True, "README"),
    ("2.15.0+cu132", True, None), ("2.8.0", False, None), ("2.16.0", False, None),
    ("3.0.0", False, None)])
def test_range_and_stacks(version, inside, stack):
    assert torch_range.in_tested_range(version) is inside
    line = torch_range.describe(version)
    assert ("inside" if inside else "OUTSIDE") in line and version in line
    assert (stack in line) if stack else torch_range.stacks_for(version) == []


def test_info_prints_the_installed_torch_and_its_place(monkeypatch, capsys):
    monkeypatch.setenv("OMNITRON_BACKEND", "cpu")
    registry.reset_cache()
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert torch_range.describe(torch.__version__) in out and "tested range 2.9-2.15" in out


_PROBE = """
import json, re, torch, torch.distributed
from omnitron import _sim
table = torch._C._dispatch_dump_table("c10d::barrier")
fallback = re.search(r"^AutogradPrivateUse1: .*\\[backend fallback\\]", table, re.M) is not None
print(json.dumps(dict(_sim.build_features(), runtime=torch.__version__, fallback=fallback)))
"""


@pytest.mark.skipif(importlib.util.find_spec("omnitron._sim") is None, reason="omnitron._sim is not built")
def test_sim_build_features_match_the_running_torch():
    """omnitron._sim was compiled against this torch's minor with the paths of csrc/sim/compat.h this minor
    needs, and with it loaded the sim tensor's autograd key has a fallback (the c10d ops have no autograd
    kernel). In a child process: the pytest process never loads the PrivateUse1 device."""
    proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    feats = json.loads(proc.stdout.splitlines()[-1])
    minor = torch_range.minor_of(feats["runtime"])
    assert torch_range.minor_of(feats["torch"]) == minor, f"omnitron._sim built for {feats['torch']}; rebuild it"
    assert feats["backend_set_timeout"] == (minor >= (2, 9))
    assert feats["autograd_fallback"] == (minor < (2, 10))
    assert feats["sync_returns_none"] == (minor >= (2, 9))
    assert feats["fallback"], "no autograd fallback for the sim device: c10d collectives cannot dispatch"
