"""SentencePiece models and the ``NullTokenizer`` used by tests and mock-data runs."""
from __future__ import annotations

from pathlib import Path

from .base import Tokenizer, TokenizerError


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``.model`` file; eod is the model's eos id, pad its pad id (or eod)."""

    name = "SentencePieceTokenizer"

    def __init__(self, model_file: str):
        import sentencepiece as spm

        if not Path(model_file).is_file():
            raise TokenizerError(f"--tokenizer-model {model_file!r}: no such file; pass a SentencePiece .model file")
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(str(model_file))
        except Exception as err:  # noqa: BLE001
            raise TokenizerError(f"--tokenizer-model {model_file!r} is not a SentencePiece model: {err}") from err
        eos = self._sp.eos_id()
        if eos < 0:
            raise TokenizerError(f"SentencePiece model {model_file} has no eos piece; train it with --eos_id >= 0")
        self._eod = eos
        self._pad = self._sp.pad_id() if self._sp.pad_id() >= 0 else eos

    @property
    def vocab_size(self) -> int:
        return self._sp.GetPieceSize()

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    @property
    def own_pad(self) -> int | None:
        """The model's pad piece (Megatron's ``pad_id``: ``sp.pad_id()``, whose -1 matches no id)."""
        return self._sp.pad_id() if self._sp.pad_id() >= 0 else None

    def encode(self, text: str) -> list[int]:
        return list(self._sp.EncodeAsIds(text))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(x) for x in self._sp.EncodeAsIds(texts)]

    def decode(self, ids) -> str:
        return self._sp.DecodeIds([int(i) for i in ids])

    @property
    def fingerprint(self) -> str:
        import hashlib

        return hashlib.sha256(self._sp.serialized_model_proto()).hexdigest()


class NullTokenizer(Tokenizer):
    """Text is space-separated integer ids (Megatron's ``NullTokenizer``).

    NOTE: as in Megatron, ``--vocab-size V`` means ids ``0..V-1`` for data plus one more id,
    ``V``, for eod: ``vocab_size`` is ``V + 1``. ``pad_id`` (``--null-tokenizer-pad-id``, Megatron's default -1):
    the pad Megatron's NullTokenizer reports; a negative one is no pad (no id equals it, as Megatron's -1).
    """

    name = "NullTokenizer"

    def __init__(self, vocab_size: int, pad_id: int = -1):
        if vocab_size is None or int(vocab_size) < 1:
            raise TokenizerError(f"NullTokenizer needs --vocab-size >= 1, got {vocab_size!r}")
        self._v = int(vocab_size)
        self._own_pad = None if int(pad_id) < 0 else int(pad_id)

    @property
    def own_pad(self) -> int | None:
        return self._own_pad

    @property
    def vocab_size(self) -> int:
        return self._v + 1

    @property
    def eod(self) -> int:
        return self._v

    def encode(self, text: str) -> list[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError as err:
            raise TokenizerError(f"NullTokenizer input must be space-separated integers: {err}") from err
        bad = [i for i in ids if not 0 <= i <= self._v]
        if bad:
            raise TokenizerError(f"NullTokenizer ids {bad[:5]} outside [0, {self._v}] (--vocab-size {self._v})")
        return ids

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)
