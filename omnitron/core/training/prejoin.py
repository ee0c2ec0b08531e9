"""Stop waiting for a peer that will never join: a rank refused before joining the job says so in the store.

Under torchrun a rank that fails before it joins (a bad flag seen late, a file missing on its node: the refusal of
:func:`omnitron.core.training.failures.refuse`) leaves its peers in :func:`~omnitron.core.training.workers.join_job`,
waiting for its ``arrived`` key. Before, they waited there until torchrun's agent sent SIGTERM, which the rank's
stop flag takes for "stop after this iteration" (a preemption during start-up stops the job cleanly before its
first iteration): the wait went on for 30 s, until the agent's SIGKILL; on another node, whose agent sends nothing,
up to the 300 s join wait. Now the refused rank posts its one line to the job's store (:func:`announce_failure`;
torchrun's agent hosts the store, so it is up whatever rank failed; or rank 0, where the agent does not share its
store, which rank 0 then hosts from its start, :func:`hosted_store`, and keeps up, refused itself, until its peers
have read its line), and every waiting rank, on any node, stops within a poll naming it (:func:`check_abandoned`).
A sibling on the same host that exits without a word (a crash) is seen by the census of
:class:`omnitron.core.training.workers._LocalSiblings`; a rank on any node that dies without a word, by the peer
holding its lifeline (:mod:`omnitron.core.training.lifeline`), which posts it here.
"""
from __future__ import annotations

import datetime
import os
import threading
import time

FIRST_KEY = "failed/first"
"""The store key holding the rank that failed first before joining (set once, by compare-and-set)."""
ANNOUNCE_TIMEOUT_S = 5.0
"""How long a refused rank tries to reach the store to post its line (a courtesy: its own stderr line stands; rank
0's store, where it hosts one, may not be up yet)."""
STAY_S = 300.0
"""How long a refused rank 0 that hosts the store keeps it up for its peers to read its line: their join wait."""
READ_POLL_S = 0.2
"""Seconds between a refused rank 0's looks at which peers have read its line."""


def attempt() -> int:
    """The restart attempt (torchrun's ``TORCHELASTIC_RESTART_COUNT``; 0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def prefixed(base):
    """``base`` (a TCPStore) seen with this attempt's key prefix, as every rank sees it."""
    import torch.distributed as dist

    return dist.PrefixStore(f"omnitron/attempt_{attempt()}/", base)


class PeerNeverJoined(RuntimeError):
    """This rank stopped waiting for its peers to join: one failed or exited before joining. A reaction to another
    rank's fault (``peer`` in :func:`omnitron.core.training.failures.classify`)."""


def job_store(timeout_s: float, rank: int | None = None):
    """A client of a torchrun job's store, with this attempt's key prefix: the one torchrun's agent hosts
    (``TORCHELASTIC_USE_AGENT_STORE=True``, the default of its static and c10d rendezvous: up whatever rank failed),
    or rank 0's where the agent leaves the store to it (``False``: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, etcd);
    the client waits up to ``timeout_s`` for the store to be up. For ``rank`` 0 in the second case, the store it
    hosts (:func:`hosted_store`). None outside torchrun (``--nproc-per-node`` checks settings in its launcher, before
    any worker starts)."""
    where = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
    if where not in ("True", "False") or "MASTER_PORT" not in os.environ:
        return None
    if where == "False" and rank == 0:
        return hosted_store(timeout_s)
    import torch.distributed as dist

    return prefixed(dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                  int(os.environ.get("WORLD_SIZE", "1")), False, datetime.timedelta(seconds=timeout_s)))


_hosted = None
"""Rank 0's store where it hosts the job's (:func:`hosted_store`): referenced for the process's life."""
_hosting = threading.Lock()


def hosted_store(timeout_s: float):
    """The job's store hosted by this process (rank 0 where torchrun's agent does not share its own), with this
    attempt's key prefix: started once, from the rank's start (its lifeline, :mod:`omnitron.core.training.lifeline`),
    so that its peers can read a refusal of rank 0's before it joins (they waited 300 s for a store that never came
    up); the join's :func:`~omnitron.core.training.workers.open_store` shares its server (``multi_tenant``)."""
    global _hosted
    import torch.distributed as dist

    with _hosting:
        if _hosted is None:
            _hosted = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                    int(os.environ.get("WORLD_SIZE", "1")), True,
                                    datetime.timedelta(seconds=timeout_s), multi_tenant=True, wait_for_workers=False)
        return prefixed(_hosted)


def post_failure(store, rank: int, line: str, own: bool = True) -> None:
    """``line`` as rank ``rank``'s reason for never joining (``own=False``: a peer's account of it, kept only where the
    rank posted none), and ``rank`` as the first failure where none is posted yet (later ones may be reactions)."""
    if own:
        store.set(f"failed/{rank}", line)
    else:
        store.compare_set(f"failed/{rank}", "", line)
    store.compare_set(FIRST_KEY, "", str(rank))


def announce_failure(rank: int, line: str) -> None:
    """Post ``line`` as rank ``rank``'s reason for never joining, in the job's store (:func:`job_store`). Rank 0
    hosting the store keeps it up until its peers have read the line (:func:`_stay_until_read`)."""
    try:
        store = job_store(ANNOUNCE_TIMEOUT_S, rank)
        if store is not None:
            post_failure(store, rank, line)
            if rank == 0 and _hosted is not None:
                _stay_until_read(store, int(os.environ.get("WORLD_SIZE", "1")))
    except Exception:  # noqa: BLE001  the store is gone or unreachable: the peers' own waits and signals apply
        pass


def _stay_until_read(store, world: int) -> None:
    """Rank 0, refused while it hosts the job's store: wait until every other rank has read its line (``read/<r>``,
    :func:`check_abandoned`) or posted a failure of its own (``failed/<r>``, its line or its watcher's), at most
    STAY_S (a peer that died before its lifeline was posted never does: then its peers' waits apply)."""
    left, give_up = set(range(1, world)), time.monotonic() + STAY_S
    while left and time.monotonic() < give_up:
        left = {r for r in left if not store.check([f"read/{r}"]) and not store.check([f"failed/{r}"])}
        time.sleep(READ_POLL_S if left else 0)


def check_abandoned(store, rank: int | None = None) -> None:
    """Raise :class:`PeerNeverJoined` naming the rank that posted its failure first (:func:`announce_failure`);
    ``rank``: this rank, which marks the line read (``read/<rank>``: a refused rank 0 hosting the store waits for
    that before it exits)."""
    if store.check([FIRST_KEY]):
        first = store.get(FIRST_KEY).decode()
        line = store.get(f"failed/{first}").decode()
        if rank is not None:
            store.set(f"read/{rank}", "1")
        raise PeerNeverJoined(f"rank {first} failed before joining the job: {line}")


def store_gone(err: BaseException, launcher: bool) -> str:
    """The line for a store that failed under a rank waiting in the join: its host ended (``launcher``: the
    ``--nproc-per-node`` launcher; else rank 0, or the torchrun agent hosting the rendezvous: node 0's under a static
    one, any node's under c10d)."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if launcher:
        return f"the job's store is gone ({first}): its host, the launcher, ended before every rank joined"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # the agent hosting the rendezvous (c10d: any node)
        return (f"the job's store is gone ({first}): its host, the torchrun agent at {os.environ.get('MASTER_ADDR')}:"
                f"{os.environ.get('MASTER_PORT')}, ended before every rank joined; that node's log says why")
    return (f"the job's store is gone ({first}): its host, rank 0, ended before every rank joined; rank 0's node's "
            "log says why")
