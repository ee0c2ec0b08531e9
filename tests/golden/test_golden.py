"""Golden loss curves (omnitron.testing.golden): the fixed tiny GPT's 100 losses on each backend against the
loss file recorded for it. cpu, sim and the MUSA double are deterministic (the same run twice gives the same
bits), so where this environment (torch minor, CPU capability, device, host CPU) has a record the curve must match it
bitwise; elsewhere, and on cuda (atomics in backward kernels order sums differently run to run), within
golden.REL_BOUND relative of the backend's nearest record (the error analysis is beside the bound).
A miss prints the first step that moved. Regenerate: python -m omnitron.testing.golden cpu sim musa-double."""
from __future__ import annotations

import pytest

from omnitron.testing import golden
from omnitron.testing.sim import requires_sim

DETERMINISTIC = ("cpu", "sim", "musa-double")


def check_against_golden(backend: str) -> None:
    """Train the golden model on ``backend`` and hold its curve to the backend's records."""
    records = golden.load(backend)
    if not records:
        pytest.skip(f"no golden record for {backend}; record one: python -m omnitron.testing.golden {backend}")
    result = golden.run(backend)
    assert len(result["losses"]) == golden.STEPS
    moved = golden.compare(backend, result, records, bitwise=backend in DETERMINISTIC)
    assert moved is None, moved


@pytest.mark.multiprocess
def test_golden_cpu():
    check_against_golden("cpu")


@requires_sim()
@pytest.mark.multiprocess
def test_golden_sim():
    check_against_golden("sim")


@requires_sim()
@pytest.mark.multiprocess
def test_golden_musa_double():
    check_against_golden("musa-double")


@pytest.mark.gpu
@pytest.mark.multiprocess
def test_golden_cuda():
    check_against_golden("cuda")


def test_records_round_trip(tmp_path):
    """A saved curve loads back bit for bit, and saving a second environment keeps the first."""
    import random

    losses = [random.uniform(1.0, 5.0) for _ in range(golden.STEPS)]  # fresh values: exact hex round trip
    first = {"environment": {"torch": "0.0", "cpu_capability": "X", "device": "a"}, "losses": losses}
    second = {"environment": {"torch": "0.1", "cpu_capability": "X", "device": "a"}, "losses": losses[::-1]}
    golden.save("cpu", first, str(tmp_path))
    golden.save("cpu", second, str(tmp_path))
    golden.save("cpu", first, str(tmp_path))  # replaces its own record
    assert golden.load("cpu", str(tmp_path)) == [second, first]


def test_compare_sees_a_moved_curve():
    """compare() is bitwise against the same environment's record, within the bound otherwise, and names
    the first step that moved."""
    import random

    env = {"torch": "0.0", "cpu_capability": "X", "device": "a"}
    want = [random.uniform(1.0, 5.0) for _ in range(golden.STEPS)]
    records = [{"environment": env, "losses": want}]
    step = random.randrange(golden.STEPS)
    near = [w * (1 + golden.REL_BOUND / 2) if i == step else w for i, w in enumerate(want)]
    far = [w * (1 + 2 * golden.REL_BOUND) if i >= step else w for i, w in enumerate(want)]
    other = {"torch": "0.1", "cpu_capability": "X", "device": "a"}
    assert golden.compare("cpu", {"environment": env, "losses": want}, records, bitwise=True) is None
    assert f"step {step + 1}:" in golden.compare("cpu", {"environment": env, "losses": near}, records, bitwise=True)
    assert golden.compare("cpu", {"environment": other, "losses": near}, records, bitwise=True) is None
    assert f"step {step + 1}:" in golden.compare("cpu", {"environment": env, "losses": far}, records, bitwise=False)


def test_compare_without_bitwise_uses_the_bound_and_names_the_nearest_record():
    """A non-deterministic backend (cuda: bitwise=False) is held within the bound even where its own environment
    has a record, and a miss names the record nearest to the curve, not another one."""
    import random

    env, other = {"torch": "0.0", "cpu_capability": "X", "device": "a"}, {"torch": "0.1", "cpu_capability": "X",
                                                                          "device": "a"}
    want = [random.uniform(1.0, 5.0) for _ in range(golden.STEPS)]
    step = random.randrange(golden.STEPS)
    near = [w * (1 + golden.REL_BOUND / 2) if i == step else w for i, w in enumerate(want)]
    assert golden.compare("cuda", {"environment": env, "losses": near}, [{"environment": env, "losses": want}],
                          bitwise=False) is None
    far = [w * (1 + 3 * golden.REL_BOUND) for w in want]  # 3 bounds from ``want``, 17 from ``farther``
    farther = [w * (1 - 17 * golden.REL_BOUND) for w in want]
    records = [{"environment": other, "losses": farther}, {"environment": env, "losses": want}]
    moved = golden.compare("cuda", {"environment": env, "losses": far}, records, bitwise=False)
    assert moved is not None and f"nearest golden curve ({env})" in moved, moved
