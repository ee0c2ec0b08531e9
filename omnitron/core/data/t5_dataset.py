"""T5 pre-training samples (Megatron's T5Dataset): span corruption with sentinel tokens.

Text comes exactly as for one-segment BERT (:class:`~omnitron.core.data.bert_dataset.BertDataset`
with ``binary_head=False``: the same sentence table, sample mapping and cache, special ids dropped):
consecutive sentences of a document up to ``seq_length - 2`` tokens (truncated at the end).

Noise (the T5 paper's ``random_spans_noise_mask``): of ``n`` text tokens, ``round(0.15 n)`` are
corrupted, in ``round(noise / 3)`` spans (mean length 3); the noise and the kept tokens are each
cut into that many random, non-empty runs (the kept text may also be empty before the first and
after the last span) and interleaved, so the masked fraction and the mean span length are exact per
sample and the span positions random. Span ``i`` (left to right) gets sentinel ``<extra_id_i>``:

* encoder input: the text with each span replaced by its sentinel, then [SEP] (the T5 paper's inputs
  end with the end token; it also keeps a text of special ids only from leaving no key to attend),
  padded with [PAD];
* decoder target (``labels``): ``<extra_id_0> span_0 <extra_id_1> span_1 ... [SEP]`` ([SEP] is the
  end of sequence), the loss mask 1 over it; decoder input: ``[CLS]`` (the start token) followed by
  the target shifted right by one; both padded to ``decoder_seq_length``.

Sample ``i`` is deterministic per ``(seed, i)`` (its own ``RandomState(seed + i)``). ``--mock-data``:
:class:`MockT5Dataset`, the same corruption of BERT's random mock sentences.
"""
from __future__ import annotations

import numpy as np
import torch

from .bert_dataset import BertDataset, MockBertDataset


def _partition(total: int, parts: int, rng: np.random.RandomState) -> np.ndarray:
    """``total`` split into ``parts`` random positive integers (uniform over the compositions)."""
    cuts = np.sort(rng.choice(total - 1, parts - 1, replace=False) + 1) if parts > 1 else np.zeros(0, np.int64)
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int64)


def noise_counts(n: int, noise_density: float = 0.15, mean_span_length: float = 3.0) -> tuple[int, int]:
    """``(corrupted tokens, spans)`` for a text of ``n`` tokens (no noise below two tokens)."""
    if n < 2:
        return 0, 0
    noise = min(max(int(round(n * noise_density)), 1), n - 1)
    spans = min(max(int(round(noise / mean_span_length)), 1), noise, n - noise + 1)
    return noise, spans


def random_spans_mask(n: int, rng: np.random.RandomState, *, noise_density: float = 0.15,
                      mean_span_length: float = 3.0) -> np.ndarray:
    """``[n]`` bool, True at corrupted tokens (see the module docstring)."""
    noise, spans = noise_counts(n, noise_density, mean_span_length)
    mask = np.zeros(n, bool)
    if spans == 0:
        return mask
    noise_runs = _partition(noise, spans, rng)
    kept_runs = _partition(n - noise + 2, spans + 1, rng)  # positive parts, then the two ends may be empty
    kept_runs[0] -= 1
    kept_runs[-1] -= 1
    pos = 0
    for kept, corrupt in zip(kept_runs[:-1], noise_runs):
        pos += int(kept)
        mask[pos:pos + int(corrupt)] = True
        pos += int(corrupt)
    return mask


def build_sample(text: np.ndarray, rng: np.random.RandomState, *, seq_length: int, decoder_seq_length: int,
                 ids: dict, sentinels, noise_density: float = 0.15, mean_span_length: float = 3.0) -> dict:
    """One sample from its text tokens; ``ids`` holds the ``cls`` (start), ``sep`` (end) and ``pad`` ids."""
    noise = random_spans_mask(len(text), rng, noise_density=noise_density, mean_span_length=mean_span_length)
    starts = noise & ~np.concatenate([[False], noise[:-1]])
    span = np.cumsum(starts) - 1  # span index of each corrupted token
    if starts.sum() > len(sentinels):
        raise ValueError(f"a sample needs {int(starts.sum())} sentinels, the tokenizer has {len(sentinels)}: raise "
                         "--vocab-extra-ids")
    sentinel = np.asarray(sentinels, np.int64)
    enc = np.concatenate([np.where(starts, sentinel[np.maximum(span, 0)], text)[~noise | starts], [ids["sep"]]])
    target = [ids["sep"]]
    if noise.any():
        pieces = np.split(np.flatnonzero(noise), np.flatnonzero(np.diff(np.flatnonzero(noise)) > 1) + 1)
        target = np.concatenate([np.concatenate([[sentinel[i]], text[p]]) for i, p in enumerate(pieces)] +
                                [[ids["sep"]]])
    n, t = len(enc), len(target)
    if n > seq_length or t > decoder_seq_length:
        raise ValueError(f"a sample needs {n} encoder / {t} decoder tokens, more than --seq-length {seq_length} / "
                         f"--decoder-seq-length {decoder_seq_length}; raise them")
    out = {"tokens": np.full(seq_length, ids["pad"], np.int64),
           "decoder_tokens": np.full(decoder_seq_length, ids["pad"], np.int64),
           "labels": np.full(decoder_seq_length, ids["pad"], np.int64),
           "loss_mask": np.zeros(decoder_seq_length, np.float32)}
    out["tokens"][:n] = enc
    out["labels"][:t], out["loss_mask"][:t] = target, 1.0
    out["decoder_tokens"][:t] = np.concatenate([[ids["cls"]], target[:-1]])
    sample = {k: torch.from_numpy(v) for k, v in out.items()}
    sample["padding_mask"] = torch.arange(seq_length) >= n
    return sample


def required_lengths(seq_length: int, noise_density: float = 0.15, mean_span_length: float = 3.0) -> tuple[int, int]:
    """``(decoder tokens, sentinels)`` the longest sample of a ``seq_length`` encoder may need."""
    worst = [noise_counts(n, noise_density, mean_span_length) for n in range(max(seq_length - 1, 1))]
    return max(a + b + 1 for a, b in worst), max(b for _, b in worst)


class _SpanCorruption:
    """T5 samples over a BERT text source (real or mock): :meth:`build` corrupts sample ``idx``'s text."""

    def _init_corruption(self, tokenizer, seq_length: int, decoder_seq_length: int, noise_density: float,
                         mean_span_length: float) -> None:
        """Check the tokenizer's sentinels and the decoder length against the longest sample; keep the settings."""
        sentinels = tuple(getattr(tokenizer, "sentinels", ()))
        if not sentinels:
            raise ValueError(f"T5 data needs sentinel tokens; {tokenizer.name} has none: use --tokenizer-type "
                             "BertWordPieceLowerCase (or BertWordPieceCase) with --vocab-extra-ids 100")
        dec, spans = required_lengths(seq_length, noise_density, mean_span_length)
        if decoder_seq_length < dec:
            raise ValueError(f"--decoder-seq-length {decoder_seq_length} is too short for --seq-length {seq_length}: "
                             f"a target can need {dec} tokens (sentinels + corrupted spans + end); use at least {dec}")
        if len(sentinels) < spans:
            raise ValueError(f"--vocab-extra-ids {len(sentinels)}: a sample of --seq-length {seq_length} can have "
                             f"{spans} corrupted spans, one sentinel each; use at least {spans}")
        self.decoder_seq_length, self.sentinels = decoder_seq_length, sentinels
        self.noise_density, self.mean_span_length = noise_density, mean_span_length

    def build(self, idx: int, rng: np.random.RandomState) -> dict[str, torch.Tensor]:
        """Sample ``idx``: its text (sentences joined, truncated) corrupted with its own ``rng``."""
        text = np.concatenate(self.sentences(idx))[: self.seq_length - 2]
        return build_sample(text, rng, seq_length=self.seq_length, decoder_seq_length=self.decoder_seq_length,
                            ids=self.ids, sentinels=self.sentinels, noise_density=self.noise_density,
                            mean_span_length=self.mean_span_length)


class MockT5Dataset(_SpanCorruption, MockBertDataset):
    """``--mock-data`` for T5: :class:`MockBertDataset`'s random sentences (sample ``i`` depends only on
    ``(seed, i)``), corrupted into T5 samples as :class:`T5Dataset` does."""

    def __init__(self, num_samples: int, *, seq_length: int, decoder_seq_length: int, seed: int, tokenizer,
                 noise_density: float = 0.15, mean_span_length: float = 3.0):
        self._init_corruption(tokenizer, seq_length, decoder_seq_length, noise_density, mean_span_length)
        super().__init__(num_samples, seq_length=seq_length, seed=seed, tokenizer=tokenizer, binary_head=False)


class T5Dataset(_SpanCorruption, BertDataset):
    """T5 samples (see the module docstring) from the documents ``documents`` of ``indexed``:
    ``dict(tokens, padding_mask [seq_length], decoder_tokens, labels, loss_mask [decoder_seq_length])``."""

    mock_cls = MockT5Dataset

    def __init__(self, indexed, documents: np.ndarray, num_samples: int, *, seq_length: int, decoder_seq_length: int,
                 seed: int, tokenizer, cache_dir: str, split_name: str = "train", noise_density: float = 0.15,
                 mean_span_length: float = 3.0, short_seq_prob: float = 0.1, allow_build: bool = True):
        self._init_corruption(tokenizer, seq_length, decoder_seq_length, noise_density, mean_span_length)
        super().__init__(indexed, documents, num_samples, seq_length=seq_length, seed=seed, tokenizer=tokenizer,
                         cache_dir=cache_dir, split_name=split_name, binary_head=False,
                         short_seq_prob=short_seq_prob, allow_build=allow_build)


def build_t5_datasets(config, tokenizer, *, train_samples: int, valid_samples: int, test_samples: int,
                      decoder_seq_length: int, is_builder_rank: bool = True, barrier=None):
    """(train, valid, test) :class:`T5Dataset` splits of ``config.data_path``, of the bundled corpus split
    into sentences, or :class:`MockT5Dataset` with ``--mock-data``; built like BERT's
    (:func:`~omnitron.core.data.bert_dataset.build_bert_datasets`)."""
    from .bert_dataset import build_bert_datasets

    return build_bert_datasets(config, tokenizer, train_samples=train_samples, valid_samples=valid_samples,
                               test_samples=test_samples, is_builder_rank=is_builder_rank, barrier=barrier,
                               dataset_cls=T5Dataset, decoder_seq_length=decoder_seq_length)
