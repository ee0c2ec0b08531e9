"""Conformance: every collective at 2 and 4 processes, fp32/bf16/fp16 and FP8, values checked.

One spawned run per (backend, world size) carries all checks (see backend_collective_checks).
GPU backends need one device per rank; with fewer devices the world size is skipped.
"""
from __future__ import annotations

import pytest

from backend_collective_checks import collective_suite
from omnitron.testing.distributed import run_distributed


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_collectives(suite_backend, world):
    be = suite_backend
    if be.device_type != "cpu" and be.device_count() < world:
        pytest.skip(f"{be.name}: {world} ranks need {world} devices, {be.device_count()} visible")
    results = run_distributed(collective_suite, world, backend=be.name, timeout_s=240)
    assert [r["rank"] for r in results] == list(range(world))
    names = results[0]["checks"]
    for r in results:
        assert r["checks"] == names, f"rank {r['rank']} ran different checks"
        assert r["dist_backend"] == be.dist_backend and r["backend"] == be.name
        assert r["fp8_native"] == be.collectives.fp8_native
    expected_float = 3 * (13 + world)  # per float dtype: 13 checks + one all_gather_list entry per rank
    assert len(names) == expected_float + 2 * 4 + 1, names
