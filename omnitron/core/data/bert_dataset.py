"""BERT pre-training samples (Megatron's BertDataset): two segments, sentence order, masked LM.

Documents are lists of sentences, one sequence each (``omnitron preprocess --split-sentences`` and
:func:`bert_corpus_prefix` write them so), read as Megatron reads them. Only where Megatron would find no sample
(two segments over documents none of which holds two sequences: text not split into sentences) is each document
cut into spans of ``min(max_tokens // 4, 512)`` tokens that stand in for sentences. The text is read as it is,
special ids included (an [UNK] the tokenizer wrote, an eod = [SEP] appended by preprocessing), as Megatron's
``BERTMaskedWordPieceDataset`` reads it.

Sample mapping (numpy, cached like the GPT indices): Megatron's ``helpers.build_mapping`` row for row
(:mod:`omnitron.core.data.sample_mapping`): documents of at least two sentences (one without the binary head; none
longer than 512 tokens) packed up to a target of ``seq_length - 3`` text tokens (with or without the binary head,
as Megatron), a random shorter one with probability about ``--short-seq-prob`` (default 0.1); whole epochs until
the samples asked for, shuffled as Megatron shuffles them.

Sample ``i`` (deterministic per ``(seed, i)``: its own ``RandomState(seed + i)``): segment A =
the first ``k`` sentences (k random), B = the rest; with probability 1/2 A and B are swapped
(``is_random`` = 1: Megatron's sentence-order task); the longer segment (B on a tie) is trimmed at a
random end until both fit the sample's target (a short sample is cut to its shorter target, as
Megatron); ``[CLS] A [SEP] B [SEP]`` with token types 0 / 1, padded to ``seq_length``.
Masking (Megatron's ``BERTMaskedWordPieceDataset``, draw for draw): whole words (a WordPiece ``##`` piece joins
the word before it; per token for a tokenizer without them; a [CLS] or [SEP] id, also one in the text, is no
candidate) in n-grams of 1-3 words drawn with probability proportional to 1/n, at most
``min(15% x target, round(15% x tokens incl. [CLS]/[SEP]))`` tokens; each masked token becomes [MASK]
(80%), a random id of the whole vocabulary (10%; Megatron's ``token_lookup``, special ids included) or
stays (10%); labels and loss mask only there. The 15% is ``--mask-prob`` (Megatron's flag, default 0.15).
``padding_mask`` is where the sample's tokens hold the [PAD] id (Megatron's ``tokens == pad``: the padding, and
a [PAD] in the text or drawn as a random replacement).
"""
from __future__ import annotations

import hashlib
import os

import numpy as np
import torch

from . import cache
from .indexed import IndexedDataset, IndexedDatasetBuilder, data_file, exists, index_file, optimal_dtype
from .sample_mapping import LONG_SENTENCE, build_sample_mapping
from .sentences import split_sentences

INDEX_FORMAT = 3  # 3: Megatron's build_mapping (2: one-segment samples aim at seq_length - 3 text tokens)


def sentence_table(indexed: IndexedDataset, documents: np.ndarray, span: int | None) -> dict[str, np.ndarray]:
    """Sentences of ``documents``: ``bounds [n_docs + 1]`` (each document's first sentence) and per
    sentence its ``seq``, ``offset`` and ``length``; one-sequence documents cut into ``span`` tokens (None: each
    sequence is one sentence, as Megatron reads them)."""
    seq, off, length, bounds = [], [], [], [0]
    di, lens = indexed.document_indices, indexed.sequence_lengths
    for d in documents:
        lo, hi = int(di[d]), int(di[d + 1])
        if hi - lo == 1 and span:
            n = int(lens[lo])
            starts = np.arange(0, n, span)
            seq.append(np.full(len(starts), lo))
            off.append(starts)
            length.append(np.minimum(span, n - starts))
        else:
            seq.append(np.arange(lo, hi))
            off.append(np.zeros(hi - lo, np.int64))
            length.append(lens[lo:hi].astype(np.int64))
        bounds.append(bounds[-1] + len(seq[-1]))
    cat = (lambda xs: np.concatenate(xs).astype(np.int64)) if seq else (lambda xs: np.zeros(0, np.int64))
    return {"bounds": np.asarray(bounds, np.int64), "seq": cat(seq), "offset": cat(off), "length": cat(length)}


def truncate_segments(a: np.ndarray, b: np.ndarray, max_tokens: int, rng: np.random.RandomState):
    """Trim the longer segment (B on a tie, as Megatron) at a random end (front or back) until
    ``len(a) + len(b) <= max_tokens``."""
    while len(a) + len(b) > max_tokens:
        longer = len(a) > len(b)
        t = a if longer else b
        t = t[1:] if rng.random_sample() < 0.5 else t[:-1]
        a, b = (t, b) if longer else (a, t)
    return a, b


def word_candidates(special: np.ndarray, continues: np.ndarray) -> list[list[int]]:
    """Positions of the whole words of a sample: every non-``special`` position starts a word unless it
    ``continues`` one (a ``##`` piece), which joins the word before it (Megatron's rule: also across a
    [SEP]; a leading continuation is a word of its own)."""
    words: list[list[int]] = []
    for i in np.flatnonzero(~special):
        if continues[i] and words:
            words[-1].append(int(i))
        else:
            words.append([int(i)])
    return words


def mask_count(n_tokens: int, target: int, prob: float) -> float:
    """Megatron's masking budget: ``min(prob * target, max(1, round(prob * n_tokens)))``, ``n_tokens``
    counting [CLS] and [SEP] (a float: a sample masks at most this many tokens)."""
    return min(prob * target, max(1, int(round(n_tokens * prob))))


def choose_ngrams(words: list[list[int]], budget: float, rng: np.random.RandomState, max_ngram: int = 3):
    """Megatron's n-gram choice, in its order of random draws: visit the words shuffled; at each draw
    ``n`` in ``1..max_ngram`` with probability proportional to ``1/n`` and shrink it until the ``n`` words
    from there fit the budget; skip a word whose 1-gram does not fit or that overlaps a chosen n-gram.
    Yields each chosen n-gram's positions (the caller draws each token's replacement, in order)."""
    nvals = np.arange(1, max_ngram + 1)
    probs = 1.0 / nvals
    probs = probs / probs.sum()
    order = np.arange(len(words))
    rng.shuffle(order)
    taken: set[int] = set()
    for w in order:
        if len(taken) >= budget:
            return
        n = int(rng.choice(nvals, p=probs / probs.sum()))
        while n > 0 and len(taken) + len(span := sum(words[w:w + n], [])) > budget:
            n -= 1
        if n == 0 or taken.intersection(span):
            continue
        taken.update(span)
        yield span


def mask_tokens(tokens: np.ndarray, special: np.ndarray, rng: np.random.RandomState, *, mask_id: int,
                vocab_ids: np.ndarray, target: int, continuation: np.ndarray | None = None,
                masked_lm_prob: float = 0.15):
    """Megatron's whole-word n-gram masking of ``tokens`` (a copy is returned): the positions not
    ``special`` grouped into words (:func:`word_candidates`; single tokens when ``continuation`` is
    None), n-grams of 1-3 words chosen up to :func:`mask_count` tokens (:func:`choose_ngrams`); each
    chosen token becomes [MASK] (80%), a random id from ``vocab_ids`` (10%) or stays (10%).
    Returns ``(masked tokens, chosen positions sorted, original ids there)``."""
    continues = np.zeros(len(tokens), bool)
    if continuation is not None:
        known = tokens < len(continuation)
        continues[known] = continuation[tokens[known]]
    words = word_candidates(special, continues)
    out, chosen = tokens.copy(), []
    for span in choose_ngrams(words, mask_count(len(tokens), target, masked_lm_prob), rng):
        for p in span:
            if rng.random_sample() < 0.8:
                out[p] = mask_id
            elif rng.random_sample() >= 0.5:
                out[p] = vocab_ids[rng.randint(len(vocab_ids))]
            chosen.append(p)
    chosen = np.sort(np.asarray(chosen, np.int64))
    return out, chosen, tokens[chosen]


def build_sample(sentences: list[np.ndarray], rng: np.random.RandomState, *, seq_length: int, ids: dict,
                 vocab_ids: np.ndarray, binary_head: bool = True, masked_lm_prob: float = 0.15,
                 target: int | None = None, continuation: np.ndarray | None = None) -> dict:
    """One training sample from its sentences; ``ids`` holds the ``cls``, ``sep``, ``mask`` and ``pad`` ids.
    The segments are cut to ``target`` text tokens (the mapping's target: shorter for a short sample;
    default the most that fit); ``continuation`` marks the ``##`` ids for whole-word masking."""
    is_random = 0
    room = text_room(seq_length)
    target = room if target is None else min(int(target), room)
    if binary_head:
        k = int(rng.randint(1, len(sentences))) if len(sentences) >= 3 else 1
        a, b = np.concatenate(sentences[:k]), np.concatenate(sentences[k:])
        if rng.random_sample() < 0.5:
            a, b, is_random = b, a, 1
        a, b = truncate_segments(a, b, target, rng)
    else:
        a, b = truncate_segments(np.concatenate(sentences), np.zeros(0, np.int64), target, rng)
    cls, sep = [ids["cls"]], [ids["sep"]]
    parts = [cls, a, sep] + ([b, sep] if binary_head else [])
    tokens = np.concatenate([np.asarray(p, np.int64) for p in parts])
    types = np.zeros(len(tokens), np.int64)
    types[len(a) + 2:] = 1
    special = np.isin(tokens, (ids["cls"], ids["sep"]))  # Megatron's rule: by id, a text [SEP] included
    masked, pos, orig = mask_tokens(tokens, special, rng, mask_id=ids["mask"], vocab_ids=vocab_ids, target=target,
                                    continuation=continuation, masked_lm_prob=masked_lm_prob)
    n, s = len(tokens), seq_length
    out = {"tokens": np.full(s, ids["pad"], np.int64), "tokentype_ids": np.zeros(s, np.int64),
           "labels": np.full(s, ids["pad"], np.int64), "loss_mask": np.zeros(s, np.float32)}
    out["tokens"][:n], out["tokentype_ids"][:n] = masked, types
    out["labels"][pos], out["loss_mask"][pos] = orig, 1.0
    sample = {k: torch.from_numpy(v) for k, v in out.items()}
    sample["padding_mask"] = torch.from_numpy(out["tokens"] == ids["pad"])  # Megatron's: by id, not position
    sample["is_random"] = torch.tensor(is_random, dtype=torch.int64)
    return sample


def replacement_ids(tokenizer) -> np.ndarray:
    """The ids the 10% random replacement draws from: the whole vocabulary, special ids included (Megatron's
    ``token_lookup = sorted(tokenizer.inv_vocab)``)."""
    return np.arange(tokenizer.vocab_size)


def text_room(seq_length: int) -> int:
    """The most text tokens of a BERT sample: ``seq_length - 3`` (one [CLS], two [SEP]s), also with one segment
    (Megatron's ``BERTMaskedWordPieceDataset`` builds its sample index at ``sequence_length - 3`` either way)."""
    return seq_length - 3


def continuation_table(tokenizer) -> np.ndarray:
    """``[vocab_size]`` bool: the tokenizer's ``##`` continuation ids (its ``continuation_ids``; none for a
    tokenizer without WordPiece pieces, whose masking is then per token)."""
    table = np.zeros(tokenizer.vocab_size, bool)
    table[np.asarray(getattr(tokenizer, "continuation_ids", ()), np.int64)] = True
    return table


def bert_ids(tokenizer, seq_length: int) -> tuple[dict, np.ndarray, np.ndarray]:
    """``({cls, sep, mask, pad}, special ids, non-special (text) ids)``; clear errors for a tokenizer
    without BERT's special tokens or a sequence too short for ``[CLS] A [SEP] B [SEP]``."""
    for attr in ("cls", "sep", "mask", "pad"):
        if not hasattr(tokenizer, attr):
            raise ValueError(f"BERT data needs a tokenizer with [CLS]/[SEP]/[MASK]/[PAD]; {tokenizer.name} has "
                             "none: use --tokenizer-type BertWordPieceLowerCase (or BertWordPieceCase)")
    if seq_length < 5:
        raise ValueError(f"--seq-length {seq_length} is too short for [CLS] A [SEP] B [SEP]; use at least 5")
    special = np.asarray(tokenizer.special_ids, np.int64)
    return ({k: int(getattr(tokenizer, k)) for k in ("cls", "sep", "mask", "pad")}, special,
            np.setdiff1d(np.arange(tokenizer.vocab_size), special))


def _span(indexed: IndexedDataset, documents: np.ndarray, max_tokens: int, binary_head: bool) -> int | None:
    """Tokens of the spans one-sequence documents are cut into, or None (sequences are sentences, as Megatron):
    only for two segments over documents none of which has two sequences (text not split into sentences, where
    Megatron's mapping finds no sample); spans of at most :data:`LONG_SENTENCE`, which the mapping accepts."""
    di = indexed.document_indices
    if not binary_head or len(documents) == 0 or (di[documents + 1] - di[documents]).max() >= 2:
        return None
    return max(1, min(max_tokens // 4, LONG_SENTENCE))


class BertDataset(torch.utils.data.Dataset):
    """BERT samples (see the module docstring) from the documents ``documents`` of ``indexed``:
    ``dict(tokens, tokentype_ids, padding_mask, labels, loss_mask [seq_length], is_random [])``."""

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, num_samples: int, *, seq_length: int,
                 seed: int, tokenizer, cache_dir: str, split_name: str = "train", binary_head: bool = True,
                 masked_lm_prob: float = 0.15, short_seq_prob: float = 0.1, allow_build: bool = True):
        self.ids, self.special, self.vocab_ids = bert_ids(tokenizer, seq_length)
        self.replace_ids = replacement_ids(tokenizer)
        self.continuation = continuation_table(tokenizer)
        self.indexed, self.seq_length, self.seed = indexed, seq_length, seed
        self.binary_head, self.masked_lm_prob = binary_head, masked_lm_prob
        max_tokens = self.max_text_tokens(seq_length)
        docs = np.asarray(documents, np.int64)
        self.table = sentence_table(indexed, docs, _span(indexed, docs, max_tokens, binary_head))
        self.description = {
            "class": "BertDataset", "format": INDEX_FORMAT, "prefix": os.path.abspath(indexed.prefix),
            "fingerprint": cache.file_fingerprint(indexed.prefix, cache_dir), "split": split_name,
            "documents": [len(docs), hashlib.md5(docs.tobytes()).hexdigest()], "num_samples": int(num_samples),
            "seq_length": seq_length, "seed": seed, "binary_head": binary_head, "short_seq_prob": short_seq_prob}

        def build():
            return {"mapping": build_sample_mapping(self.table["bounds"], self.table["length"], num_samples,
                                                    max_tokens, seed, short_seq_prob=short_seq_prob,
                                                    min_sentences=2 if binary_head else 1)}

        self.mapping = cache.load_or_build(os.path.join(cache_dir, "indices"), self.description, ("mapping",),
                                           build if allow_build else None)["mapping"]

    def __len__(self) -> int:
        return len(self.mapping)

    @staticmethod
    def max_text_tokens(seq_length: int) -> int:
        """The sample mapping's target length: :func:`text_room` (T5 overrides it)."""
        return text_room(seq_length)

    def sentences(self, idx: int) -> list[np.ndarray]:
        """Token ids of the sentences of sample ``idx``, as the file holds them (special ids kept, as Megatron)."""
        first, end, _ = (int(v) for v in self.mapping[idx])
        t = self.table
        return [self.indexed.get(int(t["seq"][j]), int(t["offset"][j]), int(t["length"][j])).astype(np.int64)
                for j in range(first, end)]

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range [0, {len(self)})")
        return self.build(idx, np.random.RandomState((self.seed + idx) % 2**32))

    def build(self, idx: int, rng: np.random.RandomState) -> dict[str, torch.Tensor]:
        """Sample ``idx`` from its sentences and its own ``rng`` (subclasses build other samples)."""
        target = int(self.mapping[idx][2]) if hasattr(self, "mapping") else None  # the mock has no mapping
        return build_sample(self.sentences(idx), rng, seq_length=self.seq_length, ids=self.ids,
                            vocab_ids=self.replace_ids, binary_head=self.binary_head,
                            masked_lm_prob=self.masked_lm_prob, target=target, continuation=self.continuation)


class MockBertDataset(torch.utils.data.Dataset):
    """``--mock-data`` for BERT: sample ``i`` is 2-6 random "sentences" (random non-special ids, 1 to
    ``(seq_length - 3) // 2`` tokens each) built into a sample exactly as :class:`BertDataset` does;
    it depends only on ``(seed, i)``, so every rank and worker sees the same data."""

    def __init__(self, num_samples: int, *, seq_length: int, seed: int, tokenizer, binary_head: bool = True,
                 masked_lm_prob: float = 0.15):
        self.ids, _, self.vocab_ids = bert_ids(tokenizer, seq_length)  # the mock's text: non-special ids
        self.replace_ids = replacement_ids(tokenizer)
        self.continuation = continuation_table(tokenizer)
        self.num_samples, self.seq_length, self.seed = num_samples, seq_length, seed
        self.binary_head, self.masked_lm_prob = binary_head, masked_lm_prob

    def __len__(self) -> int:
        return self.num_samples

    def sentences(self, idx: int) -> list[np.ndarray]:
        rng = np.random.default_rng([self.seed, idx])
        longest = max(1, (self.seq_length - 3) // 2)
        return [self.vocab_ids[rng.integers(0, len(self.vocab_ids), int(rng.integers(1, longest + 1)))]
                for _ in range(int(rng.integers(2, 7)))]

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range [0, {self.num_samples})")
        return self.build(idx, np.random.RandomState((self.seed + idx) % 2**32))

    build = BertDataset.build  # the same sample from the (random) sentences; T5's mock overrides it


def bert_corpus_prefix(tokenizer, cache_dir: str, *, build: bool = True) -> str:
    """The bundled corpus, one sequence per sentence, tokenized with ``tokenizer`` (keyed by its vocabulary)."""
    from .corpus import MOBY_DICK, moby_dick_documents
    from .tokenizers import sha256_of

    # s3: the rule-based splitter on unwrapped paragraphs
    tag = f"{sha256_of(MOBY_DICK)[:12]}_{sha256_of(tokenizer.vocab_file)[:12]}_s3"
    prefix = os.path.join(cache_dir, "corpus", f"moby_dick_bert_{tag}_sentences")
    if exists(prefix):
        return prefix
    if not build:
        raise FileNotFoundError(f"BERT demo corpus {prefix}.bin/.idx not built yet (the builder rank builds it)")
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    tmp = f"{prefix}.tmp-{os.getpid()}"
    builder = IndexedDatasetBuilder(data_file(tmp), optimal_dtype(tokenizer.vocab_size))
    for doc in moby_dick_documents():
        sentences = [ids for ids in tokenizer.encode_batch(split_sentences(doc)) if ids]
        if sentences:
            builder.add_document(np.concatenate(sentences), [len(s) for s in sentences])
    builder.finalize(index_file(tmp))
    os.replace(data_file(tmp), data_file(prefix))  # .bin first: .idx marks completion
    os.replace(index_file(tmp), index_file(prefix))
    return prefix


def _bert_split(config, tokenizer, blend, datasets, split: int, num_samples: int, cache_dir: str, allow_build: bool,
                dataset_cls=BertDataset, whole: bool = False, **kw):
    """One split's ``dataset_cls``, or None with no samples or share: its --split share of each dataset's documents,
    or (``whole``: the split's own files, --train-data-path and friends) all of them. ``blend`` is (prefixes, weights
    or None), built as Megatron's builder does: one prefix without weights (or a split's own single file) as is;
    weights (also ``1.0 D``, a one-dataset blend): each dataset's share plus 0.5%, blended to exactly the samples."""
    from .blended import BlendedDataset
    from .builder import SPLIT_NAMES, blend_plan, split_documents
    from .config import normalize, split_weights

    weights = split_weights(config.split)
    if num_samples <= 0 or (weights[split] == 0 and not whole):
        return None
    blend_weights = blend[1]
    plain = len(datasets) == 1 and (blend_weights is None or whole)
    wants, size = blend_plan(blend_weights, num_samples, plain)
    parts = []
    for d, indexed in enumerate(datasets):
        span = (0, indexed.num_documents) if whole else split_documents(indexed.num_documents, weights, split,
                                                                         indexed.prefix, config.split)
        if span is None:
            return None
        parts.append(dataset_cls(indexed, np.arange(*span), wants[d], seq_length=config.seq_length, seed=config.seed,
                                 tokenizer=tokenizer, cache_dir=cache_dir, split_name=SPLIT_NAMES[split],
                                 allow_build=allow_build, **kw))
    if plain:
        return parts[0]
    return BlendedDataset(parts, normalize(blend_weights), size, cache_dir=cache_dir, allow_build=allow_build)


def _bert_blends(config, tokenizer, cache_dir: str, allow_build: bool, dataset_cls) -> tuple[list, bool]:
    """(each split's blend (prefixes, weights or None), whether each split reads its own files whole): the per-split
    paths (--train-data-path and friends, as Megatron's pretrain_bert / pretrain_t5 read them), else --data-path for
    all three, else the bundled corpus split into sentences. Several prefixes without weights stop here, naming
    the flag: Megatron's BERT and T5 datasets cannot index them (a blend by size gives each dataset no sample
    count, which its ``helpers.build_mapping`` refuses with a TypeError)."""
    from .builder import DataError
    from .config import parse_blend

    if config.per_split:
        named = list(zip(("--train-data-path", "--valid-data-path", "--test-data-path"),
                         (config.train_data_path, config.valid_data_path, config.test_data_path)))
        blends, whole = [parse_blend(p, flag) for flag, p in named], True
    else:
        named, whole = [("--data-path", config.data_path)] * 3, False
        blends = [parse_blend(config.data_path)] * 3
        if not blends[0][0]:
            if not hasattr(tokenizer, "vocab_file"):
                raise DataError("no --data-path: the bundled BERT corpus needs --tokenizer-type BertWordPieceLowerCase "
                                "or BertWordPieceCase")
            blends = [([bert_corpus_prefix(tokenizer, cache_dir, build=allow_build)], None)] * 3
    for (flag, paths), (prefixes, weights) in zip(named, blends):
        if weights is None and len(prefixes) > 1:
            raise DataError(f"{flag} {' '.join(paths)}: {dataset_cls.__name__} blends need weights (Megatron's cannot "
                            "blend by size either); give WEIGHT PREFIX pairs")
    return blends, whole


def build_bert_datasets(config, tokenizer, *, train_samples: int, valid_samples: int, test_samples: int,
                        binary_head: bool = True, is_builder_rank: bool = True, barrier=None, dataset_cls=None,
                        is_node_builder: bool = False, **dataset_kw):
    """(train, valid, test) :class:`BertDataset` splits of ``config.data_path`` (documents split by
    ``--split``), of each split's own files (--train-data-path and friends, read whole), of the bundled corpus
    split into sentences when no path is given, or synthetic
    (:class:`MockBertDataset`) with ``--mock-data``. Collective like
    :func:`omnitron.core.data.build_gpt_datasets`: the builder rank writes caches, then ``barrier()`` (and each
    node's first rank, ``is_node_builder``, where its node's cache lacks them).
    ``dataset_cls`` (a BertDataset subclass, e.g. T5's) with its own ``dataset_kw`` replaces BertDataset
    (and its ``mock_cls`` MockBertDataset)."""
    from .builder import check_vocabulary
    from .config import default_cache_dir

    kw = dict(dataset_kw) if dataset_cls else {"binary_head": binary_head}
    kw.setdefault("masked_lm_prob", config.mask_prob)  # --mask-prob
    if config.mock_data:
        if barrier is not None:
            barrier()
        mock = dataset_cls.mock_cls if dataset_cls else MockBertDataset
        return tuple(None if n <= 0 else mock(int(n), seq_length=config.seq_length, seed=config.seed + i,
                                              tokenizer=tokenizer, **kw)
                     for i, n in enumerate((train_samples, valid_samples, test_samples)))
    cache_dir = config.data_cache_path or default_cache_dir()
    kw.setdefault("short_seq_prob", config.short_seq_prob)  # --short-seq-prob: the files' sample mapping

    def build_all(allow_build: bool):
        cls = dataset_cls or BertDataset
        blends, whole = _bert_blends(config, tokenizer, cache_dir, allow_build, cls)
        opened = {}
        for prefix in (p for blend in blends for p in blend[0]):
            if prefix not in opened:
                opened[prefix] = IndexedDataset(prefix)
                check_vocabulary(opened[prefix], tokenizer, cache_dir, allow_build)
        samples = (train_samples, valid_samples, test_samples)
        return tuple(_bert_split(config, tokenizer, blend, [opened[p] for p in blend[0]], i, int(n), cache_dir,
                                 allow_build, cls, whole=whole, **kw) if blend[0] else None
                     for i, (blend, n) in enumerate(zip(blends, samples)))

    return cache.build_in_turn(build_all, is_builder_rank, barrier, is_node_builder, cache_dir)
