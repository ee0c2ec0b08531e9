"""Probe timelines kept on disk between runs of ``omnitron plan`` (as inductor keeps its compiled kernels).

A plan's memory estimate runs small probe chunks forward and backward and logs the storages they create
(:func:`omnitron.plan.transients.timeline`); a search over layouts runs dozens of them, a quarter of a second each on
a laptop core, and every run of ``omnitron plan`` ran them again. The log of a probe is a function of the probe (its
``repr``: config, depth, ends, sequence and batch), of the code that builds and runs it and of torch, so it is kept
under a key of all three: the probe's ``repr`` hashed, inside a folder named by a hash of torch's version, of the
kernel-selecting environment (:data:`KEY_ENV`), of whether the backend's dropout is fused (its masks' bytes) and of
every Python file and built extension of the ``omnitron`` package. Any change to the package or to torch reads
nothing written before it.

Files are JSON (``[[op or null, bytes], ...]``), never pickles; one that does not parse or is not such a list is
ignored and rewritten. Writes go through a temporary file and ``os.replace``, so concurrent plans (pytest-xdist
workers) never read half a file.

``OMNITRON_PLAN_CACHE``: the folder (default ``$XDG_CACHE_HOME/omnitron/plan-probes``, else
``~/.cache/omnitron/plan-probes``); ``off`` keeps nothing on disk.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path

ENV = "OMNITRON_PLAN_CACHE"

Events = list[tuple[str | None, int]]


def folder() -> Path | None:
    """Where this package's and torch's probe logs live; None when the cache is off."""
    where = os.environ.get(ENV, "")
    if where.lower() == "off":
        return None
    if not where:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        where = os.path.join(base, "omnitron", "plan-probes")
    return Path(where) / code_key()


KEY_ENV = ("OMNITRON_KERNELS", "OMNITRON_BACKEND", "OMNITRON_FP8_PATH")
"""Environment that selects which kernels a probe runs (and so what they allocate): part of the key."""


@functools.lru_cache(maxsize=1)
def code_key() -> str:
    """A hash of torch's version, of :data:`KEY_ENV` and of every ``.py`` file and built extension of the package
    (path and contents)."""
    import torch

    import omnitron
    from omnitron.plan.measure import fused_dropout_device

    root = Path(omnitron.__file__).resolve().parent
    h = hashlib.sha256(torch.__version__.encode())
    h.update(repr([os.environ.get(k) for k in KEY_ENV]).encode())
    h.update(repr(fused_dropout_device()).encode())  # the probes' dropout masks: the device's, not the host's
    for f in sorted([*root.rglob("*.py"), *root.rglob("*.so")]):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:20]


def _path(key: str) -> Path | None:
    d = folder()
    return None if d is None else d / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


def load(key: str) -> Events | None:
    """The events stored for probe ``key`` by this code, or None (not stored, unreadable, or not an event list)."""
    path = _path(key)
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("probe") != key or not isinstance(data.get("events"), list):
        return None
    events = data["events"]
    ok = all(isinstance(e, list) and len(e) == 2 and (e[0] is None or isinstance(e[0], str))
             and isinstance(e[1], int) and not isinstance(e[1], bool) for e in events)
    return [(op, n) for op, n in events] if ok else None


def store(key: str, events: Events) -> None:
    """Keep ``events`` for probe ``key``; a folder that cannot be written is skipped silently (the plan is unchanged,
    only slower next time)."""
    path = _path(key)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".probe-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"probe": key, "events": [[op, n] for op, n in events]}, f)
        os.replace(tmp, path)
    except OSError:
        return
