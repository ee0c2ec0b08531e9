"""A torchrun rank's lifeline: its peers learn within a poll that it died before joining the job, on any node.

A rank killed before it joins (SIGKILL, the out-of-memory killer, a crash in native code) posts nothing, and its
node's torchrun agent, which sees the exit, tells no other node (a static rendezvous writes nothing on a failure:
the agent stops its workers and exits). Its siblings on the same host see it go (the census of
:class:`omnitron.core.training.workers._LocalSiblings`); a rank on another node waited for its ``arrived`` key for
the whole join wait (300 s). A heartbeat in the store would not do better within a poll: a missed beat is also what
a loaded or frozen rank shows.

So each torchrun rank, from the start of ``omnitron train``, ``generate`` or ``serve`` (:func:`hold`, called by
:func:`omnitron.cli.main` before it parses: a sharded inference job joins as training does), listens on a port of
its own and posts the address (``lifeline/<rank>``, with its pid and host) in the job's store
(:func:`omnitron.core.training.prejoin.job_store`; rank 0, where it hosts the store, starts it here, so that its
peers can read its refusal and see its death: :func:`~omnitron.core.training.prejoin.hosted_store`); rank ``r``
connects to rank ``r + 1``'s (mod the world) and
holds the connection until its own join is done (:func:`release`). The kernel closes a process's sockets however it
ends, so a death ends the connection (or refuses it) at once, and the watcher posts it as that rank's failure before
joining (:func:`omnitron.core.training.prejoin.post_failure`, kept only where the rank posted no line of its own):
every rank's join wait stops within a poll naming the rank and its host
(:func:`~omnitron.core.training.prejoin.check_abandoned`). A frozen rank keeps its connection (no false alarm: the
join wait, and the census for local siblings, apply).

Not covered (the join wait applies): a rank killed before its lifeline is posted (its interpreter's and torch's
imports: 1.5-2 s of CPU, 4-7 s on a loaded 2-core machine), one whose watcher died too, and a host gone without
closing its connections (power lost). Nothing else tells them: a torchrun agent whose worker died stops its node and
exits, and the other nodes' agents hear nothing (the static rendezvous writes nothing; c10d's marks the rendezvous
closed in its store, but the other agents' monitoring asks only for nodes waiting to join, and the state is a
pickle, which the ranks do not read). Where the dead rank's node hosted the store (node 0's agent under a static
rendezvous, rank 0 where it hosts it), its peers' store calls fail as it goes, said in one line
(:func:`omnitron.core.training.prejoin.store_gone`). The connection needs what gloo and NCCL need between nodes
anyway: any port of one rank's host reachable from another's.
"""
from __future__ import annotations

import json
import os
import socket
import threading

from omnitron.core.training import prejoin

POLL_S = 1.0
"""Seconds between the watcher's looks at its stop flag and at the store (while the peer has posted no address)."""
CONNECT_S = 5.0
"""How long the watcher tries to connect to its peer's lifeline; a peer it cannot reach is not watched."""
STORE_S = 300.0
"""The watcher's store client's wait for the store (torchrun's agent hosts it: up before any rank starts; rank 0,
where the agent does not share its store, from its lifeline on: its start, :func:`prejoin.hosted_store`)."""


class Lifeline:
    """Rank ``rank``'s listening socket (open until the process ends) and the thread that posts its address and
    watches rank ``rank + 1``'s (see the module docstring)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.info = f"pid {os.getpid()} on {socket.gethostname()}"
        self.listener: socket.socket | None = None  # made by the thread (a name lookup must not hold the rank up)
        self.posted, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="omnitron-lifeline", daemon=True)

    def start(self) -> Lifeline:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (this rank has joined: the watchdog covers its peers now). The listener stays open until the
        process ends: a peer still in its join would take its closing for this rank's death."""
        self._stop.set()

    def _run(self) -> None:
        try:
            family, address = _own_address()
            self.listener = socket.create_server(("", 0), family=family, backlog=16)  # never accepted: see _gone
            store = prejoin.job_store(STORE_S, self.rank)  # rank 0 hosting the job's store: hosts it from here
            where = {"host": address, "port": self.listener.getsockname()[1], "info": self.info}
            store.set(f"lifeline/{self.rank}", json.dumps(where))
            self.posted.set()
            self._watch(store, (self.rank + 1) % self.world)
        except Exception:  # noqa: BLE001  best effort: a store or socket error leaves the join's own waits to act
            pass

    def _watch(self, store, peer: int) -> None:
        """Wait for ``peer``'s address, hold a connection to it; post its death when the connection ends."""
        key = f"lifeline/{peer}"
        while not store.check([key]):
            if self._stop.wait(POLL_S):
                return
        where = json.loads(store.get(key).decode())
        try:
            conn = socket.create_connection((str(where["host"]), int(where["port"])), timeout=CONNECT_S)
        except ConnectionRefusedError:  # its address is posted, nothing listens: the process is gone
            conn = None
        except OSError:  # unreachable or slow to answer: not a death, no watch
            return
        if conn is not None:
            with conn:
                conn.settimeout(POLL_S)
                while not _gone(conn):
                    if self._stop.is_set():
                        return
        if not self._stop.is_set():
            prejoin.post_failure(store, peer, f"it exited without a word ({where.get('info', 'pid unknown')}): "
                                 "killed (SIGKILL, the out-of-memory killer) or crashed; its node's log says why",
                                 own=False)


def _gone(conn: socket.socket) -> bool:
    """Whether the peer's end of ``conn`` closed, waiting up to its timeout. The peer never accepts, so the
    connection waits in its listener's queue: its process's end resets it (or, accepted, closes it)."""
    try:
        return conn.recv(1) == b""  # the peer never sends: data is no sign of anything
    except (socket.timeout, BlockingIOError):
        return False
    except OSError:  # reset by the peer's kernel
        return True


def _own_address() -> tuple[int, str]:
    """``(family, address)`` of this host as the store's host reaches it: the interface a datagram to
    ``MASTER_ADDR`` would leave by (a UDP connect sends nothing)."""
    family, _, _, _, addr = socket.getaddrinfo(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                               type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(addr)
        return family, probe.getsockname()[0]


_held: Lifeline | None = None
"""This process's lifeline: kept referenced so that its listener stays open until the process ends."""


def hold() -> None:
    """Start this rank's lifeline once, where it applies: a torchrun rank of a job of several (``RANK``,
    ``WORLD_SIZE`` > 1, ``TORCHELASTIC_USE_AGENT_STORE`` set: :func:`prejoin.job_store`); its thread does the work
    (a socket or store error leaves the join's waits to act)."""
    global _held
    env = os.environ
    if _held is not None or "RANK" not in env or int(env.get("WORLD_SIZE", "1") or 1) < 2 \
            or env.get("TORCHELASTIC_USE_AGENT_STORE") not in ("True", "False") or "MASTER_PORT" not in env:
        return
    try:
        _held = Lifeline(int(env["RANK"]), int(env["WORLD_SIZE"])).start()
    except ValueError:  # a RANK that is no number: the launch's own checks say so
        pass


def release() -> None:
    """This rank has joined: its lifeline stops watching (the listener stays open, see :meth:`Lifeline.stop`)."""
    if _held is not None:
        _held.stop()
