"""GPT pre-training samples cut from an indexed dataset: document, sample and shuffle indices.

For one split (a contiguous range of documents) and a requested number of samples:
  document index  the split's documents, one random permutation per epoch, epochs concatenated
                  (as many epochs as needed to yield the samples)
  sample index    [n + 1, 2]: (position in the document index, token offset) where sample i
                  starts; sample i is the seq_length + 1 tokens from its start to the next
                  sample's start inclusive (samples overlap by one token, as in Megatron)
  shuffle index   a permutation of the n samples
All three are numpy arrays, deterministic for a seed, cached on disk (``cache.py``).
Here a "document" is one sequence of the indexed dataset (preprocessing writes one per document).
NOTE: unlike Megatron, the last (partial) epoch is not shuffled separately, and the index
files are omnitron's own (.npy): the samples are the same kind, not the same order as Megatron's.
"""
from __future__ import annotations

import hashlib
import math
import os

import numpy as np
import torch

from . import cache
from .indexed import IndexedDataset

INDEX_FORMAT = 1  # bump when the index algorithm changes, so old caches are not reused


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs whose tokens give ``num_samples`` samples of ``seq_length + 1`` tokens."""
    if tokens_per_epoch <= 0:
        raise ValueError("the split has no tokens; check --split and that the dataset is not empty")
    need_tokens = num_samples * seq_length + 1
    return max(1, math.ceil(need_tokens / tokens_per_epoch))


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState) -> np.ndarray:
    """Each epoch a fresh permutation of ``documents``; int32 when ids fit, else int64."""
    dtype = np.int32 if (len(documents) == 0 or documents.max() < 2**31) else np.int64
    return np.concatenate([rng.permutation(documents).astype(dtype) for _ in range(num_epochs)])


def build_sample_index(doc_lengths: np.ndarray, seq_length: int) -> np.ndarray:
    """[n + 1, 2] start (doc position, offset) of each sample over documents of ``doc_lengths`` tokens."""
    cum = np.zeros(len(doc_lengths) + 1, np.int64)
    np.cumsum(doc_lengths, out=cum[1:])
    n = int((cum[-1] - 1) // seq_length) if cum[-1] > 0 else 0
    starts = np.arange(n + 1, dtype=np.int64) * seq_length
    pos = np.searchsorted(cum, starts, side="right") - 1  # last document starting at or before each token
    out = np.empty((n + 1, 2), np.int64)
    out[:, 0] = pos
    out[:, 1] = starts - cum[pos]
    return out


def build_indices(lengths: np.ndarray, documents: np.ndarray, num_samples: int, seq_length: int,
                  seed: int) -> dict[str, np.ndarray]:
    """Document, sample and shuffle indices for ``documents`` (ids into ``lengths``)."""
    rng = np.random.RandomState(seed)
    epochs = num_epochs_needed(int(lengths[documents].sum(dtype=np.int64)), seq_length, max(num_samples, 1))
    doc_index = build_document_index(documents, epochs, rng)
    sample_index = build_sample_index(lengths[doc_index].astype(np.int64), seq_length)
    shuffle_index = rng.permutation(len(sample_index) - 1).astype(np.int64)
    return {"document_index": doc_index, "sample_index": sample_index, "shuffle_index": shuffle_index}


class GPTDataset(torch.utils.data.Dataset):
    """Samples ``dict(tokens, labels, loss_mask, position_ids)``, each ``[seq_length]``, from one split
    (plus ``document_ids`` with ``reset_attention_mask``; see :func:`make_sample`).

    ``len(self) >= num_samples`` (whole epochs are indexed). Build the indices on one rank
    (``allow_build=True``) and load them elsewhere (``allow_build=False``).
    """

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, num_samples: int, *, seq_length: int,
                 seed: int, eod: int, cache_dir: str, split_name: str = "train", eod_mask_loss: bool = False,
                 reset_position_ids: bool = False, reset_attention_mask: bool = False, allow_build: bool = True):
        self.indexed, self.seq_length, self.eod = indexed, seq_length, eod
        self.eod_mask_loss, self.reset_position_ids = eod_mask_loss, reset_position_ids
        self.reset_attention_mask = reset_attention_mask
        self.documents = np.asarray(documents, np.int64)
        description = {
            "class": "GPTDataset", "format": INDEX_FORMAT, "prefix": os.path.abspath(indexed.prefix),
            "fingerprint": cache.file_fingerprint(indexed.prefix), "split": split_name,
            "documents": [len(self.documents), hashlib.md5(self.documents.tobytes()).hexdigest()],
            "num_samples": int(num_samples), "seq_length": seq_length, "seed": seed,
        }
        self.description = description

        def build():
            return build_indices(indexed.sequence_lengths, self.documents, num_samples, seq_length, seed)

        arrays = cache.load_or_build(os.path.join(cache_dir, "indices"), description,
                                     ("document_index", "sample_index", "shuffle_index"),
                                     build if allow_build else None)
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        if len(self) < num_samples:
            raise ValueError(f"{indexed.prefix} ({split_name}): {len(self)} samples indexed, {num_samples} requested")

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def tokens(self, idx: int) -> np.ndarray:
        """The seq_length + 1 token ids of sample ``idx`` (int64)."""
        j = int(self.shuffle_index[idx])
        (d0, o0), (d1, o1) = self.sample_index[j], self.sample_index[j + 1]
        get, di = self.indexed.get, self.document_index
        if d0 == d1:
            parts = [get(int(di[d0]), int(o0), int(o1 - o0 + 1))]
        else:
            parts = [get(int(di[d0]), int(o0))]
            parts += [get(int(di[d])) for d in range(int(d0) + 1, int(d1))]
            parts.append(get(int(di[d1]), 0, int(o1) + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range [0, {len(self)})")
        return make_sample(self.tokens(idx), self.eod, self.eod_mask_loss, self.reset_position_ids,
                           self.reset_attention_mask)


def make_sample(text: np.ndarray, eod: int, eod_mask_loss: bool, reset_position_ids: bool,
                reset_attention_mask: bool = False) -> dict[str, torch.Tensor]:
    """seq_length + 1 ids -> inputs, next-token labels, loss mask and position ids (all [seq_length]).

    Megatron's ``get_ltor_masks_and_position_ids`` semantics; an eod token belongs to the document
    it ends. ``eod_mask_loss``: no loss where the INPUT is eod (predicting across the boundary).
    ``reset_position_ids``: positions restart at 0 after each eod. ``reset_attention_mask``: adds
    ``document_ids`` (int64, the number of eods before each position), from which attention builds
    a block-diagonal causal mask, so no token attends across a document boundary.
    """
    text = torch.from_numpy(np.ascontiguousarray(text, dtype=np.int64))
    tokens, labels = text[:-1].clone(), text[1:].clone()
    s = tokens.numel()
    loss_mask = torch.ones(s, dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    position_ids = torch.arange(s, dtype=torch.int64)
    if reset_position_ids:
        # positions restart after each eod: subtract the index where the current document began
        after_eod = torch.zeros(s, dtype=torch.int64)
        eods = torch.nonzero(tokens == eod).flatten()
        after_eod[eods[eods + 1 < s] + 1] = eods[eods + 1 < s] + 1
        position_ids = position_ids - torch.cummax(after_eod, 0).values
    sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
    if reset_attention_mask:
        is_eod = (tokens == eod).to(torch.int64)
        sample["document_ids"] = torch.cumsum(is_eod, 0) - is_eod  # eods strictly before each position
    return sample
