"""``build_gpt_datasets``: train/valid/test datasets from a ``DataConfig``, built once and shared.

Protocol across ranks: the builder rank (rank 0, or local rank 0 without a shared disk)
builds every index cache, then every rank calls ``barrier()``, then the other ranks load
the caches. With no barrier (one process) the builder just builds and returns.
"""
from __future__ import annotations

import logging
import math
import os
from typing import Callable

import numpy as np

from . import cache
from .blended import BlendedDataset, MockGPTDataset
from .config import DataConfig, DataError, default_cache_dir, normalize, parse_blend, split_weights
from .gpt_dataset import GPTDataset, dataset_pad_id
from .indexed import IndexedDataset
from .tokenizers import Tokenizer

log = logging.getLogger(__name__)
SPLIT_NAMES = ("train", "valid", "test")
BLEND_SURPLUS = 0.005  # each blended dataset indexes 0.5% more samples than its share (Megatron's default)


def sample_flags(config: DataConfig) -> dict[str, bool]:
    """The ``DataConfig`` switches that shape each GPT sample (loss mask, positions, document ids)."""
    return {"eod_mask_loss": config.eod_mask_loss, "reset_position_ids": config.reset_position_ids,
            "reset_attention_mask": config.reset_attention_mask}


def split_ranges(num_documents: int, weights: list[float]) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) document ranges for train/valid/test in proportions ``weights`` (sum 1), as Megatron:
    each bound is a cumulative share rounded, ``round(sum(weights[:k]) * num_documents)``."""
    bounds, total = [0.0], 0.0
    for w in weights:
        total = total + w
        bounds.append(total)
    ends = [int(round(b * float(num_documents))) for b in bounds]
    return [(ends[i], ends[i + 1]) for i in range(3)]


def split_documents(num_documents: int, weights: list[float], split: int, prefix: str, split_flag: str):
    """[lo, hi) documents of ``split`` (see :func:`split_ranges`); None when the test split gets none (no test
    evaluation, logged); an empty train or validation split is a :class:`DataError`."""
    lo, hi = split_ranges(num_documents, weights)[split]
    if hi > lo:
        return lo, hi
    if split == 2:
        log.info("%s: the test split of --split %s gets none of its %d documents: no test evaluation", prefix,
                 split_flag, num_documents)
        return None
    raise DataError(f"{prefix}: the {SPLIT_NAMES[split]} split of --split {split_flag} gets no documents "
                    f"({num_documents} in all); give it a larger share or use more data")


def blend_sizes(weights: list[float], num_samples: int) -> tuple[list[int], list[int]]:
    """(samples each dataset of a weighted blend contributes, samples each one indexes) for ``num_samples`` in
    proportions ``weights`` (normalised): ``ceil(n * w)`` and that plus the surplus, as Megatron."""
    target = [int(math.ceil(num_samples * w)) for w in weights]
    return target, [int(math.ceil(t * (1 + BLEND_SURPLUS))) for t in target]


def blend_plan(weights: list[float] | None, num_samples: int, plain: bool) -> tuple[list | None, int | None]:
    """(samples to index per dataset, blend size) of one split (Megatron's builder): ``plain`` (one dataset
    read as is) -> ([num_samples], None); weights -> (their shares plus surplus, the shares' sum); no weights
    (prefixes blended by size) -> (None: one epoch of each, None: the size follows from their lengths)."""
    if plain:
        return [num_samples], None
    if weights is None:
        return None, None
    target, indexed = blend_sizes(normalize(weights), num_samples)
    return indexed, sum(target)


def check_vocabulary(indexed: IndexedDataset, tokenizer: Tokenizer, cache_dir: str, allow_build: bool) -> None:
    """Fail early when the data holds ids the tokenizer (hence the model) cannot embed, or negative ones.

    The full scan is cached under the ``.bin``'s identity (size, inode, modification and change
    times: a replaced file, even one of the same size, is scanned again), and every later read
    checks its own ids against the vocabulary as well (:meth:`IndexedDataset.get`)."""
    desc = {"class": "token_range", "prefix": os.path.abspath(indexed.prefix),
            "fingerprint": cache.file_fingerprint(indexed.prefix, cache_dir),
            "bin": cache.file_identity(f"{indexed.prefix}.bin")}
    build = (lambda: {"token_range": np.array(indexed.token_range(), np.int64)}) if allow_build else None
    low, top = (int(x) for x in cache.load_or_build(os.path.join(cache_dir, "indices"), desc, ("token_range",),
                                                    build)["token_range"])
    if low < 0:
        raise DataError(f"{indexed.prefix}.bin holds token id {low}: token ids are never negative, so the file is "
                        "corrupt or not token data; re-run `omnitron preprocess`")
    if top >= tokenizer.vocab_size:
        raise DataError(f"{indexed.prefix} holds token id {top}, beyond the {tokenizer.name} vocabulary of "
                        f"{tokenizer.vocab_size}: it was preprocessed with another tokenizer; pass the matching "
                        "--tokenizer-type/--vocab-file/--tokenizer-model, or re-run `omnitron preprocess`")
    indexed.vocab_size = tokenizer.vocab_size


def _one_split(config: DataConfig, tokenizer: Tokenizer, blend, datasets, split: int, num_samples: int,
               cache_dir: str, allow_build: bool, whole: bool = False):
    """The ``split``'s dataset: its --split share of each dataset's documents, or (``whole``: the split's own
    files) all of them. ``blend`` is (prefixes, weights or None), built as Megatron's builder does: one prefix
    without weights (or a split's own single file) as is; weights: a blend of each dataset's share plus 0.5%;
    several prefixes without weights: one epoch of each, blended in proportion to their sizes."""
    weights = split_weights(config.split)
    if num_samples <= 0 or (weights[split] == 0 and not whole):
        return None
    name, (_, blend_weights) = SPLIT_NAMES[split], blend
    plain = len(datasets) == 1 and (blend_weights is None or whole)
    wants, size = blend_plan(blend_weights, num_samples, plain)
    spans = [(0, len(ds)) if whole else split_documents(len(ds), weights, split, ds.prefix, config.split)
             for ds in datasets]
    if None in spans:
        return None
    parts, pad = [], dataset_pad_id(tokenizer.own_pad, tokenizer.eod, config.allow_ambiguous_pad_tokens)
    for d, (indexed, span) in enumerate(zip(datasets, spans)):
        parts.append(GPTDataset(indexed, np.arange(*span), None if wants is None else wants[d],
                                seq_length=config.seq_length, seed=config.seed, eod=tokenizer.eod,
                                cache_dir=cache_dir, split_name=name, allow_build=allow_build, **sample_flags(config),
                                pad=pad))
    if plain:
        return parts[0]
    if blend_weights is None:  # by size: each dataset once, as many samples as asked, at most all of them (so
        mix, size = [len(p) for p in parts], min(num_samples, sum(len(p) for p in parts))  # maybe fewer)
    else:
        mix = normalize(blend_weights)  # normalised once here and once more by the blend, as Megatron
    return BlendedDataset(parts, mix, size, cache_dir=cache_dir, allow_build=allow_build)


def _open_blend(blend, tokenizer, cache_dir, allow_build) -> list[IndexedDataset]:
    datasets = [IndexedDataset(p) for p in blend[0]]
    for ds in datasets:
        check_vocabulary(ds, tokenizer, cache_dir, allow_build)
    return datasets


def _build_per_split(config, tokenizer, samples, cache_dir, allow_build):
    """--train-data-path / --valid-data-path / --test-data-path: each split from all documents of its files."""
    out = []
    for split, (paths, n) in enumerate(zip((config.train_data_path, config.valid_data_path, config.test_data_path),
                                            samples)):
        blend = parse_blend(paths)
        if not blend[0] or n <= 0:
            out.append(None)
            continue
        datasets = _open_blend(blend, tokenizer, cache_dir, allow_build)
        out.append(_one_split(config, tokenizer, blend, datasets, split, n, cache_dir, allow_build, whole=True))
    return tuple(out)


def _build_all(config, tokenizer, samples, cache_dir, allow_build):
    if config.per_split:
        return _build_per_split(config, tokenizer, samples, cache_dir, allow_build)
    blend = parse_blend(config.data_path)
    if not blend[0]:
        from .corpus import demo_corpus_prefix

        if tokenizer.fingerprint is None:
            raise DataError(f"no --data-path given: the bundled demo corpus is tokenized with the run's tokenizer, "
                            f"but {tokenizer.name} has no vocabulary to tokenize it with; pass --data-path, or "
                            "--mock-data")
        blend = ([demo_corpus_prefix(tokenizer, cache_dir=cache_dir, build=allow_build)], None)
    datasets = _open_blend(blend, tokenizer, cache_dir, allow_build)
    return tuple(_one_split(config, tokenizer, blend, datasets, i, n, cache_dir, allow_build)
                 for i, n in enumerate(samples))


def build_gpt_datasets(config: DataConfig, tokenizer: Tokenizer, *, train_samples: int, valid_samples: int,
                       test_samples: int, is_builder_rank: bool = True, barrier: Callable[[], None] | None = None,
                       is_node_builder: bool = False):
    """(train, valid, test) datasets, each ``None`` when it gets no samples or a zero split share.

    Each dataset has at least the requested number of samples; item ``i`` is
    ``dict(tokens, labels, loss_mask, position_ids)`` of shape ``[seq_length]`` (and ``document_ids``
    with ``--reset-attention-mask``).
    Every rank must call this (``barrier`` is collective); ``is_builder_rank`` writes the index caches, then
    ``is_node_builder`` (each node's first rank) where its node's cache lacks them (:func:`cache.build_in_turn`).
    """
    samples = (int(train_samples), int(valid_samples), int(test_samples))
    if config.mock_data:
        if barrier is not None:
            barrier()
        pad = dataset_pad_id(tokenizer.own_pad, tokenizer.eod, config.allow_ambiguous_pad_tokens)
        return tuple(None if n <= 0 else MockGPTDataset(
            n, seq_length=config.seq_length, vocab_size=tokenizer.vocab_size, eod=tokenizer.eod,
            seed=config.seed + i, pad=pad, **sample_flags(config))
            for i, n in enumerate(samples))
    cache_dir = config.data_cache_path or default_cache_dir()
    return cache.build_in_turn(lambda allow: _build_all(config, tokenizer, samples, cache_dir, allow), is_builder_rank,
                               barrier, is_node_builder, cache_dir)
