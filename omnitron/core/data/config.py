"""``DataConfig``: where training data comes from and how samples are cut from it."""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

import numpy as np

from omnitron.core.config.parallel import ConfigError

from .cache import default_cache_dir  # noqa: F401 - re-exported: callers import it from here
from .errors import DataError  # noqa: F401 - re-exported: the builder and callers import it from here
from .tokenizers import TOKENIZER_TYPES, build_tokenizer, tokenizer_kwargs


@dataclass(kw_only=True)
class DataConfig:
    """Data flags (Megatron spellings in the CLI: ``--data-path``, ``--split``, ``--mock-data``, ...)."""

    data_path: list[str] = field(default_factory=list)
    """``--data-path``: ``PREFIX``, ``W1 PREFIX1 W2 PREFIX2 ...`` (weights need not sum to 1) or ``PREFIX1 PREFIX2 ...``
    (blended in proportion to their sizes, as Megatron).
    Empty with ``mock_data`` False means the bundled demo corpus (Moby Dick, tokenized with the run's tokenizer)."""
    train_data_path: list[str] = field(default_factory=list)
    """``--train-data-path``: the training split's own ``PREFIX`` or ``W1 PREFIX1 ...`` (all its documents;
    instead of --data-path and --split, as Megatron)."""
    valid_data_path: list[str] = field(default_factory=list)
    """``--valid-data-path``: the validation split's own datasets (see --train-data-path)."""
    test_data_path: list[str] = field(default_factory=list)
    """``--test-data-path``: the test split's own datasets (see --train-data-path)."""
    data_args_path: str | None = None
    """``--data-args-path``: a file holding the --data-path value (``W1 PREFIX1 W2 PREFIX2 ...`` or prefixes, split at
    any whitespace, newlines included), as Megatron reads it; read into --data-path when the settings are made."""
    per_split_data_args_path: str | None = None
    """``--per-split-data-args-path``: a JSON file ``{"train": ..., "valid": ..., "test": ...}`` (each a --data-path
    value as a string or a list, or null), as Megatron reads it; read into --train-data-path, --valid-data-path and
    --test-data-path when the settings are made."""
    split: str = "969,30,1"
    """``--split``: train,valid,test proportions of each dataset's documents."""
    mock_data: bool = False
    """``--mock-data``: synthetic random tokens instead of files (tests, benchmarks)."""
    seq_length: int = 1024
    """``--seq-length``: tokens per sample (each sample reads seq_length + 1 tokens)."""
    seed: int = 1234
    """``--seed``: shuffling seed; same seed + same data = same sample order."""
    data_cache_path: str | None = None
    """``--data-cache-path``: where index caches go (default ``$OMNITRON_CACHE`` or ~/.cache/omnitron): one
    directory every node shares, or each node's own (built there by the node's first rank)."""
    num_workers: int = 2
    """``--num-workers``: DataLoader worker processes per rank (0 = load in the training process)."""
    tokenizer_type: str = "GPT2BPETokenizer"
    """``--tokenizer-type``: GPT2BPETokenizer, HuggingFaceTokenizer, SentencePieceTokenizer, NullTokenizer,
    TikTokenizer, MultimodalTokenizer, ... (see omnitron.core.data.tokenizers)."""
    vocab_file: str | None = None
    """``--vocab-file``: GPT-2 vocab.json (default: the bundled one)."""
    merge_file: str | None = None
    """``--merge-file``: GPT-2 merges.txt (default: the bundled one)."""
    tokenizer_model: str | None = None
    """``--tokenizer-model``: tokenizer.json (HuggingFace), .model (SentencePiece), a tiktoken JSON vocabulary
    (TikTokenizer) or a Hugging Face tokenizer directory (MultimodalTokenizer)."""
    vocab_size: int | None = None
    """``--vocab-size``: NullTokenizer's vocabulary (ids 0..V-1, eod = V); TikTokenizer's whole vocabulary
    (special tokens included; default 131072)."""
    tiktoken_pattern: str | None = None
    """``--tiktoken-pattern``: TikTokenizer's pre-tokenizer regex, Megatron's v1 or v2 (default v2)."""
    tiktoken_num_special_tokens: int = 1000
    """``--tiktoken-num-special-tokens``: TikTokenizer's special-token ids before the BPE ranks."""
    tokenizer_special_tokens: list[str] = field(default_factory=list)
    """``--tokenizer-special-tokens`` (or Megatron's older --tiktoken-special-tokens / --special-tokens):
    TikTokenizer's named special tokens (must hold <unk> <s> </s> <mask> <pad> <cls> <sep>); MultimodalTokenizer's
    added tokens (default <image>)."""
    tokenizer_prompt_format: str | None = None
    """``--tokenizer-prompt-format``: MultimodalTokenizer's chat format (llama3, llama3p1, chatml, qwen2p5, ...)."""
    image_tag_type: str = ""
    """``--image-tag-type``: MultimodalTokenizer's tags around <image>: nvlm, internvl or none."""
    tokenizer_hf_no_include_special_tokens: bool = False
    """``--tokenizer-hf-no-include-special-tokens``: HuggingFaceTokenizer encodes without the tokenizer's own
    special tokens (by default, as Megatron's and transformers', a Llama tokenizer's BOS starts every document)."""
    null_tokenizer_pad_id: int = -1
    """``--null-tokenizer-pad-id``: NullTokenizer's pad id (Megatron's flag and default; -1 or below: none): GPT
    samples mask the loss where the label is this id, unless it is the eod (``gpt_dataset.dataset_pad_id``)."""
    mask_prob: float = 0.15
    """``--mask-prob``: BERT's and T5's masking probability (Megatron's masking_probability): a sample masks
    (BERT) or corrupts (T5) up to this share of its tokens."""
    short_seq_prob: float = 0.1
    """``--short-seq-prob``: BERT's and T5's share of samples given a random shorter target length (Megatron's
    short_sequence_probability; its sample mapping draws about one in ``round(1 / p)``)."""
    eod_mask_loss: bool = False
    """``--eod-mask-loss``: zero the loss on end-of-document tokens."""
    reset_position_ids: bool = False
    """``--reset-position-ids``: restart position ids after each end-of-document token."""
    allow_ambiguous_pad_tokens: bool = False
    """``--allow-ambiguous-pad-tokens``: mask the tokenizer's pad in GPT samples even when it is the eod id
    (Megatron's flag; by default such a pad is not masked, see ``gpt_dataset.dataset_pad_id``)."""
    reset_attention_mask: bool = False
    """``--reset-attention-mask``: no attention across end-of-document tokens (each packed document
    attends causally within itself; samples carry ``document_ids``; not with context parallelism)."""

    def __post_init__(self):
        if self.seq_length < 1:
            raise ConfigError(f"--seq-length must be >= 1, got {self.seq_length}")
        if self.num_workers < 0:
            raise ConfigError(f"--num-workers must be >= 0, got {self.num_workers}")
        split_weights(self.split)
        if not 0.0 < self.mask_prob <= 1.0:
            raise ConfigError(f"--mask-prob {self.mask_prob} is not a probability in (0, 1]; Megatron's default is "
                              "0.15")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise ConfigError(f"--short-seq-prob {self.short_seq_prob} is not a probability in [0, 1]; Megatron's "
                              "default is 0.1")
        _check_tokenizer_type(self.tokenizer_type)
        if self.tiktoken_pattern not in (None, "v1", "v2"):
            raise ConfigError(f"--tiktoken-pattern {self.tiktoken_pattern!r}: expected v1 or v2 (Megatron's patterns)")
        if self.image_tag_type not in ("", "nvlm", "internvl"):
            raise ConfigError(f"--image-tag-type {self.image_tag_type!r}: expected nvlm, internvl or nothing")
        for name in ("vocab_file", "merge_file", "tokenizer_model"):  # checkpoints record where the files are,
            path = getattr(self, name)  # so generate, serve and exports find them from any directory
            if path and os.path.exists(path):
                setattr(self, name, os.path.abspath(path))
        self._read_data_args_files()
        for flag, paths in self.path_flags():
            parse_data_path(paths, flag)
        if self.data_path and self.per_split:
            raise ConfigError("give --data-path (cut by --split) or --train-data-path / --valid-data-path / "
                              "--test-data-path (each split its own files), not both")

    def _read_data_args_files(self) -> None:
        """--data-args-path / --per-split-data-args-path: the paths they hold replace them (so a checkpoint records
        the prefixes read, and a resumed run's settings compare equal)."""
        if self.data_args_path:
            if self.data_path:
                raise ConfigError("give --data-path or --data-args-path (a file holding its value), not both")
            self.data_path = _read_text(self.data_args_path, "--data-args-path").split()
            if not self.data_path:
                raise ConfigError(f"--data-args-path {self.data_args_path}: the file is empty; write the --data-path "
                                  "value in it (PREFIX, or WEIGHT PREFIX pairs)")
            self.data_args_path = None
        if self.per_split_data_args_path:
            if self.train_data_path or self.valid_data_path or self.test_data_path:
                raise ConfigError("give --train-data-path / --valid-data-path / --test-data-path or "
                                  "--per-split-data-args-path (a file holding them), not both")
            paths = _per_split_paths(self.per_split_data_args_path)
            self.train_data_path, self.valid_data_path, self.test_data_path = paths
            self.per_split_data_args_path = None

    @property
    def per_split(self) -> bool:
        """Each split reads its own files (--train-data-path and friends)."""
        return bool(self.train_data_path or self.valid_data_path or self.test_data_path)

    def path_flags(self) -> list[tuple[str, list[str]]]:
        """(flag, value) of every data-path flag that was given."""
        named = (("--data-path", self.data_path), ("--train-data-path", self.train_data_path),
                 ("--valid-data-path", self.valid_data_path), ("--test-data-path", self.test_data_path))
        return [(flag, paths) for flag, paths in named if paths]


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as err:
        raise ConfigError(f"{flag} {path}: cannot read it ({err.strerror}); give the path of an existing "
                          "file") from None


def _per_split_paths(path: str) -> tuple[list[str], list[str], list[str]]:
    """The train, valid and test data paths of a --per-split-data-args-path JSON file (Megatron's format: all three
    keys, each a whitespace-separated string, a list of strings, or null for no such split)."""
    flag = "--per-split-data-args-path"
    try:
        spec = json.loads(_read_text(path, flag))
    except ValueError as err:
        raise ConfigError(f"{flag} {path}: not JSON ({err}); write {{\"train\": \"W A W B\", \"valid\": ..., "
                          "\"test\": ...}") from None
    missing = [k for k in ("train", "valid", "test") if not isinstance(spec, dict) or k not in spec]
    if missing:
        raise ConfigError(f"{flag} {path}: no {', '.join(repr(k) for k in missing)} key; give all of \"train\", "
                          "\"valid\" and \"test\" (null for a split without data), as Megatron reads it")
    out = []
    for k in ("train", "valid", "test"):
        v = spec[k]
        if v is None:
            out.append([])
        elif isinstance(v, str):
            out.append(v.split())
        elif isinstance(v, list) and all(isinstance(x, (str, int, float)) for x in v):
            out.append([str(x) for x in v])
        else:
            raise ConfigError(f"{flag} {path}: {k!r} must be a string, a list of strings or null, got {v!r}")
    return out[0], out[1], out[2]


_MEGATRON_ONLY = {"NullMultimodalTokenizer": "no multimodal null tokenizer", "SFTTokenizer": "no SFT prompt formats"}


def _check_tokenizer_type(kind: str) -> None:
    """An unknown ``--tokenizer-type`` stops before any work; Megatron's types omnitron lacks say why."""
    if kind in _MEGATRON_ONLY:
        raise ConfigError(f"--tokenizer-type {kind}: Megatron's, not omnitron's ({_MEGATRON_ONLY[kind]}); convert the "
                          "tokenizer to a tokenizer.json and use --tokenizer-type HuggingFaceTokenizer")
    if kind not in TOKENIZER_TYPES:
        raise ConfigError(f"--tokenizer-type {kind!r} is unknown; choose one of {', '.join(TOKENIZER_TYPES)}")


def normalize(weights) -> list[float]:
    """``weights / sum(weights)`` in float64 numpy arithmetic (Megatron's ``normalize``, to the last bit)."""
    w = np.asarray(weights, np.float64)
    return (w / np.sum(w)).tolist()


def split_weights(split: str) -> list[float]:
    """``"969,30,1"`` -> normalised [train, valid, test] weights (missing parts are 0). As Megatron (which reads the
    numbers with ``re.findall(r"[.0-9]+", split)``), quotes a launch script left in (``'99,1,0'``) are ignored;
    anything else that is not a number or a separator is refused."""
    text = str(split)
    if re.sub(r"[.0-9]+|[,/\s'\"]", "", text) or not re.findall(r"[0-9]", text):
        raise ConfigError(f"--split {split!r}: expected up to three comma-separated numbers like 969,30,1")
    try:
        parts = [float(x) for x in re.findall(r"[.0-9]+", text)]
    except ValueError:
        raise ConfigError(f"--split {split!r}: expected up to three comma-separated numbers like 969,30,1") from None
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ConfigError(f"--split {split!r}: expected 1-3 non-negative numbers with a positive sum, like 969,30,1")
    return normalize(parts + [0.0] * (3 - len(parts)))


def _weight(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_blend(data_path: list[str] | str, flag: str = "--data-path") -> tuple[list[str], list[float] | None]:
    """Megatron's ``get_blend_from_list``: ``["0.7", "A", "0.3", "B"]`` -> (["A", "B"], [0.7, 0.3]) (weights as
    given, not normalised); prefixes alone, ``["A"]`` or ``["A", "B", "C"]`` -> (prefixes, None): one prefix is read
    as is, several are blended in proportion to their sizes. ``["1.0", "A"]`` is a one-dataset blend (Megatron's).
    ``flag``: the flag the value came from, which errors name (--data-path, --train-data-path, ...)."""
    items = data_path.split() if isinstance(data_path, str) else list(data_path)
    if not items:
        return [], None
    flat = " ".join(items)
    weights = [_weight(w) for w in items[0::2]] if len(items) % 2 == 0 else [None]
    if all(w is None for w in weights):
        if any(_weight(p) is not None for p in items):
            raise ConfigError(f"{flag} {flat!r}: a number among prefixes; give PREFIX ... or WEIGHT PREFIX pairs")
        return items, None
    if any(w is None for w in weights):
        bad = next(w for w, v in zip(items[0::2], weights) if v is None)
        raise ConfigError(f"{flag}: {bad!r} should be a weight (number) before a prefix; "
                          f"use WEIGHT PREFIX pairs, e.g. {flag} 0.7 A 0.3 B, or prefixes alone")
    for w, p in zip(weights, items[1::2]):
        if not w > 0:
            raise ConfigError(f"{flag}: weight {w} for {p!r} must be > 0 (leave the prefix out instead)")
    return items[1::2], weights


def parse_data_path(data_path: list[str] | str, flag: str = "--data-path") -> list[tuple[float | None, str]]:
    """(normalised weight, prefix) pairs of a data path, e.g. [(0.7, "A"), (0.3, "B")]; ``["A"]`` -> [(1.0, "A")];
    several prefixes without weights (blended by size, see :func:`parse_blend`) -> [(None, "A"), (None, "B")]."""
    prefixes, weights = parse_blend(data_path, flag)
    if weights is None:
        return [(1.0 if len(prefixes) == 1 else None, p) for p in prefixes]
    return list(zip(normalize(weights), prefixes))


def add_tokenizer_args(parser) -> None:
    """``--tokenizer-type --vocab-file --merge-file --tokenizer-model --vocab-size`` (Megatron spellings)."""
    g = parser.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default="GPT2BPETokenizer", choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json (default: the bundled one)")
    g.add_argument("--merge-file", default=None, help="GPT-2 merges.txt (default: the bundled one)")
    g.add_argument("--tokenizer-model", default=None, help="tokenizer.json (HuggingFace) or .model (SentencePiece)")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer / TikTokenizer vocabulary size")
    g.add_argument("--tiktoken-pattern", choices=("v1", "v2"), default=None, help="TikTokenizer regex (default v2)")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000, help="TikTokenizer special-token ids")
    g.add_argument("--tokenizer-special-tokens", "--tiktoken-special-tokens", "--special-tokens", nargs="+",
                   default=[], help="TikTokenizer's special tokens; MultimodalTokenizer's added tokens")
    g.add_argument("--tokenizer-prompt-format", default=None, help="MultimodalTokenizer chat format")
    g.add_argument("--image-tag-type", default="", help="MultimodalTokenizer image tags: nvlm, internvl or none")
    g.add_argument("--tokenizer-hf-no-include-special-tokens", action="store_true",
                   help="HuggingFaceTokenizer: no special tokens of the tokenizer's own (default: added, as "
                   "Megatron and transformers add a Llama tokenizer's BOS)")
    g.add_argument("--null-tokenizer-pad-id", type=int, default=-1, help="NullTokenizer's pad id (-1: none)")


_TOKENIZER_FLAGS = ("tiktoken_pattern", "tiktoken_num_special_tokens", "tokenizer_special_tokens",
                    "tokenizer_prompt_format", "image_tag_type", "tokenizer_hf_no_include_special_tokens",
                    "null_tokenizer_pad_id")


def add_data_args(parser) -> None:
    """Every ``DataConfig`` flag, Megatron spellings; read back with ``data_config_from_args``."""
    add_tokenizer_args(parser)
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=[], help="PREFIX, or WEIGHT PREFIX pairs (default: demo corpus)")
    g.add_argument("--split", default="969,30,1", help="train,valid,test document proportions")
    g.add_argument("--mock-data", action="store_true", help="synthetic tokens instead of files")
    g.add_argument("--seq-length", type=int, default=1024)
    g.add_argument("--data-cache-path", default=None, help="index cache directory (default ~/.cache/omnitron)")
    g.add_argument("--num-workers", type=int, default=2, help="DataLoader workers per rank")
    g.add_argument("--eod-mask-loss", action="store_true", help="no loss on end-of-document tokens")
    g.add_argument("--reset-position-ids", action="store_true", help="restart position ids after each eod")
    g.add_argument("--reset-attention-mask", action="store_true", help="no attention across eod boundaries")
    g.add_argument("--allow-ambiguous-pad-tokens", action="store_true",
                   help="mask the tokenizer's pad in GPT samples even when it is the eod id")
    if not any(a.dest == "seed" for a in parser._actions):
        g.add_argument("--seed", type=int, default=1234)


def data_config_from_args(args) -> DataConfig:
    """``DataConfig`` from a namespace parsed with ``add_data_args``."""
    return DataConfig(data_path=list(args.data_path), split=args.split, mock_data=args.mock_data,
                      seq_length=args.seq_length, seed=args.seed, data_cache_path=args.data_cache_path,
                      num_workers=args.num_workers, tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                      merge_file=args.merge_file, tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size,
                      **{k: getattr(args, k) for k in _TOKENIZER_FLAGS},
                      eod_mask_loss=args.eod_mask_loss, reset_position_ids=args.reset_position_ids,
                      reset_attention_mask=args.reset_attention_mask,
                      allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens)


def tokenizer_from_config(config: DataConfig):
    """The tokenizer a ``DataConfig`` names."""
    return build_tokenizer(**tokenizer_kwargs(config))
