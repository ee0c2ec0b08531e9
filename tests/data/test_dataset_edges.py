"""Mock data's per-sample determinism and range, and a blend's refusal of a dataset too small for its share."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from omnitron.core.data import MockGPTDataset
from omnitron.core.data.blended import BlendedDataset


def test_mock_samples_are_their_own_and_the_range_is_kept():
    """Sample i depends on (seed, i) only: the same in a dataset of another length, different from every other
    sample (random indices over a range wider than any small period) and under another seed; index num_samples
    and -1 are out of range."""
    rng = random.Random()
    seed, n = rng.randrange(2**31), rng.randint(60, 90)
    ds = MockGPTDataset(n, seq_length=32, vocab_size=1000, eod=999, seed=seed)
    longer = MockGPTDataset(n + 17, seq_length=32, vocab_size=1000, eod=999, seed=seed)
    other = MockGPTDataset(n, seq_length=32, vocab_size=1000, eod=999, seed=seed + 1)
    picks = rng.sample(range(n), 40)
    tokens = {i: ds[i]["tokens"] for i in picks}
    for i in picks:
        assert torch.equal(tokens[i], longer[i]["tokens"]), (seed, i)
        assert not torch.equal(tokens[i], other[i]["tokens"]), (seed, i)
    # 32 ids of 1000 each: two independent samples are equal with probability ~1e-96
    assert len({tuple(t.tolist()) for t in tokens.values()}) == len(picks), seed
    for bad in (n, -1):
        with pytest.raises(IndexError, match="out of range"):
            ds[bad]


class _Tagged(torch.utils.data.Dataset):
    """Dataset ``d`` of ``n`` samples whose sample j is ``{"from": [d, j]}``."""

    def __init__(self, d: int, n: int):
        self.d, self.n = d, n

    def __len__(self):
        return self.n

    def __getitem__(self, j):
        if not 0 <= j < self.n:
            raise IndexError(j)
        return {"from": torch.tensor([self.d, j])}


def test_blend_refuses_a_dataset_one_sample_short():
    """Random weights and size: the samples each dataset gives are counted by reading the blend (over datasets
    large enough); a dataset of exactly that many is accepted and every one of its samples read once, one sample
    fewer is refused naming the shortfall."""
    rng = np.random.default_rng()
    k, size = int(rng.integers(2, 5)), int(rng.integers(20, 200))
    weights = rng.uniform(0.1, 1.0, k).tolist()
    big = BlendedDataset([_Tagged(d, size) for d in range(k)], weights, size)
    taken = np.array([big[i]["from"].tolist() for i in range(size)])
    need = [int((taken[:, 0] == d).sum()) for d in range(k)]
    exact = BlendedDataset([_Tagged(d, need[d]) for d in range(k)], weights, size)
    read = sorted(tuple(exact[i]["from"].tolist()) for i in range(size))
    assert read == sorted((d, j) for d in range(k) for j in range(need[d]))
    short = int(rng.choice([d for d in range(k) if need[d] > 0]))
    sizes = [need[d] - (d == short) for d in range(k)]
    with pytest.raises(ValueError, match=f"blended dataset {short} has {sizes[short]} samples, the blend needs "
                                         f"{need[short]}"):
        BlendedDataset([_Tagged(d, sizes[d]) for d in range(k)], weights, size)
