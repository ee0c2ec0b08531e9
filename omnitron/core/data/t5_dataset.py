"""T5 pre-training samples (Megatron's T5MaskedWordPieceDataset): whole-word n-gram spans, sentinel tokens.

Text comes exactly as for one-segment BERT (:class:`~omnitron.core.data.bert_dataset.BertDataset`
with ``binary_head=False``: the same sentence table, sample mapping and cache, special ids kept):
consecutive sentences of a document, cut to the sample's target length (at most ``seq_length - 2``).

Noise (Megatron's masked-dataset rules with T5's settings: whole words, n-grams of up to 10 words, n drawn
from a geometric(0.2) distribution clipped at 10): a word is a token plus the ``##`` pieces after it (a [CLS]
or [SEP] id in the text is none, and a piece after it joins the word before it, as Megatron). The
budget is ``min(p * target, max(1, round(p * n)))`` tokens, ``p`` = ``--mask-prob`` (default 0.15). The
words are visited in a random order; at each, n is drawn, shortened until the n words from it fit in what
is left of the budget (the word is skipped when even one does not fit) and the n-gram is masked unless it
overlaps one already masked. Spans are never merged, so two may touch. In the rare sample whose target
(below) would not fit the decoder (Megatron stops with an assertion there) the last spans are left as text
until it fits. Span ``i`` (left to right) gets sentinel ``<extra_id_i>``:

* encoder input: the text with each span replaced by its sentinel (no end token), padded with [PAD];
  ``padding_mask`` where it holds the [PAD] id (Megatron's ``encoder_input == pad``);
* decoder target (``labels``): ``<extra_id_0> span_0 <extra_id_1> span_1 ... [SEP]`` ([SEP] is the
  end of sequence), the loss mask 1 over it; decoder input: ``[CLS]`` (the start token) followed by
  the target shifted right by one; both padded to ``decoder_seq_length``; ``decoder_padding_mask`` where the
  decoder input holds the [PAD] id (Megatron's ``dec_mask``: no later decoder position attends to it).

Sample ``i`` is deterministic per ``(seed, i)`` (its own ``RandomState(seed + i)``, drawn in Megatron's
order, so the same text and seed give Megatron's spans). ``--mock-data``: :class:`MockT5Dataset`, the
same corruption of BERT's random mock sentences.
"""
from __future__ import annotations

import numpy as np
import torch

from .bert_dataset import BertDataset, MockBertDataset
from .bert_dataset import word_candidates as bert_words

MAX_NGRAM, GEOMETRIC_P = 10, 0.2  # Megatron's pretrain_t5 settings (masking_max_ngram, SpanBERT's p)


def word_candidates(text: np.ndarray, subword_ids, boundary_ids=()) -> list[list[int]]:
    """Positions of ``text`` grouped into words: a token not in ``subword_ids`` (``##`` pieces) starts one, and
    one of ``boundary_ids`` (the [CLS] and [SEP] ids) is none (BERT's grouping,
    :func:`omnitron.core.data.bert_dataset.word_candidates`)."""
    continues = np.isin(text, np.asarray(subword_ids, np.int64))
    return bert_words(np.isin(text, np.asarray(boundary_ids, np.int64)), continues)


def masked_spans(text: np.ndarray, rng: np.random.RandomState, *, subword_ids=(), target_length: int | None = None,
                 masked_lm_prob: float = 0.15, max_ngram: int = MAX_NGRAM, boundary_ids=()) -> list[list[int]]:
    """The corrupted spans of ``text`` (lists of positions, left to right); see the module docstring."""
    words = word_candidates(text, subword_ids, boundary_ids)
    target = len(text) if target_length is None else target_length
    budget = min(masked_lm_prob * target, max(1, int(round(len(text) * masked_lm_prob))))
    order = np.arange(len(words))
    rng.shuffle(order)
    spans, taken, count = [], np.zeros(len(text), bool), 0
    for w in order:
        if count >= budget:
            break
        n = min(int(rng.geometric(GEOMETRIC_P)), max_ngram)
        while n > 0 and count + sum(len(x) for x in words[w:w + n]) > budget:
            n -= 1
        if n == 0:
            continue
        span = [p for x in words[w:w + n] for p in x]
        if taken[span].any():
            continue
        taken[span], count = True, count + len(span)
        spans.append(span)
    return sorted(spans)


def masked_count(n: int, masked_lm_prob: float = 0.15) -> int:
    """The most tokens a text of ``n`` tokens has corrupted (none for an empty text)."""
    return min(n, max(1, int(round(n * masked_lm_prob)))) if n else 0


def build_sample(text: np.ndarray, rng: np.random.RandomState, *, seq_length: int, decoder_seq_length: int,
                 ids: dict, sentinels, subword_ids=(), target_length: int | None = None,
                 masked_lm_prob: float = 0.15) -> dict:
    """One sample from its text tokens; ``ids`` holds the ``cls`` (start), ``sep`` (end) and ``pad`` ids."""
    spans = masked_spans(text, rng, subword_ids=subword_ids, target_length=target_length,
                         masked_lm_prob=masked_lm_prob, boundary_ids=(ids["cls"], ids["sep"]))
    if len(spans) > len(sentinels):
        raise ValueError(f"a sample needs {len(spans)} sentinels, the tokenizer has {len(sentinels)}: raise "
                         "--vocab-extra-ids")
    while spans and sum(map(len, spans)) + len(spans) + 1 > decoder_seq_length:
        spans.pop()  # a rare target too long for the decoder (Megatron stops there): the last span stays text
    enc, target, begin = [], [], 0
    for sentinel, span in zip(sentinels, spans):
        enc += text[begin:span[0]].tolist() + [sentinel]
        target += [sentinel] + text[span].tolist()
        begin = span[-1] + 1
    enc += text[begin:].tolist()
    target.append(ids["sep"])
    n, t = len(enc), len(target)  # the text was cut to at most seq_length - 2 tokens; the target fits (above)
    out = {"tokens": np.full(seq_length, ids["pad"], np.int64),
           "decoder_tokens": np.full(decoder_seq_length, ids["pad"], np.int64),
           "labels": np.full(decoder_seq_length, ids["pad"], np.int64),
           "loss_mask": np.zeros(decoder_seq_length, np.float32)}
    out["tokens"][:n] = enc
    out["labels"][:t], out["loss_mask"][:t] = target, 1.0
    out["decoder_tokens"][:t] = [ids["cls"]] + target[:-1]
    sample = {k: torch.from_numpy(v) for k, v in out.items()}
    sample["padding_mask"] = torch.from_numpy(out["tokens"] == ids["pad"])  # Megatron's: by id, not position
    sample["decoder_padding_mask"] = torch.from_numpy(out["decoder_tokens"] == ids["pad"])  # its dec_mask, likewise
    return sample


def corruption_problem(seq_length: int, decoder_seq_length: int, sentinels: int, masked_lm_prob: float) -> str | None:
    """Why samples of ``seq_length`` corrupted at ``masked_lm_prob`` (``--mask-prob``) do not fit the decoder or the
    ``sentinels`` (None when they do): a target holds at least the corrupted tokens, a sentinel and the end, and a
    sample has at most as many spans as corrupted tokens."""
    most = masked_count(max(seq_length - 2, 0), masked_lm_prob)
    if decoder_seq_length < most + 2:
        return (f"--decoder-seq-length {decoder_seq_length} is too short for --seq-length {seq_length} at --mask-prob "
                f"{masked_lm_prob}: a target can hold {most} corrupted tokens, a sentinel and the end; use at least "
                f"{most + 2}")
    if sentinels < most:
        return (f"--vocab-extra-ids {sentinels}: a sample of --seq-length {seq_length} at --mask-prob "
                f"{masked_lm_prob} can have {most} corrupted spans, one sentinel each; use at least {most}")
    return None


class _SpanCorruption:
    """T5 samples over a BERT text source (real or mock): :meth:`build` corrupts sample ``idx``'s text."""

    def _init_corruption(self, tokenizer, seq_length: int, decoder_seq_length: int, masked_lm_prob: float) -> None:
        """Check the tokenizer's sentinels and the decoder length against the most corrupted tokens; keep them.

        A target holds the corrupted tokens, one sentinel per span and the end token: at least ``m + 2`` for
        ``m`` corrupted tokens, at most ``2 m + 1`` (one-token spans, rare with whole-word n-grams). Only the
        first is required, so Megatron's --seq-length 512 with --decoder-seq-length 128 runs; where Megatron
        stops at a sample whose target is longer than the decoder, its last spans stay text instead."""
        sentinels = tuple(getattr(tokenizer, "sentinels", ()))
        if not sentinels:
            raise ValueError(f"T5 data needs sentinel tokens; {tokenizer.name} has none: use --tokenizer-type "
                             "BertWordPieceLowerCase (or BertWordPieceCase) with --vocab-extra-ids 100")
        problem = corruption_problem(seq_length, decoder_seq_length, len(sentinels), masked_lm_prob)
        if problem:
            raise ValueError(problem)
        self.decoder_seq_length, self.sentinels, self.masked_lm_prob = decoder_seq_length, sentinels, masked_lm_prob
        self.subword_ids = tuple(getattr(tokenizer, "continuation_ids", ()))

    @staticmethod
    def max_text_tokens(seq_length: int) -> int:
        """The sample mapping's target length: ``seq_length - 2`` (Megatron's T5 index; no [CLS] / [SEP])."""
        return seq_length - 2

    def target_length(self, idx: int) -> int:
        """The text length sample ``idx`` aims at: its mapping row's target (``seq_length - 2`` for mock data)."""
        mapping = getattr(self, "mapping", None)
        return int(mapping[idx][2]) if mapping is not None else self.seq_length - 2

    def build(self, idx: int, rng: np.random.RandomState) -> dict[str, torch.Tensor]:
        """Sample ``idx``: its text (sentences joined, cut to the target length) corrupted with its own ``rng``."""
        target = self.target_length(idx)
        text = np.concatenate(self.sentences(idx))[:target]
        return build_sample(text, rng, seq_length=self.seq_length, decoder_seq_length=self.decoder_seq_length,
                            ids=self.ids, sentinels=self.sentinels, subword_ids=self.subword_ids,
                            target_length=target, masked_lm_prob=self.masked_lm_prob)


class MockT5Dataset(_SpanCorruption, MockBertDataset):
    """``--mock-data`` for T5: :class:`MockBertDataset`'s random sentences (sample ``i`` depends only on
    ``(seed, i)``), corrupted into T5 samples as :class:`T5Dataset` does."""

    def __init__(self, num_samples: int, *, seq_length: int, decoder_seq_length: int, seed: int, tokenizer,
                 masked_lm_prob: float = 0.15):
        self._init_corruption(tokenizer, seq_length, decoder_seq_length, masked_lm_prob)
        super().__init__(num_samples, seq_length=seq_length, seed=seed, tokenizer=tokenizer, binary_head=False,
                         masked_lm_prob=masked_lm_prob)


class T5Dataset(_SpanCorruption, BertDataset):
    """T5 samples (see the module docstring) from the documents ``documents`` of ``indexed``:
    ``dict(tokens, padding_mask [seq_length], decoder_tokens, decoder_padding_mask, labels, loss_mask
    [decoder_seq_length])``."""

    mock_cls = MockT5Dataset

    def __init__(self, indexed, documents: np.ndarray, num_samples: int, *, seq_length: int, decoder_seq_length: int,
                 seed: int, tokenizer, cache_dir: str, split_name: str = "train", masked_lm_prob: float = 0.15,
                 short_seq_prob: float = 0.1, allow_build: bool = True):
        self._init_corruption(tokenizer, seq_length, decoder_seq_length, masked_lm_prob)
        super().__init__(indexed, documents, num_samples, seq_length=seq_length, seed=seed, tokenizer=tokenizer,
                         cache_dir=cache_dir, split_name=split_name, binary_head=False,
                         masked_lm_prob=masked_lm_prob, short_seq_prob=short_seq_prob, allow_build=allow_build)


def build_t5_datasets(config, tokenizer, *, train_samples: int, valid_samples: int, test_samples: int,
                      decoder_seq_length: int, is_builder_rank: bool = True, barrier=None,
                      is_node_builder: bool = False):
    """(train, valid, test) :class:`T5Dataset` splits of ``config.data_path``, of the bundled corpus split
    into sentences, or :class:`MockT5Dataset` with ``--mock-data``; built like BERT's
    (:func:`~omnitron.core.data.bert_dataset.build_bert_datasets`)."""
    from .bert_dataset import build_bert_datasets

    return build_bert_datasets(config, tokenizer, train_samples=train_samples, valid_samples=valid_samples,
                               test_samples=test_samples, is_builder_rank=is_builder_rank, barrier=barrier,
                               is_node_builder=is_node_builder, dataset_cls=T5Dataset,
                               decoder_seq_length=decoder_seq_length)
