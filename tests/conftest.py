"""Shared pytest options: ``--backend NAME`` selects the backend the conformance suite runs on; strict
collective checking (``OMNITRON_STRICT_COLLECTIVES=1``) is on unless the environment says otherwise."""
from __future__ import annotations

import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--backend", default=None, help="backend under test (default: $OMNITRON_BACKEND or cpu)")


def pytest_configure(config):
    name = config.getoption("--backend") or os.environ.get("OMNITRON_BACKEND") or "cpu"
    os.environ["OMNITRON_BACKEND"] = name
    # DESIGN rule 7: the suite runs under NCCL's rules (fingerprinted collectives, in-order p2p)
    os.environ.setdefault("OMNITRON_STRICT_COLLECTIVES", "1")


@pytest.fixture(scope="session")
def backend_name() -> str:
    return os.environ["OMNITRON_BACKEND"]


@pytest.fixture(scope="session")
def backend(backend_name):
    from omnitron.backends import get_backend

    return get_backend(backend_name)


def pytest_collection_modifyitems(config, items):
    name = os.environ.get("OMNITRON_BACKEND", "cpu")
    skip_gpu = pytest.mark.skip(reason=f"needs a GPU backend; running on {name!r}")
    for item in items:
        if "gpu" in item.keywords and name in ("cpu", "sim"):  # sim is simulated: no GPU under it
            item.add_marker(skip_gpu)
