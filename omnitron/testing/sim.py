"""Test helpers for the simulated accelerator: skip with the build command when omnitron._sim is missing."""
from __future__ import annotations


def sim_unavailable() -> str | None:
    """None when the sim backend can run here, else the one-line reason (names the build command).
    Probing loads nothing: the calling process keeps PrivateUse1 free."""
    from omnitron.backends.sim.backend import SimBackend

    ok, why = SimBackend.probe()
    return None if ok else why


def requires_sim():
    """``pytest.mark.skipif`` for tests that need the sim backend (they run it in spawned workers)."""
    import pytest

    why = sim_unavailable()
    return pytest.mark.skipif(why is not None, reason=f"sim backend unavailable: {why}")
