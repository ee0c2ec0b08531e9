"""Whether a graph is being traced or captured: the one flag dropout, RNG forks and FP8 caches consult.

Kept apart from :mod:`omnitron.core.capture` (which builds on the transformer layers) so the layers' own
modules can read it without importing what is built on them.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_capturing = [False]


def in_graph() -> bool:
    """True while dynamo traces or a device graph is being captured: no Python runs later, so generator swaps
    and host-side caches are off. ``is_compiling()`` is asked first: dynamo folds it to True and never reads the
    capture flag, so a compiled layer installs no guard on it and the graph traced inside a capture
    (``--torch-compile`` with ``--cuda-graph-impl local``) is the one every other call reuses."""
    return torch.compiler.is_compiling() or _capturing[0]


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """Mark a capture under way (see :func:`in_graph`)."""
    saved, _capturing[0] = _capturing[0], True
    try:
        yield
    finally:
        _capturing[0] = saved
