"""Strict collective checking (``OMNITRON_STRICT_COLLECTIVES=1``): planted faults that gloo forgives are
caught on CPU, in bounded time, with a message naming the call sites, as NCCL would (by hanging)."""
from __future__ import annotations

import pytest

import strict_cases
from omnitron.testing.distributed import run_distributed

pytestmark = pytest.mark.multiprocess


def _site(code: str) -> str:
    """``strict_cases.py:LINE (function)`` of the first line of strict_cases.py containing ``code``."""
    import inspect

    fn = None
    for no, text in enumerate(inspect.getsource(strict_cases).splitlines(), 1):
        if text.startswith("def "):
            fn = text[4:text.index("(")]
        if code in text:
            return f"strict_cases.py:{no} ({fn})"
    raise AssertionError(code)


def _fails(fn, monkeypatch, timeout_s: float = 5.0, ranks=(0, 1)) -> tuple[str, float]:
    """Every rank in ``ranks`` got an error; returns their messages joined and the slowest detection time."""
    monkeypatch.setenv("OMNITRON_STRICT_COLLECTIVES", "1")
    monkeypatch.setenv("OMNITRON_STRICT_TIMEOUT_S", str(timeout_s))
    out = run_distributed(strict_cases.caught, 2, fn.__name__, timeout_s=120)
    for r in ranks:
        assert "error" in out[r], f"rank {r}: strict mode missed the fault: {out[r]}"
    return "\n".join(o.get("error", "") for o in out), max(o["seconds"] for o in out)


def test_different_shape_names_both_sites(monkeypatch):
    msg, took = _fails(strict_cases.different_shape, monkeypatch)
    assert took < 30, took
    assert "issued different collectives" in msg
    assert "all_reduce #3 shape=[8]" in msg and "all_reduce #3 shape=[9]" in msg  # #1: the start barrier
    # both ranks' call sites, reported by both ranks
    assert msg.count(_site("torch.ones(8 + dist.get_rank())")) >= 2, msg


def test_skipped_collective_names_both_sites(monkeypatch):
    msg, took = _fails(strict_cases.skipped_collective, monkeypatch)
    assert took < 30, took
    assert "broadcast #2" in msg and "all_reduce #2" in msg, msg
    assert _site("coll.broadcast(torch.ones(3)") in msg and _site("coll.all_reduce(torch.ones(3))") in msg


def test_receive_before_send_deadlocks_under_nccl_order(monkeypatch, backend_name):
    """Strict mode's bounded wait names both pending receives; sim's communicator sees the two batches head its
    queues first (csrc/sim/group_order.cpp) and names both, each at the test's own line (not the plumbing's)."""
    msg, took = _fails(strict_cases.recv_before_send, monkeypatch, timeout_s=3)
    assert took < 30, took
    if backend_name == "sim":  # a rank may see its peer's exit (connection closed) before its own report
        assert "sim: point-to-point group deadlock" in msg, msg
        assert "rank 0's batch #1 (receives #1" in msg and "rank 1's batch #1 (receives #1" in msg, msg
        assert "flight.py" not in msg, msg
    else:
        assert "deadlock under NCCL's rules" in msg, msg
        for r in (0, 1):  # each rank prints its own and its peer's pending receive
            assert f"rank {r} (this rank) waits on: recv shape=[5]" in msg, msg
    assert _site('[("recv", got, peer)])') in msg


def test_a_peer_closing_after_its_timeout_still_gets_both_reports(monkeypatch):
    """The rank whose connection closes (its peer timed out first) reports like the one that timed out, and
    stays until the peer has read its report: each message names both ranks' pending receives."""
    msg, took = _fails(strict_cases.peer_closes_after_its_timeout, monkeypatch, timeout_s=3)
    assert took < 30, took
    assert "deadlock under NCCL's rules" in msg and "a peer closed the connection" in msg, msg
    for me in (0, 1):
        assert f"rank {me} (this rank) waits on: recv shape=[5] from rank {1 - me}" in msg, msg
        assert f"rank {me} waits on: recv shape=[5] from rank {1 - me}" in msg, msg  # as the peer reports it


@pytest.mark.host_only("gloo's tag matching completes it; sim runs NCCL's order and reports the deadlock "
                       "without strict mode too (tests/sim/test_sim_group_order.py)")
def test_receive_before_send_passes_on_gloo_without_strict(monkeypatch):
    """The same schedule completes on gloo's tag matching: the checker, not gloo, is what catches it."""
    monkeypatch.setenv("OMNITRON_STRICT_COLLECTIVES", "0")
    assert run_distributed(strict_cases.recv_before_send, 2, timeout_s=60) == ["received 1.0", "received 0.0"]


def test_batched_send_receive_passes_strict(monkeypatch):
    monkeypatch.setenv("OMNITRON_STRICT_COLLECTIVES", "1")
    assert run_distributed(strict_cases.send_recv_batched, 2, timeout_s=60) == [1.0, 0.0]


def test_strict_p2p_frees_its_buffers_without_the_cyclic_collector(monkeypatch):
    """Once waited, a strict p2p op holds none of its tensors: the caller's last reference frees them at once, as
    without strict mode (the reference). Before the fix each op and its batch referred to each other, so every
    buffer a pipeline sent or received lived until Python's cyclic collector ran."""
    for strict in ("0", "1"):
        monkeypatch.setenv("OMNITRON_STRICT_COLLECTIVES", strict)
        assert run_distributed(strict_cases.p2p_buffers_freed, 2, timeout_s=60) == [[False, False]] * 2, strict


def test_p2p_shape_mismatch_names_both_sites(monkeypatch, backend_name):
    """The receiver's header check names both shapes and sites; on sim the sizes differ too, and the communicator
    compares them before the payload runs (csrc/sim/pair_order.cpp), naming both ops at the test's own lines."""
    msg, took = _fails(strict_cases.p2p_shape_mismatch, monkeypatch, ranks=(1,))  # the receiver detects it
    assert took < 30, took
    if backend_name == "sim":
        assert "sim: point-to-point size mismatch" in msg, msg
        assert "send shape=[6] dtype=Float to rank 1" in msg and "recv shape=[5] dtype=Float from rank 0" in msg, msg
    else:
        assert "receives shape=[5] dtype=float32 from rank 0" in msg and "rank 0 sends shape=[6]" in msg, msg
    assert _site("coll.send(torch.ones(6)") in msg and _site("coll.recv(torch.empty(5)") in msg


@pytest.mark.parametrize("strict", ["0", "1"])
def test_flight_recorder_dump(monkeypatch, strict):
    monkeypatch.setenv("OMNITRON_STRICT_COLLECTIVES", strict)
    for lines in run_distributed(strict_cases.recorder_lines, 2, timeout_s=60):
        lines = [line for line in lines if line.startswith("#")]  # the engine's (on sim, simccl's records follow)
        assert "all_reduce ranks=[0, 1] shape=[2, 3] dtype=float32" in lines[-2], lines
        assert lines[-2].endswith(_site("coll.all_reduce(torch.ones(2, 3))")), lines
        assert "broadcast ranks=[0, 1] shape=[4] dtype=float64 src=0" in lines[-1], lines
