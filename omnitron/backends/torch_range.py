"""The torch versions omnitron is tested on, and the vendor stacks that ship each one.

``TESTED`` is a fact, not a wish: every minor in it has run the build and the suite (or the subset
``scripts/torch_matrix.sh`` names) with PyPI's wheel, and ``setup.py``'s ``install_requires`` states
the same range (tests/backends/test_torch_range.py holds the two together). The oldest end is the
oldest torch a current vendor stack ships; the newest is the newest PyPI has (2.15 on 2026-12-06; the README
installs 2.13).
"""
from __future__ import annotations

import importlib
import importlib.util
import re

TESTED = ((2, 9), (2, 15))
"""Oldest and newest tested (major, minor), both inclusive."""
README_TORCH = (2, 13)
"""The torch the README installs and CI runs the full suite on."""
STACK_MODULES = ("omnitron.backends.musa.stacks",)
"""Modules with a ``TORCH_STACKS = {(major, minor): "stack"}`` table (one per vendor that pins torch)."""


def minor_of(version: str) -> tuple[int, int]:
    """``"2.9.1+cu128"`` -> ``(2, 9)``."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"torch version {version!r} is not major.minor[...]")
    return int(m.group(1)), int(m.group(2))


def in_tested_range(version: str) -> bool:
    """True when ``version``'s major.minor lies inside :data:`TESTED`."""
    return TESTED[0] <= minor_of(version) <= TESTED[1]


def stacks_for(version: str) -> list[str]:
    """The software stacks that ship ``version``'s torch minor (vendor tables, then the README's)."""
    key = minor_of(version)
    found = []
    for name in STACK_MODULES:
        if importlib.util.find_spec(name) is not None:
            found += [s for k, s in importlib.import_module(name).TORCH_STACKS.items() if k == key]
    if key == README_TORCH:
        found.append("the README's install")
    return found


def describe(version: str) -> str:
    """One line for ``omnitron info``: the version, whether it is tested, the stacks that ship it."""
    lo, hi = (f"{a}.{b}" for a, b in TESTED)
    where = "inside" if in_tested_range(version) else "OUTSIDE"
    stacks = stacks_for(version)
    shipped = f"; shipped by {', '.join(stacks)}" if stacks else "; matches none of the vendor stacks omnitron lists"
    return f"torch {version}: {where} the tested range {lo}-{hi}{shipped}"
