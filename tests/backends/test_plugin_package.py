"""The out-of-tree backend in examples/backend_plugin, installed as a user installs it (pip, by its entry
point, into a directory of its own): omnitron finds it with no change, its kernel is the one ``rms_norm``
resolves to, and the conformance suite passes on it (the kernels part here, the whole suite as ``slow``)."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "examples" / "backend_plugin"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The plugin pip-installed into a directory of its own, built from a copy of its source: setuptools builds in
    the source tree (build/, *.egg-info), and two xdist workers building examples/backend_plugin at once left one
    target with the entry point but without the package ('No module named omnitron_example_backend')."""
    target, source = tmp_path_factory.mktemp("plugin"), tmp_path_factory.mktemp("plugin_src") / "backend_plugin"
    shutil.copytree(PLUGIN, source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "--target", str(target), str(source)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(target), str(ROOT), env.get("PYTHONPATH", "")])
    env.pop("OMNITRON_BACKEND", None)
    return env


def _pytest(env, *argv, timeout=900):
    """pytest in a fresh process (this file left out: it would run itself again)."""
    return _run(env, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--ignore", __file__, *argv,
                timeout=timeout)


def _run(env, *argv, timeout=600):
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)


def test_found_by_entry_point_and_its_kernel_resolves(installed):
    proc = _run(installed, "-m", "omnitron", "info", "--backend", "example")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(ln.split()[:2] == ["example", "usable"] for ln in lines)
    assert any(ln.split() == ["rms_norm", "example"] for ln in lines)
    assert any(ln.split() == ["add_rms_norm", "reference"] for ln in lines)  # what it does not provide


@pytest.mark.slow  # ~10 s; the entry-point discovery and the kernel's resolution stay in the default suite
def test_kernel_conformance_on_the_plugin(installed):
    proc = _pytest(installed, "tests/backends/test_backend_kernels.py", "--backend", "example")
    assert proc.returncode == 0, proc.stdout[-3000:]


@pytest.mark.slow
def test_whole_conformance_suite_on_the_plugin(installed):
    proc = _pytest(installed, "tests/backends", "--backend", "example")
    assert proc.returncode == 0, proc.stdout[-3000:]
