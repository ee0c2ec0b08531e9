"""Megatron's ``TikTokenizer``: a tiktoken BPE over a JSON list of ranks, special tokens first.

As Megatron-LM at d98e8a6 (``megatron/core/tokenizers/text/libraries/tiktoken_tokenizer.py``):

* ``--tokenizer-model FILE`` is a JSON list ``[{"rank": i, "token_bytes": base64, "token_str": str}, ...]``
  with ``rank == index``; the first 256 entries are the single bytes ``0..255`` in order.
* ids ``0 .. num_special-1`` are the special tokens (``--tokenizer-special-tokens``, default
  ``<unk> <s> </s> <mask> <pad> <cls> <sep>``, which any custom list must contain), then ``<SPECIAL_i>``
  fillers up to ``--tiktoken-num-special-tokens`` (default 1000); a file rank ``r`` is id ``r + num_special``.
* ``--vocab-size`` (default 2**17) counts both; the file is cut to its first ``vocab_size - num_special``
  entries and must have at least that many.
* ``--tiktoken-pattern v1|v2`` (default v2) is the pre-tokenizer regex; eod = ``</s>``, pad = ``<pad>``.
* Text spelling a special token is encoded as that token (Megatron's ``allowed_special="all"``).

The BPE itself is the ``tiktoken`` package's (an optional extra: ``pip install tiktoken``).
"""
from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

from .base import Tokenizer, TokenizerError

PATTERNS = {
    # Megatron's _PATTERN_TIKTOKEN_V1 and _PATTERN_TIKTOKEN_V2, character for character.
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|[^\\r\\n\\p{L}"
          "\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+"
          "[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
}
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
DEFAULT_VOCAB_SIZE = 2 ** 17
DEFAULT_NUM_SPECIAL = 1000


def read_ranks(path: str, limit: int) -> dict[bytes, int]:
    """The first ``limit`` ranks of a Megatron tiktoken JSON file as ``{token bytes: rank}``."""
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except (OSError, ValueError) as err:
        raise TokenizerError(f"--tokenizer-model {path!r}: not a readable tiktoken JSON vocabulary ({err})") from None
    if not isinstance(entries, list):
        raise TokenizerError(f"--tokenizer-model {path!r}: expected a JSON list of {{rank, token_bytes, token_str}}")
    ranks: dict[bytes, int] = {}
    for i, entry in enumerate(entries[:limit]):
        if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"} or entry["rank"] != i:
            raise TokenizerError(f"--tokenizer-model {path!r}: entry {i} is not {{rank: {i}, token_bytes, token_str}}")
        token = base64.b64decode(entry["token_bytes"])
        if (i < 256 and token != bytes([i])) or token in ranks:
            raise TokenizerError(f"--tokenizer-model {path!r}: entry {i} ({token!r}) breaks the byte-then-merge "
                                 "order (the first 256 ranks are the bytes 0..255, every token once)")
        ranks[token] = i
    return ranks


def special_token_list(special_tokens, num_special: int) -> list[str]:
    """The ``num_special`` special tokens: the given (or default) ones, then ``<SPECIAL_i>`` fillers."""
    given = list(special_tokens) if special_tokens else list(SPECIAL_TOKENS)
    missing = [t for t in SPECIAL_TOKENS if t not in given]
    if missing or len(set(given)) != len(given):
        raise TokenizerError(f"--tokenizer-special-tokens must hold {' '.join(SPECIAL_TOKENS)} once each "
                             f"(missing or repeated: {missing or given})")
    if len(given) > num_special:
        raise TokenizerError(f"--tiktoken-num-special-tokens {num_special} is fewer than the {len(given)} special "
                             "tokens given; raise it")
    return given + [f"<SPECIAL_{i}>" for i in range(len(given), num_special)]


class TikTokenizer(Tokenizer):
    """Megatron's TikTokenizer (see the module docstring for the file format and ids)."""

    name = "TikTokenizer"

    def __init__(self, path: str, *, pattern: str | None = None, num_special_tokens: int | None = None,
                 special_tokens=None, vocab_size: int | None = None):
        try:
            import tiktoken
        except ImportError:
            raise TokenizerError("--tokenizer-type TikTokenizer needs the tiktoken package: pip install tiktoken "
                                 "(or pip install omnitron[tiktoken])") from None
        if not path or not Path(path).is_file():
            raise TokenizerError(f"--tokenizer-model {path!r}: no such file; pass a tiktoken JSON vocabulary")
        pattern = pattern or "v2"
        if pattern not in PATTERNS:
            raise TokenizerError(f"--tiktoken-pattern {pattern!r}: expected v1 or v2")
        num_special = DEFAULT_NUM_SPECIAL if num_special_tokens is None else int(num_special_tokens)
        total = DEFAULT_VOCAB_SIZE if vocab_size is None else int(vocab_size)
        if total <= num_special:
            raise TokenizerError(f"--vocab-size {total} must exceed --tiktoken-num-special-tokens {num_special}")
        self.special_tokens = special_token_list(special_tokens, num_special)
        ranks = read_ranks(path, total - num_special)
        if len(ranks) != total - num_special:
            raise TokenizerError(f"--tokenizer-model {path!r} has {len(ranks)} ranks, --vocab-size {total} needs "
                                 f"{total - num_special} after the {num_special} special tokens; pass --vocab-size "
                                 f"{len(ranks) + num_special}")
        self.pattern_name, self.num_special, self._size = pattern, num_special, total
        self.ranks = {token: rank + num_special for token, rank in ranks.items()}
        self._enc = tiktoken.Encoding(name=Path(path).parent.name or "tiktoken", pat_str=PATTERNS[pattern],
                                      mergeable_ranks=self.ranks,
                                      special_tokens={t: i for i, t in enumerate(self.special_tokens)})

    @property
    def vocab_size(self) -> int:
        return self._size

    @property
    def eod(self) -> int:
        return self.special_tokens.index("</s>")

    @property
    def pad(self) -> int:
        return self.special_tokens.index("<pad>")

    @property
    def own_pad(self) -> int:
        """``<pad>`` (4 with the default special tokens), as Megatron's TikTokenizer."""
        return self.pad

    @property
    def bos(self) -> int:
        """``<s>``'s id."""
        return self.special_tokens.index("<s>")

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all")

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha256(f"{self.pattern_name}\n{self.special_tokens}\n".encode("utf-8"))
        for token, rank in sorted(self.ranks.items(), key=lambda kv: kv[1]):
            h.update(b"%d:" % rank + token)
        return h.hexdigest()
