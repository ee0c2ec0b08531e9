"""What each ring step computes on each cp rank: the tiles of (query rows, key rows) and their masks.

Without a window a step is one block (``_step_slices``: the load-balanced layout's causal structure).
With a causal sliding window ``(left, 0)`` the block's query and key rows are cut into their chunks
(contiguous global positions, :mod:`.layout`) and the chunks into tiles of ``max(64, left + 1)`` rows.
From its tile's position ranges alone, each (query tile, key tile) pair is

- outside the window (every ``i - j < 0`` or ``> left``): skipped;
- inside it whole (``0 <= i - j <= left`` throughout): an unmasked block;
- on the diagonal (same positions) with ``left >= tile - 1``: a square causal block;
- cut by the window's edge: a masked block (the reference kernel; the mask is the tile's, small).

So a rank's work per step is ``O(rows x (left + tile))``, not ``O(rows x keys)``, and every tile but the
cut ones runs on the backend's fused kernel. The plans are cached (with their masks on the device).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

TILE_MIN = 64
"""The smallest tile edge: narrower windows still take tiles of 64 rows (fewer kernel calls)."""


class Tile(NamedTuple):
    """One block of a ring step: local query rows, local key rows of the visiting block, the square causal
    mask or a keep ``mask`` ``[rows, cols]`` (True = attend)."""

    rows: slice
    cols: slice
    causal: bool
    mask: torch.Tensor | None


def _step_slices(step: int, src: int, rank: int, c: int, causal: bool) -> tuple[slice, slice, bool]:
    """(query rows, key rows, causal mask) this rank computes against rank ``src``'s block at ``step``."""
    every = slice(None)
    if not causal:
        return every, every, False
    if step == 0:
        return every, every, True
    if src < rank:
        return every, slice(0, c), False
    return slice(c, None), every, False


def _runs(rank: int, size: int, c: int, sl: slice) -> list[tuple[int, int, int]]:
    """``(local start, local stop, global position of start)`` of the chunk runs of rank ``rank``'s slice inside
    the local rows ``sl`` (its early chunk ``rank``, late chunk ``2 size - 1 - rank``)."""
    r, out = range(2 * c)[sl], []
    for a, b, first in ((0, c, rank * c), (c, 2 * c, (2 * size - 1 - rank) * c)):
        lo, hi = max(a, r.start), min(b, r.stop)
        if lo < hi:
            out.append((lo, hi, first + lo - a))
    return out


def _pieces(runs, t: int):
    """``(local start, local stop, global position of start)`` of tiles of ``t`` rows over ``runs``."""
    for lo, hi, first in runs:
        for a in range(lo, hi, t):
            yield a, min(a + t, hi), first + a - lo


def _tile(q: tuple[int, int, int], k: tuple[int, int, int], left: int,
          device) -> tuple[bool, torch.Tensor | None] | None:
    """(causal, mask) of the (query tile ``q``, key tile ``k``) pair, None when the window misses it."""
    (i0, i1, q0), (j0, j1, k0) = q, k
    dmin, dmax = q0 - (k0 + j1 - j0 - 1), q0 + i1 - i0 - 1 - k0  # the least and greatest i - j
    if dmax < 0 or dmin > left:
        return None
    if dmin >= 0 and dmax <= left:
        return False, None
    if q0 == k0 and i1 - i0 == j1 - j0 and dmax <= left:
        return True, None
    d = torch.arange(q0, q0 + i1 - i0)[:, None] - torch.arange(k0, k0 + j1 - j0)[None, :]
    return False, ((d >= 0) & (d <= left)).to(device)


@functools.lru_cache(maxsize=512)
def step_plan(step: int, rank: int, size: int, local_length: int, causal: bool, window=None,
              device: torch.device | None = None) -> list[Tile]:
    """The tiles cp rank ``rank`` computes at ring ``step`` (empty: the visiting block is outside the window).
    ``window = (left, right)`` of :mod:`omnitron.core.transformer.window` (None or ``left < 0``: one block)."""
    src, c = (rank - step) % size, local_length // 2
    rows, cols, square = _step_slices(step, src, rank, c, causal)
    if window is None or window[0] < 0:
        return [Tile(rows, cols, square, None)]
    left, t = window[0], max(TILE_MIN, window[0] + 1)
    tiles, whole = [], [(0, local_length, 0)]  # one rank (no cp): the whole sequence in order, any length
    for q in _pieces(_runs(rank, size, c, rows) if size > 1 else whole, t):
        for k in _pieces(_runs(src, size, c, cols) if size > 1 else whole, t):
            kind = _tile(q, k, left, device)
            if kind is not None:
                tiles.append(Tile(slice(q[0], q[1]), slice(k[0], k[1]), *kind))
    return tiles


def ring_tile_shapes(size: int, local_length: int, window) -> set[tuple[int, int, bool, bool]]:
    """``(rows, keys, causal, masked)`` of every tile any rank of a ``size``-rank ring (``size > 1``) runs at any
    step under the causal ``window = (left, 0)``, without listing the ring's ``size^2`` step plans.

    Every chunk of the load-balanced layout holds ``c = local_length / 2`` rows and each run a rank computes is a
    whole chunk (:func:`_step_slices`), cut into tiles from its start; over the steps and ranks the ring meets every
    (query chunk, key chunk) pair with the key chunk at or before the query chunk once (the diagonal at step 0). So
    a tile's shape and kind depend only on the two chunks' distance, and distances past the window give none."""
    left, t = window[0], max(TILE_MIN, window[0] + 1)
    c = local_length // 2
    keys = list(_pieces([(0, c, 0)], t))
    shapes = set()
    for dist in range(min(2 * size, (left + c - 1) // c + 1)):  # the chunk ``dist`` after the keys' chunk
        for q in _pieces([(0, c, dist * c)], t):
            for k in keys:
                kind = _tile(q, k, left, torch.device("meta"))
                if kind is not None:
                    shapes.add((q[1] - q[0], k[1] - k[0], kind[0], kind[1] is not None))
    return shapes
