"""Strict mode's own point-to-point must be NCCL-safe: the groups it issues (``dist.batch_isend_irecv`` calls,
logged in each rank) are replayed under a model of NCCL's rule, and a correct program's replay must finish.

The model (``omnitron.testing.nccl_groups.replay``): each rank's groups on a communicator run one after another,
as on one stream; an operation completes when it and its partner are both in the group at the head of their rank's
stream; a group completes when all its operations have; the k-th send from rank a to rank b pairs with the k-th
receive on b from a (NCCL ignores tags: a header paired with a payload is an error). It assumes every payload is too
large for NCCL's buffers (the worst case: a send waits for its receive), so a program that finishes here finishes on
NCCL at any size. The host transports' shape (each send its own {header, payload} group, a payload receive posted once
its header was checked) deadlocks here; it was the shape on every backend before the device libraries got one group
per batch (``Collectives(p2p_groups_in_order=True)``)."""
from __future__ import annotations

import pytest

import strict_group_cases
from omnitron.testing.distributed import run_distributed
from omnitron.testing.nccl_groups import replay

pytestmark = pytest.mark.multiprocess


def test_replay_model_catches_a_crossed_exchange():
    """The model itself: two ranks that each send before receiving, as separate groups, deadlock; batched, they do
    not (hand-derived)."""
    crossed = [[[("send", 1, 0)], [("recv", 1, 0)]], [[("send", 0, 0)], [("recv", 0, 0)]]]
    assert replay(crossed).startswith("deadlock")
    assert replay([[[("send", 1, 0), ("recv", 1, 0)]], [[("recv", 0, 0), ("send", 0, 0)]]]) is None
    assert "pairs tag" in replay([[[("send", 1, 1), ("send", 1, 0)]], [[("recv", 0, 0), ("recv", 0, 1)]]])


def _run(monkeypatch, fn, *args, world: int = 2) -> list:
    monkeypatch.setenv("OMNITRON_STRICT_COLLECTIVES", "1")
    monkeypatch.setenv("OMNITRON_STRICT_TIMEOUT_S", "20")
    return run_distributed(fn, world, *args, timeout_s=120)


def test_symmetric_exchange_is_nccl_safe(monkeypatch):
    out = _run(monkeypatch, strict_group_cases.symmetric, True)
    assert replay([o["groups"] for o in out]) is None, [o["groups"] for o in out]
    for me in (0, 1):  # each buffer holds exactly what the peer sent into that slot
        want = [[100.0 * (1 - me) + 10 * i + s] for i in range(3) for s in (0, 1)]
        assert out[me]["got"] == want, out[me]["got"]


def test_host_shape_is_not_nccl_safe(monkeypatch, backend_name):
    """Why the device libraries need the fused shape: the host transports' one (which gloo runs, as each of its
    operations progresses on its own) deadlocks under the model, and pairs a header with a payload (NCCL ignores
    the tags that keep them apart on gloo). Sim runs NCCL's rules itself: the run fails with its own line."""
    if backend_name == "sim":
        with pytest.raises(RuntimeError, match="sim: point-to-point (group deadlock|tag mismatch)"):
            _run(monkeypatch, strict_group_cases.symmetric, False)
        return
    out = _run(monkeypatch, strict_group_cases.symmetric, False)
    verdict = replay([o["groups"] for o in out])
    assert verdict is not None and ("deadlock" in verdict or "pairs tag" in verdict), verdict


def test_fused_shape_mismatch_names_both_sites(monkeypatch):
    """A shape that differs at one size reaches the receiver in the fused group; its header check raises naming
    both call sites."""
    out = _run(monkeypatch, strict_group_cases.transposed_shape)
    assert out[0] == "no error", out
    assert "receives shape=[3, 2] dtype=float32 from rank 0" in out[1] and "rank 0 sends shape=[2, 3]" in out[1], out
    assert out[1].count("strict_group_cases.py:") == 2, out  # the receive's call site and the send's


@pytest.mark.parametrize("name,vp", [("1f1b", 1), ("interleaved", 2), ("zb-v", 2)])
def test_pipeline_steady_state_is_nccl_safe(monkeypatch, name, vp):
    out = _run(monkeypatch, strict_group_cases.pipeline, name, 2, vp, 4)
    logs = [o["groups"] for o in out]
    assert any(len({k for k, _, _ in ops}) == 2 for ops in logs[0]), logs[0]  # a symmetric group occurs
    assert replay(logs) is None, logs
    assert [o["wrong"] for o in out] == [[], []]
