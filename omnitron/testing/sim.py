"""Test helpers for the simulated accelerator: skip with the build command when omnitron._sim is missing."""
from __future__ import annotations


def sim_unavailable() -> str | None:
    """None when the sim backend can run in spawned workers here, else the one-line reason (names the build
    command). Loads nothing. Only the build matters: workers are fresh processes, so it does not matter that
    the calling process may have named PrivateUse1 ``musa`` for the MUSA test double."""
    from omnitron.backends.sim import device as sim_device

    return None if sim_device.extension_built() else f"omnitron._sim is not built; {sim_device.BUILD_HINT}"


def requires_sim():
    """``pytest.mark.skipif`` for tests that need the sim backend (they run it in spawned workers)."""
    import pytest

    why = sim_unavailable()
    return pytest.mark.skipif(why is not None, reason=f"sim backend unavailable: {why}")
