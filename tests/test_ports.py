"""The tests' free port for a server in another process: below the OS's ephemeral range, and free."""
from __future__ import annotations

import socket

import pytest

from omnitron.testing import ports


def test_a_drawn_port_is_below_the_ephemeral_range_and_bindable():
    """Each draw lies in [LOWEST, the range's start) as /proc says (an outgoing connection is never given it), and a
    server can bind it."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    for _ in range(20):
        port = ports.free_port()
        assert ports.LOWEST <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_taken_port_is_never_drawn(monkeypatch):
    """With the draw forced onto a port something listens on, then onto a free one, the free one comes back; a range
    with no room below it is refused in a line."""
    with socket.socket() as taken, socket.socket() as freed:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        freed.bind(("127.0.0.1", 0))
        busy, free = taken.getsockname()[1], freed.getsockname()[1]
        freed.close()  # free again: bound a moment ago, so nothing else held it
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (60999, 61000))
        draws = iter([busy, busy, free])
        monkeypatch.setattr(ports.random.Random, "randrange", lambda self, a, b: next(draws))
        assert ports.free_port() == free
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports.LOWEST + 10, 60999))
    with pytest.raises(RuntimeError, match="no room below it"):
        ports.free_port()
