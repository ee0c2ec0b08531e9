"""Blending several datasets in fixed proportions (``--data-path 0.7 A 0.3 B``), and mock data."""
from __future__ import annotations

import os

import numpy as np
import torch

from . import cache
from .config import normalize
from .gpt_dataset import NO_PAD, make_sample


BLEND_FORMAT = 2  # bump when the blending algorithm changes, so old caches are not reused (2: Megatron's)


def blend_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy assignment of ``size`` samples to datasets in proportions ``weights`` (Megatron's
    ``build_blending_indices``).

    Sample i goes to the dataset furthest behind its target, ``argmax_d w_d * max(i, 1) - count_d``
    (largest sampling error; ties to the lower index), so every prefix of the blend is within
    one sample of the target mix. Returns (dataset_index int16, dataset_sample_index int64).
    """
    w = normalize(weights)
    k = len(w)
    counts = [0] * k
    chosen = [0] * size
    # NOTE: plain Python floats, not numpy, per step: ~10x faster for the few datasets of a blend.
    for i in range(size):
        at = float(max(i, 1))
        best, best_err = 0, w[0] * at - counts[0]
        for d in range(1, k):
            err = w[d] * at - counts[d]
            if err > best_err:
                best, best_err = d, err
        chosen[i] = best
        counts[best] += 1
    dataset_index = np.asarray(chosen, np.int16)
    sample_index = np.empty(size, np.int64)
    for d in range(k):  # the j-th sample taken from dataset d is its sample j
        mask = dataset_index == d
        sample_index[mask] = np.arange(int(mask.sum()), dtype=np.int64)
    return dataset_index, sample_index


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` samples drawn from ``datasets`` in proportions ``weights`` (deterministic, no seed needed).

    With ``cache_dir`` the blend indices are cached like the GPT indices (keyed by the
    constituent datasets' descriptions, the weights and the size).
    """

    def __init__(self, datasets: list, weights: list[float], size: int, *, cache_dir: str | None = None,
                 allow_build: bool = True):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"BlendedDataset: {len(datasets)} datasets but {len(weights)} weights")
        self.datasets, self.weights, self.size = datasets, list(weights), size
        names = ("dataset_index", "dataset_sample_index")

        def build():
            return dict(zip(names, blend_indices(weights, size)))

        if cache_dir is None:
            arrays = build()
        else:
            desc = {"class": "BlendedDataset", "format": BLEND_FORMAT, "weights": [float(w) for w in weights],
                    "size": int(size),
                    "datasets": [getattr(d, "description", repr(d)) for d in datasets]}
            arrays = cache.load_or_build(os.path.join(cache_dir, "indices"), desc, names,
                                         build if allow_build else None)
        self.dataset_index, self.dataset_sample_index = arrays["dataset_index"], arrays["dataset_sample_index"]
        for d, ds in enumerate(datasets):
            need = int((self.dataset_index == d).sum())
            if need > len(ds):
                raise ValueError(f"blended dataset {d} has {len(ds)} samples, the blend needs {need}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range [0, {self.size})")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]


class MockGPTDataset(torch.utils.data.Dataset):
    """Synthetic samples with the GPTDataset interface: random ids, eod about every 64 tokens.

    Sample i depends only on (seed, i), so every rank and every worker sees the same data. ``pad``: the id no loss
    is taken on (:func:`~omnitron.core.data.gpt_dataset.dataset_pad_id`), as in every GPT sample (Megatron's
    MockGPTDataset is a GPTDataset: its samples mask the tokenizer's pad too).
    """

    def __init__(self, num_samples: int, *, seq_length: int, vocab_size: int, eod: int, seed: int = 1234,
                 eod_mask_loss: bool = False, reset_position_ids: bool = False, reset_attention_mask: bool = False,
                 pad: int = NO_PAD):
        if vocab_size < 2:
            raise ValueError(f"mock data needs a vocabulary of at least 2 ids, got {vocab_size}")
        self.num_samples, self.seq_length, self.vocab_size = num_samples, seq_length, vocab_size
        self.eod, self.seed = eod, seed
        self.eod_mask_loss, self.reset_position_ids = eod_mask_loss, reset_position_ids
        self.reset_attention_mask, self.pad = reset_attention_mask, pad

    def __len__(self) -> int:
        return self.num_samples

    def tokens(self, idx: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, idx])
        text = rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)
        text[text == self.eod] = (self.eod + 1) % self.vocab_size
        text[rng.random(self.seq_length + 1) < 1 / 64] = self.eod
        return text

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range [0, {self.num_samples})")
        return make_sample(self.tokens(idx), self.eod, self.eod_mask_loss, self.reset_position_ids,
                           self.reset_attention_mask, pad=self.pad)
