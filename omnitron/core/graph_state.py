"""Whether a graph is being traced or captured: the one flag dropout, RNG forks and FP8 caches consult; and which
modules are graph regions.

Kept apart from :mod:`omnitron.core.capture` (which builds on the transformer layers) so the layers' own
modules can read it without importing what is built on them.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

_capturing = [False]
_REGION = "_omnitron_graph_region"


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


def mark_region(module: nn.Module) -> None:
    """Mark ``module`` a graph region: its ``forward`` runs as a compiled or captured graph while its own hooks run
    eagerly around it (:func:`omnitron.core.compile.compile_layers`, :func:`omnitron.core.capture.capture_layers`).
    What must run outside the graph before the region's parameters are read (data parallelism's all-gather waits,
    the FP8 weight refresh) hooks the region itself, never a module inside it. A plain attribute: parameter names
    and ``state_dict`` keys are unchanged."""
    setattr(module, _REGION, True)


def is_region(module: nn.Module) -> bool:
    return bool(getattr(module, _REGION, False))


def outer_regions(module: nn.Module) -> list[nn.Module]:
    """The graph regions of ``module`` (itself included) not inside another one, in module order."""
    out, inside = [], set()
    for m in module.modules():
        if id(m) not in inside and is_region(m):
            out.append(m)
            inside.update(id(s) for s in m.modules())
    return out
