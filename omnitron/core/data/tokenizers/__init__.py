"""Tokenizers: one interface (``Tokenizer``), four kinds, built by ``build_tokenizer``.

Kinds (Megatron's ``--tokenizer-type`` spellings): ``GPT2BPETokenizer`` (bundled GPT-2 files by
default), ``HuggingFaceTokenizer`` (a ``tokenizer.json``), ``SentencePieceTokenizer`` (a
``.model``), ``NullTokenizer`` (integers as text; ``--vocab-size``), ``BertWordPieceLowerCase`` /
``BertWordPieceCase`` (a BERT ``vocab.txt``; default: one built from the bundled corpus). All load offline.
"""
from __future__ import annotations

from .base import Tokenizer, TokenizerError
from .bpe import GPT2_MERGES, GPT2_VOCAB, GPT2BPETokenizer, HuggingFaceTokenizer, sha256_of
from .simple import NullTokenizer, SentencePieceTokenizer
from .wordpiece import BertWordPieceTokenizer

TOKENIZER_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer", "NullTokenizer",
                   "BertWordPieceLowerCase", "BertWordPieceCase", "Llama2Tokenizer", "GPTSentencePieceTokenizer")
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "Llama2Tokenizer", "GPTSentencePieceTokenizer")
"""Megatron's three names of one tokenizer: at d98e8a6 (megatron/core/tokenizers/utils/build_tokenizer.py,
``SP_TOKENIZERS``) all three build the same sentencepiece-library tokenizer of --tokenizer-model with the
same options (plain ``encode_as_ids``, eod = the model's eos)."""


def build_tokenizer(tokenizer_type: str = "GPT2BPETokenizer", *, vocab_file: str | None = None,
                    merge_file: str | None = None, tokenizer_model: str | None = None,
                    vocab_size: int | None = None, vocab_extra_ids: int = 0) -> Tokenizer:
    """Build the tokenizer named by ``tokenizer_type`` from local files.

    GPT2BPETokenizer: ``vocab_file`` + ``merge_file`` (both or neither; neither = bundled).
    HuggingFaceTokenizer / SentencePieceTokenizer (or Megatron's Llama2Tokenizer, GPTSentencePieceTokenizer):
    ``tokenizer_model`` (path).
    NullTokenizer: ``vocab_size``.
    BertWordPieceLowerCase / BertWordPieceCase: ``vocab_file`` (a BERT vocab.txt; None: bundled-corpus vocabulary);
    ``vocab_extra_ids`` sentinels ``<extra_id_i>`` appended (T5's ``--vocab-extra-ids``; these kinds only).
    """
    if vocab_extra_ids and tokenizer_type not in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        raise TokenizerError(f"--vocab-extra-ids {vocab_extra_ids}: sentinel tokens are added to the BertWordPiece "
                             f"tokenizers only, not {tokenizer_type}; use --tokenizer-type BertWordPieceLowerCase")
    if tokenizer_type == "GPT2BPETokenizer":
        if (vocab_file is None) != (merge_file is None):
            raise TokenizerError("GPT2BPETokenizer needs both --vocab-file and --merge-file, or neither "
                                 "(neither uses the bundled GPT-2 files)")
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type in ("HuggingFaceTokenizer", *SENTENCEPIECE_TYPES):
        if not tokenizer_model:
            raise TokenizerError(f"{tokenizer_type} needs --tokenizer-model PATH")
        cls = HuggingFaceTokenizer if tokenizer_type == "HuggingFaceTokenizer" else SentencePieceTokenizer
        return cls(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    if tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        return BertWordPieceTokenizer(vocab_file, lower_case=tokenizer_type == "BertWordPieceLowerCase",
                                      vocab_extra_ids=vocab_extra_ids)
    raise TokenizerError(f"unknown --tokenizer-type {tokenizer_type!r}; choose one of {', '.join(TOKENIZER_TYPES)}")


__all__ = ["Tokenizer", "TokenizerError", "build_tokenizer", "TOKENIZER_TYPES", "GPT2BPETokenizer",
           "HuggingFaceTokenizer", "SentencePieceTokenizer", "NullTokenizer", "BertWordPieceTokenizer", "GPT2_VOCAB", "SENTENCEPIECE_TYPES",
           "GPT2_MERGES", "sha256_of"]
