"""``probing()`` from two threads at once: each probe runs with its own settings in place from entry to exit, and the
process's settings are back as they were once both are done (:data:`omnitron.plan.measure._PROBING`)."""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from omnitron.core.parallel.groups import host_backend
from omnitron.plan import measure

WAIT = 2.0
"""Seconds a thread waits for the other's step; a thread that waits this long goes on (so nothing hangs)."""


def _inside() -> tuple[str, bool, int]:
    """What a probe sees: the host's rms_norm kernel, whether ``F.dropout`` saves a boolean mask, the thread count."""
    return host_backend().kernels.resolved("rms_norm"), F.dropout is measure._dropout, torch.get_num_threads()


def test_two_threads_probing_keep_their_settings(reference_kernel_backend):
    """Thread A probes; thread B starts a probe while A's runs and looks at its settings only after A's probe has
    ended (or after ``WAIT`` s), on a backend whose kernel table the probes pin (every op its reference, where the
    host's resolves most to its C++ kernels) and whose dropout is fused (``F.dropout`` replaced). Each must see the
    reference kernels pinned, the mask-saving dropout and one thread, and afterwards the process its own settings.
    Without a lock B entered beside A, A's exit put back the settings from before both (B saw ``cpp`` and the host's
    dropout, 2026-12-07) and B's exit then put back A's (the pins and the replaced dropout stayed for good)."""
    table = host_backend().kernels
    threads, saved = torch.get_num_threads(), (table.pins, table._cache)
    dropout = F.dropout, F.scaled_dot_product_attention
    torch.set_num_threads(2)
    before = _inside()
    assert before == ("cpp", False, 2), "the host's rms_norm must resolve to its C++ kernel for this test to probe"
    a_in, a_out = threading.Event(), threading.Event()
    seen: dict[str, tuple] = {}

    def a():
        with measure.probing():
            a_in.set()
            seen["a"] = _inside()
            b_started.wait(WAIT)
        a_out.set()

    def b():
        a_in.wait(WAIT)
        b_started.set()
        with measure.probing():
            a_out.wait(WAIT)
            seen["b"] = _inside()

    b_started = threading.Event()
    try:
        workers = [threading.Thread(target=a), threading.Thread(target=b)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(4 * WAIT)
        assert not any(w.is_alive() for w in workers), "a probing thread hung"
        after = _inside()
        pins = dict(table.pins)
    finally:  # a failure must not leave its pins to the tests after it
        torch.set_num_threads(threads)
        table.pins, table._cache = saved
        F.dropout, F.scaled_dot_product_attention = dropout
    assert seen == {"a": ("reference", True, 1), "b": ("reference", True, 1)}
    assert after == before and pins == {}
