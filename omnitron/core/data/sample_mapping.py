"""BERT / T5 sample mapping: Megatron's ``helpers.build_mapping`` (megatron/core/datasets/helpers.cpp), row for row.

Every epoch walks the documents in order. A document is used when it has at least ``min_sentences`` sentences
(2 with BERT's binary head, else 1) and, having more than one, none longer than :data:`LONG_SENTENCE` tokens. Its
sentences are packed until a target length is reached with more than one sentence left and at least
``min_sentences`` taken, or the document ends; each sample is ``(first sentence, end sentence, target)``. A target
is ``max_tokens``, or with probability about ``short_seq_prob`` (``--short-seq-prob``) a random length in
``[2, max_tokens]``: a draw ``r`` of ``std::mt19937(seed)`` is short when ``r % round(1 / p) == 0``, and is then
``2 + r % (max_tokens - 1)``. A new target is drawn at each document start and after each sample. Whole epochs run
until at least ``num_samples`` rows; the rows are then shuffled by Fisher-Yates from the last row down, ``j =
r % (i + 1)`` with ``r`` from ``std::mt19937_64(seed + 1)``.

``std::mt19937(seed)`` is numpy's ``RandomState(seed)`` (the same generator and integer seeding); its raw 32-bit
outputs are ``randint(0, 2**32, dtype=uint32)``. ``std::mt19937_64`` is :class:`MT19937_64`.
"""
from __future__ import annotations

import math

import numpy as np

LONG_SENTENCE = 512
"""Megatron's ``LONG_SENTENCE_LEN``: a document of several sentences holding a longer one gives no sample."""

_M64 = (1 << 64) - 1


class MT19937_64:
    """The 64-bit Mersenne Twister of C++ ``std::mt19937_64`` (seeded with one integer), drawn in blocks."""

    N, M, A = 312, 156, np.uint64(0xB5026F5AA96619E9)
    UPPER, LOWER = np.uint64(0xFFFFFFFF80000000), np.uint64(0x7FFFFFFF)

    def __init__(self, seed: int):
        mt = [int(seed) & _M64]
        for i in range(1, self.N):
            prev = mt[-1]
            mt.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & _M64)
        self.state = np.asarray(mt, np.uint64)

    def _mix(self, upper: np.ndarray, lower: np.ndarray) -> np.ndarray:
        x = (upper & self.UPPER) | (lower & self.LOWER)
        return (x >> np.uint64(1)) ^ np.where(x & np.uint64(1), self.A, np.uint64(0))

    def _twist(self) -> None:
        """The whole state at once in the three runs whose inputs are known (each reads words updated before it)."""
        mt, n, m = self.state, self.N, self.M
        mt[:n - m] = mt[m:] ^ self._mix(mt[:n - m], mt[1:n - m + 1])
        mt[n - m:n - 1] = mt[:m - 1] ^ self._mix(mt[n - m:n - 1], mt[n - m + 1:])
        mt[n - 1] = mt[m - 1] ^ self._mix(mt[n - 1:], mt[:1])[0]

    def draw(self, count: int) -> np.ndarray:
        """The next ``count`` outputs (a fresh generator's first ``count``: this class is used once per mapping)."""
        blocks = []
        for _ in range(-(-count // self.N)):
            self._twist()
            y = self.state.copy()
            y ^= (y >> np.uint64(29)) & np.uint64(0x5555555555555555)
            y ^= (y << np.uint64(17)) & np.uint64(0x71D67FFFEDA60000)
            y ^= (y << np.uint64(37)) & np.uint64(0xFFF7EEE000000000)
            y ^= y >> np.uint64(43)
            blocks.append(y)
        return np.concatenate(blocks)[:count] if blocks else np.zeros(0, np.uint64)


class _Targets:
    """Target lengths of :func:`build_sample_mapping`, drawn from ``std::mt19937(seed)`` in blocks."""

    def __init__(self, seed: int, short_seq_prob: float, max_tokens: int):
        self.ratio = math.floor(1.0 / short_seq_prob + 0.5) if short_seq_prob > 0 else 0  # C's round()
        self.rng, self.max_tokens, self.block, self.pos = np.random.RandomState(seed % 2**32), max_tokens, [], 0

    def __call__(self) -> int:
        if not self.ratio:
            return self.max_tokens
        if self.pos == len(self.block):
            self.block, self.pos = self.rng.randint(0, 2**32, 4096, dtype=np.uint32).tolist(), 0
        r = self.block[self.pos]
        self.pos += 1
        return 2 + r % (self.max_tokens - 1) if r % self.ratio == 0 else self.max_tokens


def _epoch(bounds: list[int], lengths: list[int], min_sentences: int, target: _Targets, rows: list) -> None:
    """One epoch's rows, appended to ``rows`` (the loop of ``build_mapping_impl``)."""
    for d in range(len(bounds) - 1):
        first, last = bounds[d], bounds[d + 1]
        remain = last - first
        if remain < min_sentences or (remain > 1 and max(lengths[first:last]) > LONG_SENTENCE):
            continue
        start, tokens, taken, goal = first, 0, 0, target()
        for j in range(first, last):
            tokens, taken, remain = tokens + lengths[j], taken + 1, remain - 1
            if (tokens >= goal and remain > 1 and taken >= min_sentences) or remain == 0:
                rows.append((start, j + 1, goal))
                start, tokens, taken, goal = j + 1, 0, 0, target()


def build_sample_mapping(bounds: np.ndarray, lengths: np.ndarray, num_samples: int, max_tokens: int, seed: int,
                         *, short_seq_prob: float = 0.1, min_sentences: int = 2) -> np.ndarray:
    """``[n, 3]`` int64 rows ``(first sentence, end sentence, target length)`` over the sentences ``lengths`` of the
    documents ``bounds`` (see the module docstring): Megatron's mapping, shuffled as Megatron shuffles it.
    Raises ValueError when the documents give no sample (Megatron would loop without end)."""
    bounds_, lengths_ = [int(b) for b in bounds], [int(n) for n in lengths]
    target, rows = _Targets(seed, short_seq_prob, max_tokens), []
    while len(rows) < max(num_samples, 1):
        before = len(rows)
        _epoch(bounds_, lengths_, min_sentences, target, rows)
        if len(rows) == before:
            raise ValueError(f"no document has {min_sentences} sentence(s) of at most {LONG_SENTENCE} tokens to make "
                             "a sample from: split the text into sentences, use other documents, or pass "
                             "--no-bert-binary-head (one segment)")
    n = len(rows)
    draws = MT19937_64(seed + 1).draw(max(n - 1, 0))
    order = list(range(n))
    for i, r in zip(range(n - 1, 0, -1), draws.tolist()):
        j = r % (i + 1)
        order[i], order[j] = order[j], order[i]
    return np.asarray(rows, np.int64).reshape(-1, 3)[np.asarray(order, np.int64)]
