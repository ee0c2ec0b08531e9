"""Shared pytest options: ``--backend NAME`` selects the backend the conformance suite and every multi-rank test
of the shared harness (``run_distributed``, ``tp_sp_parity``) run on; strict collective checking
(``OMNITRON_STRICT_COLLECTIVES=1``) is on unless the environment says otherwise. Tests marked
``host_only(reason)`` (host by design) or ``device_port(reason)`` (not yet ported) are skipped with that reason
under any backend but cpu."""
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
    # the planner's probes run in every session (tests/plan/test_probe_cache.py turns its disk cache on)
    os.environ.setdefault("OMNITRON_PLAN_CACHE", "off")
    _runs_outside_the_checkout(config)
    _not_an_srun_task()
    _share_the_cores()
    _prepare_musa_double(name)
    if name == "sim":  # loaded before any backward: autograd sizes its device queues at the first one
        from omnitron.backends import get_backend

        get_backend(name)


def _runs_outside_the_checkout(config) -> None:
    """Training a test runs without ``--save`` or ``--log-dir`` writes its metrics under a folder of this
    session's (removed at its end), not ``./runs`` of the checkout; every process the test starts inherits it."""
    if "OMNITRON_RUNS_DIR" not in os.environ:
        import tempfile

        config._omnitron_runs = tempfile.mkdtemp(prefix="omnitron-test-runs-")
        os.environ["OMNITRON_RUNS_DIR"] = config._omnitron_runs


def _not_an_srun_task() -> None:
    """A suite run as a task of a several-task srun step (``srun -n 4 pytest ...``): the tests' launches, in this
    process and in the processes it starts, would be refused as srun tasks without torchrun (``SLURM_STEP_*``
    inherited): the step's task variables go; the job's stay."""
    from omnitron.core.training.launch import srun_task_variables

    for name in srun_task_variables(os.environ):
        del os.environ[name]


def pytest_unconfigure(config):
    folder = getattr(config, "_omnitron_runs", None)
    if folder:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def _xdist_threads() -> int | None:
    """Torch threads for one pytest-xdist worker: its share of the cores (None outside xdist, or where
    ``OMP_NUM_THREADS`` is set: the environment's choice stands)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, (os.cpu_count() or 1) // workers)


_THREADS = _xdist_threads()


def _share_the_cores() -> None:
    """Under ``-n N`` each worker runs torch on cores // N threads, and so do the processes it starts (through
    ``OMP_NUM_THREADS``). Torch's default is every core per process: two workers on 2 cores then run 4 spinning
    OpenMP threads, and a CPU-bound test took 6x its time (test_bert's train command: 56 s with a copy of
    itself beside it, 9 s with one thread each; 2026-12-05, this 2-core Xeon)."""
    if _THREADS is not None:
        import torch

        os.environ["OMP_NUM_THREADS"] = str(_THREADS)
        torch.set_num_threads(_THREADS)


@pytest.fixture(autouse=True)
def _threads_share():
    """A test that changed torch's threads in this process (``omnitron train`` sets them from the cores, a test
    sets 1) leaves the next test the count it found: with or without xdist, a later test's CPU sums (and so a
    chaotic training run's final loss) must not depend on which tests ran before it in the same process."""
    from omnitron.testing.threads import kept_torch_threads

    with kept_torch_threads():
        yield


@pytest.fixture(autouse=True)
def _kernel_pins_stay_in_their_test():
    """A test that pinned kernels (``monkeypatch.setenv("OMNITRON_KERNELS", ...)``) and resolved a backend's kernel
    table under the pin leaves that table cached on the backend instance after the pin is undone: later tests in the
    worker then ran the pinned kernels (the reference's, so kernel checks skipped as "compared with itself" and plan
    probes priced unfused ops). A table resolved under another value than the one now set is dropped."""
    yield
    from omnitron.backends import registry
    from omnitron.kernels.registry import ENV_VAR

    now = os.environ.get(ENV_VAR, "").strip()
    for backend in registry._instances.values():
        table = getattr(backend, "_kernel_table", None)
        if table is not None and table.env != now:
            backend._kernel_table = None


def _prepare_musa_double(name: str) -> None:
    """Where tests install the MUSA double in this process (cpu and musa-double sessions), name PrivateUse1
    ``musa`` now, before any backward: autograd sizes its device queues once, at the first backward. Not on
    other backends: a named PrivateUse1 becomes torch's accelerator (a cuda session would lose its own)."""
    if name in ("cpu", "musa-double") or os.environ.get("OMNITRON_TEST_MUSA_DOUBLE") == "1":
        from omnitron.testing import musa_double

        if musa_double.unavailable() is None:
            musa_double.prepare()
        extra = os.environ.get("OMNITRON_EXTRA_BACKENDS", "")
        if name == "musa-double" and musa_double.TARGET not in extra:  # spawned workers resolve it too
            os.environ["OMNITRON_EXTRA_BACKENDS"] = ",".join(filter(None, (extra, musa_double.TARGET)))


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
        if "gpu" in item.keywords and name in ("cpu", "sim",
                                               "musa-double"):  # sim (and the double over it) is simulated
            item.add_marker(skip_gpu)
        for marker, why in (("host_only", "host only on purpose"), ("device_port", "not yet ported to a device")):
            found = item.get_closest_marker(marker)
            if found is not None and name != "cpu":  # never silently: the reason is the skip's
                item.add_marker(pytest.mark.skip(reason=f"{why} ({name!r} not run): {found.args[0]}"))
