"""Data pipeline: tokenizers, Megatron-compatible indexed datasets, GPT datasets, blending, sampling.

Interface for the trainer (everything offline; nothing is fetched at run time):

    tok = build_tokenizer("GPT2BPETokenizer")          # bundled GPT-2 BPE, sha256-checked
    tok.encode("Hello world") == [15496, 995]; tok.vocab_size == 50257; tok.eod == tok.pad == 50256

    cfg = DataConfig(data_path=["0.7", "A", "0.3", "B"], split="969,30,1", seq_length=1024, seed=1234)
    # CLI: add_data_args(parser) adds --data-path --split --mock-data --seq-length --tokenizer-type ...;
    #      cfg = data_config_from_args(args); tok = tokenizer_from_config(cfg)
    # data_path=[] -> the bundled Moby Dick corpus (tokenized into the cache on first use);
    # mock_data=True -> synthetic tokens, same interface.
    train, valid, test = build_gpt_datasets(cfg, tok, train_samples=iters * global_batch,
                                            valid_samples=..., test_samples=...,
                                            is_builder_rank=(rank == 0), barrier=dist.barrier)
    train[i] -> {"tokens": int64 [s], "labels": int64 [s] (tokens shifted by one),
                 "loss_mask": float32 [s], "position_ids": int64 [s]}      # s = cfg.seq_length
    # + "document_ids": int64 [s] with cfg.reset_attention_mask (eods before each position)
    # a split is None when it gets 0 samples or a 0 share of --split

    sampler = PretrainingSampler(total_samples=len(train), consumed_samples=resumed, micro_batch_size=mbs,
                                 dp_rank=groups.dp.rank, dp_size=groups.dp.size)
    loader = build_data_loader(train, sampler, num_workers=cfg.num_workers)   # batches of [b, s] via collate
    # checkpoint sampler.state_dict() / your own iteration * global_batch_size; restore with consumed_samples.

Ranks of one tensor-parallel group (and of one context-parallel group) read the same indices
deterministically: build the sampler with the data-parallel rank/size only; or let tp member 0
read and call ``broadcast_batch(batch, group=groups.tp, collectives=..., ...)``. Only the first and
last pipeline stages need batches (``needs_batch(groups)``).

Files: ``IndexedDataset(prefix)`` / ``IndexedDatasetBuilder`` / ``merge_datasets`` (MMIDIDX .bin/.idx),
``demo_corpus_prefix()``, ``preprocess.preprocess_files`` (behind ``omnitron preprocess``).
"""
from __future__ import annotations

from .blended import BlendedDataset, MockGPTDataset, blend_indices
from .builder import DataError, build_gpt_datasets, split_ranges
from .cache import IndexCacheMissing
from .config import (DataConfig, add_data_args, add_tokenizer_args, data_config_from_args, default_cache_dir,
                     parse_data_path, split_weights, tokenizer_from_config)
from .corpus import demo_corpus_prefix, moby_dick_chapters, moby_dick_documents
from .distributed import broadcast_batch, needs_batch
from .gpt_dataset import GPTDataset, build_indices, make_sample
from .indexed import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError, merge_datasets, optimal_dtype
from .sampler import PretrainingSampler, build_data_loader, collate
from .tokenizers import TOKENIZER_TYPES, Tokenizer, TokenizerError, build_tokenizer

__all__ = [
    "BlendedDataset", "MockGPTDataset", "blend_indices", "DataError", "build_gpt_datasets", "split_ranges",
    "IndexCacheMissing", "DataConfig", "add_data_args", "add_tokenizer_args", "data_config_from_args",
    "tokenizer_from_config", "default_cache_dir", "parse_data_path", "split_weights",
    "broadcast_batch", "needs_batch", "demo_corpus_prefix", "moby_dick_chapters", "moby_dick_documents", "GPTDataset",
    "build_indices", "make_sample", "IndexedDataset",
    "IndexedDatasetBuilder", "IndexedDatasetError", "merge_datasets", "optimal_dtype", "PretrainingSampler",
    "build_data_loader", "collate", "TOKENIZER_TYPES", "Tokenizer", "TokenizerError", "build_tokenizer",
]
