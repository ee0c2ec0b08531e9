"""A free TCP port for a server a test starts in another process (torchrun's agent, a rank hosting the store).

A port the OS gave to a bind of port 0 and that was closed again is one of its ephemeral ports: until the server
binds it, any process's outgoing connection (a gloo pair, a store client, another test's job) may be given it, and
the server fails with EADDRINUSE while its peers wait. So the port is drawn below the ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), which outgoing connections never use, and checked free by binding it;
two tests drawing the same one at once is the one race left (one draw in thousands, checked by the bind).
"""
from __future__ import annotations

import random
import socket

LOWEST = 10000
"""The lowest port drawn (below: well-known and registered services)."""
DEFAULT_EPHEMERAL = (32768, 60999)
"""Linux's default ephemeral range, used where the OS does not say."""


def ephemeral_range() -> tuple[int, int]:
    """The OS's ephemeral port range (Linux's file; its default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def free_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A port below the ephemeral range on which nothing listens or lingers on ``host`` now (a bind succeeds)."""
    low = ephemeral_range()[0]
    if low - LOWEST < 1000:
        raise RuntimeError(f"the ephemeral port range starts at {low}: no room below it for a test's server")
    draw = random.Random()  # seeded from os.urandom: tests started together draw apart
    for _ in range(tries):
        port = draw.randrange(LOWEST, low)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {LOWEST}-{low - 1} after {tries} tries")
