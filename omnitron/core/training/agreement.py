"""Every rank of a job runs the same settings: nodes started with different flags stop in one line, before any work.

Megatron trusts each node's command line: two nodes started with a different ``--seed`` train silently wrong (the
data-parallel replicas start from different weights and drift apart), and a different
``--tensor-model-parallel-size`` builds different process groups, whose creation then waits with no timeout (a
two-node torchrun job of tp 2 on one node and tp 1 on the other printed nothing for 200 s, until it was killed).
:func:`check_same_settings` compares the ranks' settings through the rendezvous store, with O(world) traffic, as
each rank joins the job (:func:`omnitron.core.training.workers.join_job`), before the process group exists:

- once every rank has arrived, each writes the digest of its settings (``settings/digest/R``), rank 0 first; a
  rank whose digest differs from rank 0's writes its settings in full (``settings/full/R``) before its digest;
- rank 0 reads every digest and writes the verdict (``settings/verdict``): empty, or one line naming the ranks
  that differ and, from the lowest of them, the flags and both values;
- every rank reads the verdict and raises :class:`ConfigError` with that line (exit code 2, the same line on
  every rank, in torchrun's report of every node).

The software is compared too (:func:`software`): omnitron's and torch's versions, the backend's libraries
(``backend.versions()``: the vendor stack's runtime, collective and kernel libraries), the sources the C++ kernels
were built from (an installed ``omnitron._C`` and a source checkout's JIT build of the same sources agree) and the
interface of ``omnitron._sim`` where loaded. Two nodes with different torch builds started with the same flags ran,
their collectives and kernels not guaranteed to agree; a node with a stale ``omnitron._C`` (built from older
sources) runs other kernels.

The ranks' view of ``--save`` is compared too (:func:`mark_save_dir`, :data:`SEES_SAVE`): every rank writes its
checkpoint files there, so it must be one directory on a file system every node shares. A node whose ``--save``
was a directory on its own disk trained until the first save, then stopped on "rank_00002.pt: its writer left no
sha256 digest; the shard was not written completely" (the work since the start lost).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
import uuid

from omnitron.core.config.parallel import ConfigError

NODE_LOCAL = frozenset({"config", "nproc_per_node", "threads_per_process", "threads"})
"""Settings that may differ between nodes: the config file's name (its contents are compared), the spawned
processes (ignored under torchrun) and each process's threads (a node's cores)."""
SHOWN = 3
"""Differing flags named in the line; the rest are counted."""


def canonical(settings) -> dict:
    """The settings every rank must share, as JSON-ready values: a training run's resolved config (defaults
    included, so a flag given on one node at its default value matches a node that left it out), else the
    job's dataclass fields (``omnitron generate`` / ``serve``); the world size and the model family too."""
    from omnitron.core.training.arguments import Settings, resolved_config

    if isinstance(settings, Settings):
        values = dict(resolved_config(settings), world_size=settings.world_size, model_type=settings.model_type)
    elif dataclasses.is_dataclass(settings):
        values = dataclasses.asdict(settings)
    else:
        values = dict(vars(settings))
    return json.loads(json.dumps({k: v for k, v in values.items() if k not in NODE_LOCAL}, sort_keys=True,
                                 default=repr))


SEES_SAVE = "sees --save"
"""The entry of a rank's compared values that says whether it sees rank 0's mark in ``--save``."""
MARK_KEY = "settings/save_mark"


SOFTWARE = "software"
"""The entry of a rank's compared values that holds its :func:`software`."""


def software(backend=None) -> dict:
    """``{name: version}`` of what a rank runs: omnitron, torch, ``backend.versions()``, the C++ kernels
    (:func:`omnitron.kernels.cpp.signature`: the digest of the sources they were built from, so an installed
    ``omnitron._C`` and a source checkout's JIT build of the same sources agree; ``reference (build failed)`` where
    that build failed) and, for ``omnitron._sim`` when
    this rank loaded it, ``N ops #digest`` of its functions' names and signatures (nothing otherwise: a backend
    other than sim; the settings name the backend)."""
    import sys

    import torch

    import omnitron
    from omnitron.kernels import cpp, sources

    out = {"omnitron": omnitron.__version__, "torch": torch.__version__}
    out.update({k: str(v) for k, v in (backend.versions() if backend is not None else {}).items()})
    out["omnitron._C"] = cpp.signature(backend)
    sim = sys.modules.get("omnitron._sim")
    if sim is not None:
        out["omnitron._sim"] = sources.interface_digest(sim)
    return out


def mark_save_dir(store, rank: int, settings) -> None:
    """Rank 0, before it arrives: an empty file of a fresh name in ``--save`` (rank 0 holds its lock, so the
    directory exists), its name published for :func:`agreed`. A fresh name: no node has looked it up before,
    so no cached lookup of a network file system answers for it."""
    if rank != 0:
        return
    save = getattr(getattr(settings, "checkpoint", None), "save", None)
    name = ""
    if save and os.path.isdir(save):
        name = f".omnitron-shared-{uuid.uuid4().hex}"
        with open(os.path.join(save, name), "wb") as f:
            os.fsync(f.fileno())
    store.set(MARK_KEY, name)


def agreed(store, rank: int, world: int, settings, limit_s: float, backend=None) -> None:
    """:func:`check_same_settings` of :func:`canonical` ``settings``, this rank's :func:`software` (on
    ``backend``) and, where rank 0 marked ``--save``, whether this rank sees the mark; rank 0 removes the mark
    after the verdict."""
    values = dict(canonical(settings), **{SOFTWARE: software(backend)})
    name = store.get(MARK_KEY).decode()
    path = os.path.join(settings.checkpoint.save, name) if name else None
    if path:
        values[SEES_SAVE] = os.path.exists(path)
    try:
        check_same_settings(store, rank, world, values, limit_s)
    finally:
        if path and rank == 0:
            try:
                os.remove(path)
            except OSError:
                pass


def digest(values: dict) -> str:
    """SHA-256 of ``values`` as sorted JSON: what each rank sends (its settings in full only when they differ)."""
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()


def check_same_settings(store, rank: int, world: int, values: dict, limit_s: float) -> None:
    """Once every rank has arrived: ConfigError on every rank naming the ranks whose settings (``values``, from
    :func:`canonical`) differ from rank 0's, and the flags; nothing when all agree. ``limit_s``: how long to wait
    for a rank's part (every rank has arrived, so only a rank that fails or freezes now makes it wait)."""
    mine = digest(values)
    if rank == 0:
        store.set("settings/digest/0", mine)
        keys = [f"settings/digest/{r}" for r in range(world)]
        _wait(store, keys, limit_s, "every rank's settings")
        differ = [r for r, d in enumerate(store.multi_get(keys)) if d.decode() != mine]
        verdict = ""
        if differ:
            other = json.loads(store.get(f"settings/full/{differ[0]}").decode())
            verdict = describe(differ, world, values, other)
        store.set("settings/verdict", verdict)
    else:
        _wait(store, ["settings/digest/0"], limit_s, "rank 0's settings")
        if store.get("settings/digest/0").decode() != mine:  # before the digest: rank 0 reads it next
            store.set(f"settings/full/{rank}", json.dumps(values, sort_keys=True))
        store.set(f"settings/digest/{rank}", mine)
    _wait(store, ["settings/verdict"], limit_s, "rank 0's comparison of the settings")
    verdict = store.get("settings/verdict").decode()
    if verdict:
        raise ConfigError(verdict)


def describe(differ: list[int], world: int, first: dict, other: dict) -> str:
    """The line for ranks ``differ`` whose settings differ from rank 0's ``first``; ``other``: ``differ[0]``'s."""
    from omnitron.core.training.arguments import options
    from omnitron.core.training.failures import rank_list

    opts, r = options(), differ[0]
    if first.get(SOFTWARE) != other.get(SOFTWARE):  # first: what differs in the settings may follow from it
        return _software_line(differ, world, first.get(SOFTWARE) or {}, other.get(SOFTWARE) or {})
    keys = sorted(k for k in first.keys() | other.keys()
                  if first.get(k) != other.get(k) and k not in (SEES_SAVE, SOFTWARE))
    if not keys:  # the same settings: only the view of --save differs
        return (f"--save {first.get('save')} is not one directory shared by every node: {rank_list(differ)} of "
                f"{world} {'does' if len(differ) == 1 else 'do'} not see the file rank 0 made in it (a directory on "
                f"each node's own disk?). Give --save a directory on a file system every node mounts at the same path")
    parts = [f"{opts[k].flag if k in opts else '--' + k.replace('_', '-')} {_shown(other.get(k))} on rank {r}, "
             f"{_shown(first.get(k))} on rank 0" for k in keys[:SHOWN]]
    more = f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
    return (f"the ranks were started with different settings ({rank_list(differ)} of {world} differ from rank 0): "
            f"{'; '.join(parts)}{more}. Start every node with the same flags and config file")


def _software_line(differ: list[int], world: int, first: dict, other: dict) -> str:
    """The line for ranks ``differ`` that run other software than rank 0 (``other``: ``differ[0]``'s)."""
    from omnitron.core.training.failures import rank_list

    keys = [k for k in dict.fromkeys([*first, *other]) if first.get(k) != other.get(k)]
    parts = [f"{k} {other.get(k, '(none)')} on rank {differ[0]}, {first.get(k, '(none)')} on rank 0" for k in keys]
    return (f"the ranks run different software ({rank_list(differ)} of {world} differ from rank 0): "
            f"{'; '.join(parts)}. Install the same omnitron, torch and C++ extensions (python setup.py build_ext) "
            f"on every node")


def _shown(value, limit: int = 60) -> str:
    text = "(unset)" if value is None else (" ".join(map(str, value)) if isinstance(value, list) else str(value))
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _wait(store, keys: list[str], limit_s: float, what: str) -> None:
    """Poll for ``keys`` (check and sleep: a timed-out TCPStore wait prints C++ warnings); TrainingStopped after
    ``limit_s``."""
    from omnitron.core.training.nonfinite import TrainingStopped

    give_up, pause = time.monotonic() + limit_s, 0.01
    while not store.check(keys):
        if time.monotonic() >= give_up:
            raise TrainingStopped(f"{what} did not come within {limit_s:.0f} s (that rank failed or froze while "
                                  f"the job started: see its log)")
        time.sleep(pause)
        pause = min(1.0, 2 * pause)
