"""The one tokenizer interface the data pipeline and the trainer use.

Every tokenizer maps text to a list of integer ids and back, and names two special ids:
``eod`` (appended after each document by preprocessing; also the separator the GPT dataset
sees between documents) and ``pad``. ``vocab_size`` counts every id ``encode`` can return;
models pad it up (``--make-vocab-size-divisible-by``) on their side.
"""
from __future__ import annotations

import abc


class TokenizerError(ValueError):
    """A tokenizer could not be built or its files fail a check; the message names the fix."""


class Tokenizer(abc.ABC):
    """Text <-> ids. Subclasses set ``name`` and implement the abstract members."""

    name: str = "tokenizer"

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of distinct ids (all ids are in ``[0, vocab_size)``)."""

    @property
    @abc.abstractmethod
    def eod(self) -> int:
        """End-of-document id."""

    @property
    def pad(self) -> int:
        """Padding id (the eod id unless the vocabulary has a dedicated one)."""
        return self.eod

    @property
    def own_pad(self) -> int | None:
        """The vocabulary's own padding id as Megatron's tokenizer of this kind reports it (None: it has none,
        and ``pad`` falls back to eod). GPT samples mask it (``gpt_dataset.dataset_pad_id``), as Megatron's."""
        return None

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` (no special tokens added)."""

    @abc.abstractmethod
    def decode(self, ids) -> str:
        """Text of ``ids`` (any iterable of ints)."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of several texts; implementations backed by ``tokenizers`` batch natively."""
        return [self.encode(t) for t in texts]

    @property
    def fingerprint(self) -> str | None:
        """sha256 of everything that decides the ids (the serialized vocabulary, merges and rules), or
        ``None`` when the tokenizer has no such description; caches of tokenized text are keyed by it."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eod={self.eod}, pad={self.pad})"
