"""Counter-based attention dropout: the keep/drop decision of a score element is a hash of its coordinates.

Element ``(batch, head, query position, key position)`` of the attention probabilities under seed ``seed`` is
kept iff ``hash(seed, batch, head, q, k) >= threshold(p)``. Nothing is drawn from a generator and nothing is
stored: a tile of any shape, a ring step, a cp layout (p2p ring, a2a, allgather, a2a+p2p) or the backward's
recomputation makes the same mask from the index ranges it covers, so context parallelism equals one process
exactly (positions are GLOBAL sequence positions, heads the rank's query-head index before any cp head split).

The hash is a chain of 32-bit mixes (:func:`mix32_int`: bijective; xor-shift, odd multiply, twice): a row key from
``(seed, batch, head, q)`` on the small ``[b, h, rows, 1]`` tensor, a column key from ``k`` on the ``[cols]``
one, and one mix per element of their xor. Two elements collide exactly when their row keys differ as their
column keys do, so among ``n`` elements about ``n^2 / 2^33`` pairs share a 32-bit value, as for a random
function; the mix's avalanche makes the decisions of elements with related keys unrelated.

Tensors hold the 32-bit values as int32 bit patterns (int32 ops are ~20x faster than int64 ones on the CPU:
vectorised shifts and multiplies): a logical shift is an arithmetic one masked, a product wraps modulo 2^32
(two's complement; :func:`mix32_int`, plain Python integers, is the exact reference the tests hold every
backend's tensors to), and the unsigned comparison with the threshold flips the sign bit on both sides.

Statistics: within a row the key positions map to distinct 32-bit values (the mixes are bijections);
``threshold(p) = round(p 2^32)``, so over the hash's outputs an element is kept with probability
``1 - threshold / 2^32``, within ``2^-33`` of ``1 - p`` (the quantisation). Tested: the keep rate of large
tiles within its binomial bound, and masks of different seeds, heads, batches and positions uncorrelated.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

MASK32 = 0xFFFFFFFF
_MUL1, _MUL2 = 0x21F0AAAD, 0x735A2D97  # odd multipliers of a good xor-shift-multiply 32-bit mix, both < 2^31
_SALT = 0x1E3779B9  # (< 2^31) sets the column keys apart from the row chain's
_SIGN = -2 ** 31  # the sign bit of an int32


def mix32_int(x: int) -> int:
    """The 32-bit mix on a Python integer in ``[0, 2^32)`` (exact: the reference of :func:`mix32_`)."""
    x ^= x >> 16
    x = (x * _MUL1) & MASK32
    x ^= x >> 15
    x = (x * _MUL2) & MASK32
    return x ^ (x >> 15)


def mix32_(x: torch.Tensor, tmp: torch.Tensor | None = None) -> torch.Tensor:
    """In place: the 32-bit mix of an int32 tensor (its bit patterns as unsigned values); returns ``x``. Each
    logical shift goes through ``tmp`` (an int32 tensor of ``x``'s shape, made when not given) in place: one
    scratch tensor for the whole mix instead of two new ones per shift (the peak and the page faults of the
    ``[b, h, rows, cols]`` mask's words)."""
    tmp = torch.empty_like(x) if tmp is None else tmp
    for shift, mul in ((16, _MUL1), (15, _MUL2), (15, None)):
        x ^= torch.bitwise_right_shift(x, shift, out=tmp).bitwise_and_(MASK32 >> shift)
        if mul is not None:
            x *= mul
    return x


def as_int32(u: int) -> int:
    """The int32 whose bit pattern is the unsigned 32-bit ``u``."""
    return u - 2 ** 32 if u >= 2 ** 31 else u


def threshold(p: float) -> int:
    """The 32-bit threshold below which an element is dropped (keep probability ``1 - threshold / 2^32``)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"hash dropout: p must be in [0, 1), got {p}")
    return min(int(round(p * 2.0 ** 32)), MASK32)  # (p within 2^-33 of 1 keeps 1 value in 2^32)


def seed_key(seed: int) -> int:
    """The 32-bit key of a seed of up to 64 bits (both halves mixed in)."""
    seed %= 2 ** 64
    return mix32_int(mix32_int(seed >> 32) ^ (seed & MASK32))


def row_key(seed: "int | torch.Tensor") -> "int | torch.Tensor":
    """The int32 bit pattern of :func:`seed_key` that starts every row key: from a Python ``seed``, or ``seed``
    itself where it is a 0-dim int32 tensor that already holds it (what a compiled layer draws at run time:
    :meth:`omnitron.core.parallel.tensor.random.RNGTracker.hash_seed`; the same bits, so the same masks)."""
    return seed if isinstance(seed, torch.Tensor) else as_int32(seed_key(seed))


def keep(seed: "int | torch.Tensor", p: float, batch: torch.Tensor, head: torch.Tensor, q: torch.Tensor,
         k: torch.Tensor) -> torch.Tensor:
    """Boolean keep mask broadcast over int32 index tensors ``batch, head, q`` (shaped to broadcast, e.g.
    ``[b,1,1,1]``, ``[1,h,1,1]``, ``[1,1,rows,1]``) and ``k`` (``[1,1,1,cols]``), all ``>= 0``; ``seed`` as
    :func:`row_key` takes it."""
    row = mix32_(mix32_(mix32_(batch ^ row_key(seed)) ^ head) ^ q)  # [b, h, rows, 1]: cheap
    x = mix32_(row ^ mix32_(k ^ _SALT))  # the one [b, h, rows, cols] tensor (and its scratch), mixed in place
    return x.bitwise_xor_(_SIGN) >= threshold(p) + _SIGN  # unsigned x >= threshold


class HashDropout(NamedTuple):
    """The dropout of one attention block: ``seed`` (a Python int, or its key as a 0-dim int32 tensor inside a
    compiled layer: :func:`row_key`), ``p``, the global positions of its query rows ``q_pos
    [sq]`` and key rows ``k_pos [sk]`` (int64, on the block's device) and the index of its first query head
    (``head0``: the head split of all-to-all context parallelism). A kernel that takes it draws
    :meth:`multiplier` for the rows it computes; one that cannot declines the call."""

    seed: "int | torch.Tensor"
    p: float
    q_pos: torch.Tensor
    k_pos: torch.Tensor
    head0: int = 0

    def narrow(self, rows: slice, cols: slice) -> "HashDropout":
        """The dropout of the sub-block ``rows x cols`` (local slices)."""
        return self._replace(q_pos=self.q_pos[rows], k_pos=self.k_pos[cols])

    def multiplier(self, batch: int, heads: int, rows: slice, dtype) -> torch.Tensor:
        """``[batch, heads, len(rows), sk]``: 0 where dropped, ``1 / (1 - p)`` where kept, for the block's query
        rows ``rows`` (a local slice)."""
        dev = self.q_pos.device
        b = torch.arange(batch, device=dev, dtype=torch.int32).view(-1, 1, 1, 1)
        h = torch.arange(self.head0, self.head0 + heads, device=dev, dtype=torch.int32).view(1, -1, 1, 1)
        q, k = self.q_pos[rows].view(1, 1, -1, 1), self.k_pos.view(1, 1, 1, -1)
        kept = keep(self.seed, self.p, b, h, q.to(torch.int32), k.to(torch.int32))
        return torch.zeros(kept.shape, dtype=dtype, device=dev).masked_fill_(kept, 1.0 / (1.0 - self.p))


def block_positions(q_pos: torch.Tensor, k_pos: torch.Tensor, seed: "int | torch.Tensor", p: float, head0: int = 0,
                    device=None) -> HashDropout | None:
    """A :class:`HashDropout` on ``device`` (None when ``p == 0``: no dropout)."""
    if p == 0.0:
        return None
    threshold(p)  # refuses a p outside [0, 1)
    seed = seed if isinstance(seed, torch.Tensor) else int(seed)
    return HashDropout(seed, float(p), q_pos.to(device), k_pos.to(device), int(head0))
