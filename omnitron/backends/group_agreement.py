"""Every rank creates the same process groups in the same order, or every rank stops in one line.

``torch.distributed.new_group`` must be called by every rank of the world with the same ranks, in the same
order, and it waits for its members with a timeout of its own: torch's default (30 minutes for gloo, 10 for
NCCL), not the job's ``--distributed-timeout-minutes``. One rank that creates a group the others do not (a
data-dependent branch, a setting read differently) made a two-rank gloo job wait with no output past 120 s,
until it was killed; given the job's timeout, it failed after it with "wait timeout after 5000ms, keys:
/default_pg/0//2//cpu//0/1" on one rank and a gloo send timeout on the other, naming no group.

:func:`agree` runs before each batch of creations (:meth:`Collectives.new_groups`), through the default
group's store, with O(world) traffic: every rank writes the digest of what it is about to create (the groups'
names and members, and torch's count of the groups made so far) under this batch's number, rank 0 compares them all and
writes the verdict, every rank reads it. A rank that does not arrive within the job's timeout, or arrives
with other groups, is named in one line (:class:`GroupCreationError`), the same on every rank that can read
the verdict; a rank that cannot (rank 0 itself never came) names the ranks missing from the store.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import time
from typing import Sequence

import torch.distributed as dist

_STATE: dict = {"world": None, "batch": 0, "limits": (None, None, None)}
"""The batch counter of the current default group (reset when a new one is initialised); ``(default group,
new groups' timeout, agreement's deadline)`` as the job set them (:func:`set_limits`)."""
VERDICT_MARGIN_S = 10.0
"""How much longer than the deadline the other ranks wait for rank 0's verdict (rank 0 waits the deadline itself,
then writes it: on a loaded host that takes a moment)."""
SHOWN = 8
"""Ranks and groups shown in a line; the rest are counted."""


class GroupCreationError(RuntimeError):
    """The ranks did not create the same process groups in time: one line naming the group and the ranks."""


def set_limits(timeout_s: float | None, limit_s: float | None = None) -> None:
    """``timeout_s``: each new group's timeout (the default group's: the collectives' timeout); ``limit_s``: how
    long a rank waits for the others at a creation (default ``timeout_s``; the job's
    ``--distributed-timeout-minutes``, shorter than its collectives' timeout, so that a rank gone on to a
    collective on a group the others never made is named here first). Called once the default group exists:
    they hold for it alone (a later default group, made by torch's own call, has its own timeout)."""
    _STATE["limits"] = (dist.group.WORLD, timeout_s, limit_s if limit_s is not None else timeout_s)


def release_groups() -> None:
    """Forget the default group held here, once it is destroyed (a held gloo group keeps its worker threads into
    the interpreter's finalization: see :func:`omnitron.backends.flight.release_groups`)."""
    _STATE.update(world=None, batch=0, limits=(None, None, None))


def _set(index: int) -> float | None:
    world, *values = _STATE["limits"]
    return values[index] if world is dist.group.WORLD else None


def _default_timeout_s() -> float:
    try:
        import torch

        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        return backend.options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - no host backend to ask: torch's default
        return dist.distributed_c10d.default_pg_timeout.total_seconds()


def limit_s() -> float:
    """Seconds a rank waits for the others at a group creation."""
    value = _set(1)
    return float(value) if value is not None else _default_timeout_s()


def timeout() -> datetime.timedelta:
    """The timeout a new group is given: the default group's (the job's), not torch's default for new groups."""
    value = _set(0)
    return datetime.timedelta(seconds=value if value is not None else _default_timeout_s())


def _next_batch() -> int:
    world = dist.group.WORLD
    if _STATE["world"] is not world:
        _STATE.update(world=world, batch=0)
    _STATE["batch"] += 1
    return _STATE["batch"]


def describe_groups(specs: Sequence[tuple[str, Sequence[int]]]) -> str:
    """``specs`` (name, members) in a short form: ``tp [0, 1] [2, 3]; dp [0, 2] [1, 3]``."""
    by_name: dict[str, list[str]] = {}
    for name, members in specs:
        m = list(members)
        shown = ", ".join(map(str, m[:SHOWN])) + (f", ... {len(m)} ranks" if len(m) > SHOWN else "")
        by_name.setdefault(name, []).append(f"[{shown}]")
    return "; ".join(f"{name} {' '.join(lists[:SHOWN])}{' ...' if len(lists) > SHOWN else ''}"
                     for name, lists in by_name.items())


def agree(specs: Sequence[tuple[str, Sequence[int]]]) -> None:
    """Before creating ``specs`` (name, members) on every rank of the world: GroupCreationError when a rank
    does not arrive within :func:`limit_s` or arrives with other groups; nothing when all agree (or one rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    rank, world, batch = dist.get_rank(), dist.get_world_size(), _next_batch()
    mine = {"groups": [[name, list(members)] for name, members in specs],
            "torch": dist.distributed_c10d._world.group_count}
    text = json.dumps(mine, sort_keys=True)
    key = f"omnitron/groups/{batch}/"
    digest = hashlib.sha256(text.encode()).hexdigest()
    what = f"process group creation #{batch} ({describe_groups(specs)})"
    late = (f" did not arrive within {limit_s():.0f} s (--distributed-timeout-minutes): every rank must create "
            f"the same groups in the same order")
    store.set(f"{key}here/{rank}", "1")
    if rank == 0:
        store.set(key + "digest/0", digest)
        keys = [f"{key}digest/{r}" for r in range(world)]
        missing = _wait(store, keys, limit_s())
        differ = [] if missing else [r for r, d in enumerate(store.multi_get(keys)) if d.decode() != digest]
        verdict = f"{what}: {_ranks(missing)} of {world}{late}" if missing else ""
        if differ:
            verdict = _differ_line(what, differ, world, mine, json.loads(store.get(f"{key}full/{differ[0]}")))
        store.set(key + "verdict", verdict)
    elif not _wait(store, [key + "digest/0"], limit_s()):
        if store.get(key + "digest/0").decode() != digest:  # before the digest: rank 0 reads it next
            store.set(f"{key}full/{rank}", text)
        store.set(f"{key}digest/{rank}", digest)
    if not store.check([key + "digest/0"]) or _wait(store, [key + "verdict"], limit_s() + VERDICT_MARGIN_S):
        missing = [r for r in range(world) if not store.check([f"{key}here/{r}"])]
        raise GroupCreationError(f"{what}: {_ranks(missing or [0])} of {world}{late}")
    verdict = store.get(key + "verdict").decode()
    if verdict:
        raise GroupCreationError(verdict)


def _differ_line(what: str, differ: list[int], world: int, first: dict, other: dict) -> str:
    """The line for ranks ``differ`` that are about to create other groups than rank 0 (``other``: ``differ[0]``'s)."""
    r = differ[0]
    theirs = describe_groups([(n, m) for n, m in other["groups"]])
    where = (f"rank {r} creates {theirs}" if other["groups"] != first["groups"] else
             f"the same groups, but rank {r} had made {other['torch']} process groups before them, rank 0 "
             f"{first['torch']}: a group made on some ranks only, outside omnitron's collectives")
    verb = "creates" if len(differ) == 1 else "create"
    return (f"{what}: {_ranks(differ)} of {world} {verb} other groups ({where}): every rank must create the same "
            f"groups in the same order")


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:SHOWN])) + (f" and {len(ranks) - SHOWN} more" if len(ranks) > SHOWN else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


def _wait(store, keys: list[str], limit: float) -> list[int]:
    """Poll for ``keys`` (check and sleep: a timed-out TCPStore wait prints C++ warnings) up to ``limit`` seconds;
    the indices of those still missing then (empty: all came)."""
    give_up, pause = time.monotonic() + limit, 0.005
    while not store.check(keys):
        if time.monotonic() >= give_up:
            return [i for i, k in enumerate(keys) if not store.check([k])]
        time.sleep(pause)
        pause = min(0.5, 2 * pause)
    return []
