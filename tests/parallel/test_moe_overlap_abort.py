"""A combined pair whose forward fails (``--overlap-moe-expert-parallel-comm``): the backward paused at its
hand-over raises there and runs no further (no more of its all-to-alls are issued, no more gradient is written),
its thread ends, and the caller gets the forward's error. Reference: the order of the passes' steps recorded by the
test (the hand-over protocol of omnitron/core/transformer/moe/overlap.py)."""
from __future__ import annotations

import threading


def test_a_failed_forward_stops_the_paused_backward_where_it_paused():
    from omnitron.core.transformer.moe import overlap

    done, ran = [], []

    def backward():
        try:
            for i in range(4):
                ran.append(f"B{i}")
                overlap.handoff()  # an all-to-all issued: the forward runs
        finally:
            done.append(threading.current_thread().name)

    def forward():
        ran.append("F0")
        overlap.handoff()
        raise ValueError("F failed")

    before = threading.active_count()
    raised = []

    def pair():
        try:
            overlap.run_combined(forward, backward)
        except ValueError as err:
            raised.append(str(err))

    caller = threading.Thread(target=pair, daemon=True)  # a hung hand-over fails the test instead of hanging it
    caller.start()
    caller.join(timeout=60)
    assert not caller.is_alive(), f"the pair hung after its forward failed; steps run: {ran}"
    assert raised == ["F failed"]
    # B0 runs first (Megatron's order), F0, B1, then F fails: B stops at its second hand-over
    assert ran == ["B0", "F0", "B1"]
    assert done == ["omnitron-combined-backward"] and threading.active_count() <= before + 1  # + the caller
    assert overlap._active is None
