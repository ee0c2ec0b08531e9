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


@pytest.mark.multiprocess
def test_staged_p2p_and_call_sites_on_sim():
    """Found on the H200 (2026-12-04): a staged receive buffer made with a bare ``torch.empty`` landed on the
    device under ``torch.set_default_device`` and reached gloo as device memory ("Bad address" on CUDA; a
    wrong-device error on sim), and the flight recorder named staged.py as every call's site. Here both
    ranks' batched send/receive delivers the peer's value, and the recorded sites are the caller's lines."""
    pytest.importorskip("omnitron._sim")
    import strict_cases

    env = {staged.ENV_VAR: "host-staged", "OMNITRON_STRICT_COLLECTIVES": "1"}
    got = run_distributed(strict_cases.send_recv_batched, 2, backend="sim", timeout_s=120, env=env)
    assert got == [1.0, 0.0]
    for lines in run_distributed(strict_cases.recorder_lines, 2, backend="sim", timeout_s=120, env=env):
        engine = [line for line in lines if line.startswith("#")]
        assert "all_reduce" in engine[-2] and "strict_cases.py" in engine[-2], engine
        assert not any("staged.py" in line for line in engine), engine
