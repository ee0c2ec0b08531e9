"""GPT pre-training samples cut from an indexed dataset: document, sample and shuffle indices.

For one split (a contiguous range of documents) and a requested number of samples, Megatron's
algorithm (megatron/core/datasets/gpt_dataset.py), with the same ``RandomState(seed)`` draws, so the
samples come in Megatron's order:
  document index  the split's documents repeated for as many epochs as the samples need, shuffled
                  together; a final epoch used for less than 80% of its samples is shuffled on its own
                  after the others (so the full epochs cover every document before it starts)
  sample index    [n + 1, 2]: (position in the document index, token offset) where sample i
                  starts; sample i is the seq_length + 1 tokens from its start to the next
                  sample's start inclusive (samples overlap by one token)
  shuffle index   a permutation of the samples (the separated final epoch's samples shuffled
                  among themselves, after all the others)
All three are numpy arrays, deterministic for a seed, cached on disk (``cache.py``).
Here a "document" is one sequence of the indexed dataset (preprocessing writes one per document).
"""
from __future__ import annotations

import hashlib
import os

import numpy as np
import torch

from . import cache
from .indexed import IndexedDataset

INDEX_FORMAT = 2  # bump when the index algorithm changes, so old caches are not reused (2: Megatron's order)
FINAL_EPOCH_THRESHOLD = 0.80  # a last epoch used for less than this share of its samples is shuffled apart
NO_PAD = -1  # Megatron's _PAD_TOKEN_ID: an id no dataset holds (check_vocabulary refuses negative ids)


def dataset_pad_id(own_pad: int | None, eod: int, allow_ambiguous: bool = False) -> int:
    """The pad id GPT samples mask, by Megatron's rule (megatron_dataset.py): the tokenizer's own pad, but
    ``NO_PAD`` when it has none, or when it equals the eod (also its eos) unless ``allow_ambiguous``
    (``--allow-ambiguous-pad-tokens``), since masking it would drop every document end from the loss."""
    if own_pad is None or (own_pad == eod and not allow_ambiguous):
        return NO_PAD
    return int(own_pad)


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int | None) -> int:
    """Fewest epochs whose tokens give ``num_samples`` samples of ``seq_length + 1`` tokens (None: one epoch)."""
    if tokens_per_epoch <= 0:
        raise ValueError("the split has no tokens; check --split and that the dataset is not empty")
    if num_samples is None:
        return 1
    need_tokens = num_samples * seq_length + 1
    return max(1, -(-need_tokens // tokens_per_epoch))


def separate_final_epoch(tokens_per_epoch: int, seq_length: int, num_samples: int | None, epochs: int) -> bool:
    """Whether the last epoch is shuffled apart: it gives less than 80% of an epoch's samples (Megatron)."""
    if epochs == 1:
        return False
    before_final = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
    per_epoch = (tokens_per_epoch - 1) // seq_length
    return num_samples - before_final < int(FINAL_EPOCH_THRESHOLD * per_epoch)


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final: bool = False) -> np.ndarray:
    """``documents`` repeated ``num_epochs`` times and shuffled as one array (int32); with ``separate_final``
    the first ``num_epochs - 1`` repeats are shuffled together and the last one after them on its own."""
    if separate_final and num_epochs > 1:
        return np.concatenate((build_document_index(documents, num_epochs - 1, rng),
                               build_document_index(documents, 1, rng)))
    index = np.tile(np.asarray(documents, np.int32), num_epochs)
    rng.shuffle(index)
    return index


def build_sample_index(doc_lengths: np.ndarray, seq_length: int) -> np.ndarray:
    """[n + 1, 2] start (doc position, offset) of each sample over documents of ``doc_lengths`` tokens:
    sample i starts at token i * seq_length of the concatenated documents (Megatron's build_sample_idx)."""
    cum = np.zeros(len(doc_lengths) + 1, np.int64)
    np.cumsum(doc_lengths, out=cum[1:])
    n = int((cum[-1] - 1) // seq_length) if cum[-1] > 0 else 0
    starts = np.arange(n + 1, dtype=np.int64) * seq_length
    pos = np.searchsorted(cum, starts, side="right") - 1  # last document starting at or before each token
    out = np.empty((n + 1, 2), np.int64)
    out[:, 0] = pos
    out[:, 1] = starts - cum[pos]
    return out


def build_shuffle_index(num_samples: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """[0, num_samples) shuffled, then [num_samples, total) shuffled on its own after it (int64)."""
    first = np.arange(num_samples, dtype=np.int64)
    rng.shuffle(first)
    if num_samples == total:
        return first
    last = np.arange(num_samples, total, dtype=np.int64)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_indices(lengths: np.ndarray, documents: np.ndarray, num_samples: int | None, seq_length: int,
                  seed: int) -> dict[str, np.ndarray]:
    """Document, sample and shuffle indices for ``documents`` (ids into ``lengths``); ``num_samples`` None:
    exactly one epoch. The draws from ``RandomState(seed)`` are Megatron's, in Megatron's order."""
    rng = np.random.RandomState(seed)
    per_epoch = int(lengths[documents].sum(dtype=np.int64))
    epochs = num_epochs_needed(per_epoch, seq_length, num_samples)
    separate = separate_final_epoch(per_epoch, seq_length, num_samples, epochs)
    doc_index = build_document_index(documents, epochs, rng, separate)
    sample_index = build_sample_index(lengths[doc_index].astype(np.int64), seq_length)
    total = len(sample_index) - 1
    shuffled_together = ((epochs - 1) * per_epoch - 1) // seq_length if separate else total
    shuffle_index = build_shuffle_index(shuffled_together, total, rng)
    return {"document_index": doc_index, "sample_index": sample_index, "shuffle_index": shuffle_index}


class GPTDataset(torch.utils.data.Dataset):
    """Samples ``dict(tokens, labels, loss_mask, position_ids)``, each ``[seq_length]``, from one split
    (plus ``document_ids`` with ``reset_attention_mask``; see :func:`make_sample`).

    ``len(self) >= num_samples`` (whole epochs are indexed; ``num_samples`` None: one epoch). Build the indices
    on one rank (``allow_build=True``) and load them elsewhere (``allow_build=False``).
    """

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, num_samples: int | None, *, seq_length: int,
                 seed: int, eod: int, cache_dir: str, split_name: str = "train", eod_mask_loss: bool = False,
                 reset_position_ids: bool = False, reset_attention_mask: bool = False, allow_build: bool = True,
                 pad: int = NO_PAD):
        self.indexed, self.seq_length, self.eod, self.pad = indexed, seq_length, eod, pad
        self.eod_mask_loss, self.reset_position_ids = eod_mask_loss, reset_position_ids
        self.reset_attention_mask = reset_attention_mask
        self.documents = np.asarray(documents, np.int64)
        description = {
            "class": "GPTDataset", "format": INDEX_FORMAT, "prefix": os.path.abspath(indexed.prefix),
            "fingerprint": cache.file_fingerprint(indexed.prefix, cache_dir), "split": split_name,
            "documents": [len(self.documents), hashlib.md5(self.documents.tobytes()).hexdigest()],
            "num_samples": None if num_samples is None else int(num_samples), "seq_length": seq_length, "seed": seed,
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
        if num_samples is not None and len(self) < num_samples:
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
                           self.reset_attention_mask, pad=self.pad)


def make_sample(text: np.ndarray, eod: int, eod_mask_loss: bool, reset_position_ids: bool,
                reset_attention_mask: bool = False, pad: int = NO_PAD) -> dict[str, torch.Tensor]:
    """seq_length + 1 ids -> inputs, next-token labels, loss mask and position ids (all [seq_length]).

    Megatron's ``get_ltor_masks_and_position_ids`` semantics; an eod token belongs to the document
    it ends. ``eod_mask_loss``: no loss where the INPUT is eod (predicting across the boundary).
    ``reset_position_ids``: positions restart at 0 after each eod. ``reset_attention_mask``: adds
    ``document_ids`` (int64, the number of eods before each position), from which attention builds
    a block-diagonal causal mask, so no token attends across a document boundary.
    ``pad`` (see :func:`dataset_pad_id`; after the above, as Megatron's GPTDataset): no loss where the LABEL is
    pad, and pad ids in tokens and labels read 0, so the embedding can look them up.
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
    if pad != NO_PAD:
        loss_mask[labels == pad] = 0.0
        tokens[tokens == pad] = 0
        labels[labels == pad] = 0
    return sample
