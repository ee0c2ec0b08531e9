"""Backend conformance suite: which backends run, and how each is built.

``pytest tests/backends --backend NAME`` runs the suite on NAME. On ``cpu`` (this machine's
default) it also runs on ``musa-double``: the MUSA backend's code over the torch_musa test double
(``torch.device("musa")`` tensors on the sim device, ``mccl`` for them; tests/conftest.py names this
process's PrivateUse1 ``musa`` at start). Test ids carry the backend name, so those results read
``[musa-double]`` and are never reported as MUSA. ``OMNITRON_TEST_MUSA_DOUBLE=1`` adds the double
beside any other backend; ``--backend musa-double`` runs it alone.
"""
from __future__ import annotations

import os

import pytest

from omnitron.testing import musa_double

DOUBLE = "musa-double"


def suite_backends() -> list[str]:
    name = os.environ.get("OMNITRON_BACKEND", "cpu")
    extra = [DOUBLE] if name == "cpu" or os.environ.get("OMNITRON_TEST_MUSA_DOUBLE") == "1" else []
    return [name] + [e for e in extra if e != name]


def pytest_generate_tests(metafunc):
    if "suite_backend_name" in metafunc.fixturenames:
        metafunc.parametrize("suite_backend_name", suite_backends())


@pytest.fixture
def double_env(monkeypatch):
    """Make ``get_backend("musa-double")`` resolvable here and in spawned workers."""
    current = os.environ.get("OMNITRON_EXTRA_BACKENDS", "")
    if musa_double.TARGET not in current:
        monkeypatch.setenv("OMNITRON_EXTRA_BACKENDS", ",".join(filter(None, (current, musa_double.TARGET))))


@pytest.fixture
def suite_backend(suite_backend_name, double_env):
    """The backend under test; the MUSA double is installed only for the duration of one test."""
    if suite_backend_name == DOUBLE:
        if musa_double.not_prepared() is not None:
            pytest.skip(f"MUSA double unavailable: {musa_double.not_prepared()}")
        with musa_double.installed():
            yield musa_double.MUSADoubleBackend()
        return
    from omnitron.backends import BackendUnavailableError, get_backend

    try:
        be = get_backend(suite_backend_name)
    except BackendUnavailableError as err:  # one clear message instead of an error per test
        pytest.exit(f"conformance suite: {err}", returncode=3)
    yield be
