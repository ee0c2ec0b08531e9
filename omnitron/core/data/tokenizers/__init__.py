"""Tokenizers: one interface (``Tokenizer``), four kinds, built by ``build_tokenizer``.

Kinds (Megatron's ``--tokenizer-type`` spellings): ``GPT2BPETokenizer`` (bundled GPT-2 files by
default), ``HuggingFaceTokenizer`` (a ``tokenizer.json``), ``SentencePieceTokenizer`` (a
``.model``), ``NullTokenizer`` (integers as text; ``--vocab-size``), ``BertWordPieceLowerCase`` /
``BertWordPieceCase`` (a BERT ``vocab.txt``; default: one built from the bundled corpus), Megatron's
``TikTokenizer`` (a tiktoken JSON vocabulary; the optional ``tiktoken`` package) and ``MultimodalTokenizer`` (a
Hugging Face tokenizer directory with image tokens and a chat prompt format). All load offline.
"""
from __future__ import annotations

from .base import Tokenizer, TokenizerError
from .bpe import GPT2_MERGES, GPT2_VOCAB, GPT2BPETokenizer, HuggingFaceTokenizer, sha256_of
from .simple import NullTokenizer, SentencePieceTokenizer
from .wordpiece import BertWordPieceTokenizer
from .multimodal import MultimodalTokenizer
from .tik import TikTokenizer

TOKENIZER_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer", "NullTokenizer",
                   "BertWordPieceLowerCase", "BertWordPieceCase", "Llama2Tokenizer", "GPTSentencePieceTokenizer",
                   "TikTokenizer", "MultimodalTokenizer")
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "Llama2Tokenizer", "GPTSentencePieceTokenizer")
"""Megatron's three names of one tokenizer: at d98e8a6 (megatron/core/tokenizers/utils/build_tokenizer.py,
``SP_TOKENIZERS``) all three build the same sentencepiece-library tokenizer of --tokenizer-model with the
same options (plain ``encode_as_ids``, eod = the model's eos)."""


TOKENIZER_KEYS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_size", "tiktoken_pattern",
                  "tiktoken_num_special_tokens", "tokenizer_special_tokens", "tokenizer_prompt_format",
                  "image_tag_type", "tokenizer_hf_no_include_special_tokens", "null_tokenizer_pad_id")
"""The settings that decide a tokenizer (``build_tokenizer``'s arguments but the family's ``vocab_extra_ids``)."""


def tokenizer_kwargs(source) -> dict:
    """``build_tokenizer`` keywords from a ``DataConfig``-like object or a checkpoint's flat config dict."""
    get = source.get if isinstance(source, dict) else lambda k: getattr(source, k, None)
    out = {k: get(k) for k in TOKENIZER_KEYS if get(k) is not None}
    out.setdefault("tokenizer_type", "GPT2BPETokenizer")
    return out


def build_tokenizer(tokenizer_type: str = "GPT2BPETokenizer", *, vocab_file: str | None = None,
                    merge_file: str | None = None, tokenizer_model: str | None = None,
                    vocab_size: int | None = None, vocab_extra_ids: int = 0, tiktoken_pattern: str | None = None,
                    tiktoken_num_special_tokens: int | None = None, tokenizer_special_tokens=None,
                    tokenizer_prompt_format: str | None = None, image_tag_type: str | None = None,
                    tokenizer_hf_no_include_special_tokens: bool = False,
                    null_tokenizer_pad_id: int = -1) -> Tokenizer:
    """Build the tokenizer named by ``tokenizer_type`` from local files.

    GPT2BPETokenizer: ``vocab_file`` + ``merge_file`` (both or neither; neither = bundled).
    HuggingFaceTokenizer / SentencePieceTokenizer (or Megatron's Llama2Tokenizer, GPTSentencePieceTokenizer):
    ``tokenizer_model`` (path); HuggingFaceTokenizer adds its own special tokens (a Llama BOS) unless
    ``tokenizer_hf_no_include_special_tokens``.
    NullTokenizer: ``vocab_size``, ``null_tokenizer_pad_id`` (-1: no pad; refused with the other kinds, which
    Megatron ignore it for, so that a misplaced pad is not silently dropped).
    BertWordPieceLowerCase / BertWordPieceCase: ``vocab_file`` (a BERT vocab.txt; None: bundled-corpus vocabulary);
    ``vocab_extra_ids`` sentinels ``<extra_id_i>`` appended (T5's ``--vocab-extra-ids``; these kinds only).
    TikTokenizer: ``tokenizer_model`` (JSON ranks), ``tiktoken_pattern``, ``tiktoken_num_special_tokens``,
    ``tokenizer_special_tokens``, ``vocab_size`` (see :mod:`.tik`).
    MultimodalTokenizer: ``tokenizer_model`` (HF directory), ``tokenizer_prompt_format``, ``tokenizer_special_tokens``
    (the added tokens, default ``<image>``), ``image_tag_type`` (see :mod:`.multimodal`).
    """
    if vocab_extra_ids and tokenizer_type not in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        raise TokenizerError(f"--vocab-extra-ids {vocab_extra_ids}: sentinel tokens are added to the BertWordPiece "
                             f"tokenizers only, not {tokenizer_type}; use --tokenizer-type BertWordPieceLowerCase")
    if null_tokenizer_pad_id != -1 and tokenizer_type != "NullTokenizer":
        raise TokenizerError(f"--null-tokenizer-pad-id {null_tokenizer_pad_id} sets NullTokenizer's pad, not "
                             f"{tokenizer_type}'s (whose pad comes from its files); drop it")
    if tokenizer_type == "GPT2BPETokenizer":
        if (vocab_file is None) != (merge_file is None):
            raise TokenizerError("GPT2BPETokenizer needs both --vocab-file and --merge-file, or neither "
                                 "(neither uses the bundled GPT-2 files)")
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type in ("HuggingFaceTokenizer", *SENTENCEPIECE_TYPES):
        if not tokenizer_model:
            raise TokenizerError(f"{tokenizer_type} needs --tokenizer-model PATH")
        if tokenizer_type == "HuggingFaceTokenizer":
            special = not tokenizer_hf_no_include_special_tokens
            return HuggingFaceTokenizer(tokenizer_model, include_special_tokens=special)
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "TikTokenizer":
        return TikTokenizer(tokenizer_model, pattern=tiktoken_pattern, num_special_tokens=tiktoken_num_special_tokens,
                            special_tokens=tokenizer_special_tokens, vocab_size=vocab_size)
    if tokenizer_type == "MultimodalTokenizer":
        if not tokenizer_model:
            raise TokenizerError("MultimodalTokenizer needs --tokenizer-model (a Hugging Face tokenizer directory)")
        return MultimodalTokenizer(tokenizer_model, tokenizer_prompt_format, tokenizer_special_tokens, image_tag_type)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size, pad_id=null_tokenizer_pad_id)
    if tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        return BertWordPieceTokenizer(vocab_file, lower_case=tokenizer_type == "BertWordPieceLowerCase",
                                      vocab_extra_ids=vocab_extra_ids)
    raise TokenizerError(f"unknown --tokenizer-type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}")


__all__ = ["Tokenizer", "TokenizerError", "build_tokenizer", "TOKENIZER_TYPES", "GPT2BPETokenizer",
           "HuggingFaceTokenizer", "SentencePieceTokenizer", "NullTokenizer", "BertWordPieceTokenizer", "GPT2_VOCAB",
           "SENTENCEPIECE_TYPES",
           "TikTokenizer", "MultimodalTokenizer", "TOKENIZER_KEYS", "tokenizer_kwargs",
           "GPT2_MERGES", "sha256_of"]
