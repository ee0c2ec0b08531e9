"""``OMNITRON_COLLECTIVES=host-staged``: a device backend's collectives over gloo through host copies.

The collective conformance suite (every collective, fp32/bf16/fp16 and FP8, subgroups, p2p, values
checked against sums computed in the test) runs on `sim` device tensors with the transport swapped, so
the path the lent GPU uses for several ranks on one device (benchmarks/device_multirank.py) is proven here.
"""
from __future__ import annotations

import pytest

from backend_collective_checks import collective_suite
from omnitron.backends import registry, staged
from omnitron.testing.distributed import run_distributed


@pytest.mark.multiprocess
def test_collective_suite_host_staged_on_sim():
    pytest.importorskip("omnitron._sim")
    results = run_distributed(collective_suite, 2, backend="sim", timeout_s=240,
                              env={staged.ENV_VAR: "host-staged", "OMNITRON_STRICT_COLLECTIVES": "1"})
    for r in results:
        assert (r["backend"], r["dist_backend"]) == ("sim", "gloo")
    assert results[0]["checks"] == results[1]["checks"] and len(results[0]["checks"]) > 40


def test_unknown_mode_is_one_line(monkeypatch):
    monkeypatch.setenv(staged.ENV_VAR, "shared-memory")
    registry.reset_cache()
    try:
        with pytest.raises(registry.BackendUnavailableError, match="OMNITRON_COLLECTIVES='shared-memory'.*host-staged"):
            registry.get_backend("cpu")
    finally:
        registry.reset_cache()


def test_native_mode_keeps_the_backend_class():
    from omnitron.backends.cpu import CPUBackend

    assert staged.apply(CPUBackend) is CPUBackend
