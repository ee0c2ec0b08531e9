"""BERT WordPiece tokenizers (Megatron's ``BertWordPieceLowerCase`` / ``BertWordPieceCase``).

A standard BERT ``vocab.txt`` (one token per line, id = line number) read by the ``tokenizers``
package: BERT normalisation (lower-casing for the LowerCase kind), BERT pre-tokenisation, greedy
longest-match WordPiece with ``##`` continuations. ``[CLS]``, ``[SEP]``, ``[MASK]``, ``[PAD]`` and
``[UNK]`` must be in the vocabulary; ``eod`` is ``[SEP]``; each of them written in raw text is its id.
``vocab_extra_ids`` (T5's ``--vocab-extra-ids``) appends the sentinels ``<extra_id_0>`` ... as special tokens after the
vocabulary (existing ids unchanged; a vocabulary that has them already keeps its ids).

Without ``--vocab-file`` a small vocabulary is built offline from the bundled *Moby Dick* text by
:func:`build_wordpiece_vocab` (deterministic: the special tokens, every character alone and as a
``##`` continuation, then the most frequent words, ties broken alphabetically) and cached.
"""
from __future__ import annotations

import collections
import os
import uuid
from pathlib import Path

from ..cache import default_cache_dir
from ..moby import moby_dick_documents
from .base import TokenizerError
from .bpe import _HFBacked, _require_file

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
DEFAULT_VOCAB_SIZE = 8192


def _bert_pipeline(tok, lower_case: bool):
    from tokenizers import decoders, normalizers, pre_tokenizers

    tok.normalizer = normalizers.BertNormalizer(lowercase=lower_case, strip_accents=lower_case)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    return tok


class BertWordPieceTokenizer(_HFBacked):
    """WordPiece from a BERT ``vocab.txt``; exposes ``cls``, ``sep``, ``mask``, ``pad`` and ``unk`` ids."""

    def __init__(self, vocab_file: str | None = None, *, lower_case: bool = True, cache_dir: str | None = None,
                 vocab_extra_ids: int = 0):
        from tokenizers import Tokenizer as HFTokenizer, models

        self.name = "BertWordPieceLowerCase" if lower_case else "BertWordPieceCase"
        path = _require_file(vocab_file, "--vocab-file") if vocab_file else default_vocab_file(lower_case, cache_dir)
        try:
            tok = HFTokenizer(models.WordPiece.from_file(str(path), unk_token="[UNK]"))
        except Exception as err:  # noqa: BLE001 - the library's message names the parse problem
            raise TokenizerError(f"--vocab-file {str(path)!r} is not a WordPiece vocab.txt: {err}") from err
        missing = [t for t in SPECIAL_TOKENS if tok.token_to_id(t) is None]
        if missing:
            raise TokenizerError(f"--vocab-file {str(path)!r} lacks the BERT special tokens {missing}; "
                                 "use a BERT vocab.txt (or omit --vocab-file for the bundled-corpus vocabulary)")
        _bert_pipeline(tok, lower_case)
        # NOTE: as special tokens (their vocab ids kept), a literal "[SEP]" / "[CLS]" / "[MASK]" / "[PAD]" / "[UNK]" in
        # raw text is that one id, matched before lower-casing, as Megatron's BertWordPiece (transformers'
        # BertTokenizer) encodes it; "[sep]" stays text
        tok.add_special_tokens(list(SPECIAL_TOKENS))
        names = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        tok.add_special_tokens(names)
        self.sentinels = tuple(tok.token_to_id(n) for n in names)  # T5's span sentinels, in order
        self.vocab_file = str(path)
        self.cls, self.sep, self.mask, self.unk = (tok.token_to_id(t) for t in ("[CLS]", "[SEP]", "[MASK]", "[UNK]"))
        super().__init__(tok, self.sep, tok.token_to_id("[PAD]"))
        self._own_pad = self.pad  # [PAD], as Megatron's BertWordPiece (Hugging Face's BertTokenizer)

    @property
    def special_ids(self) -> tuple[int, ...]:
        """Ids never chosen as a random replacement token and never kept as text in a segment."""
        return tuple(sorted({self.pad, self.unk, self.cls, self.sep, self.mask, *self.sentinels}))

    @property
    def continuation_ids(self) -> tuple[int, ...]:
        """Ids of the ``##`` pieces that continue a word (BERT's whole-word masking joins them to it)."""
        vocab = self._tok.get_vocab(with_added_tokens=False)
        return tuple(sorted(i for t, i in vocab.items() if t.startswith("##")))


def build_wordpiece_vocab(texts, vocab_size: int, *, lower_case: bool = True) -> list[str]:
    """A deterministic WordPiece vocabulary of at most ``vocab_size`` tokens from ``texts``."""
    from tokenizers import normalizers, pre_tokenizers

    norm = normalizers.BertNormalizer(lowercase=lower_case, strip_accents=lower_case)
    pre = pre_tokenizers.BertPreTokenizer()
    counts: collections.Counter = collections.Counter()
    for text in texts:
        counts.update(w for w, _ in pre.pre_tokenize_str(norm.normalize_str(text)))
    chars = sorted({ch for w in counts for ch in w})
    vocab = list(SPECIAL_TOKENS) + chars + ["##" + ch for ch in chars]
    if vocab_size < len(vocab):
        raise TokenizerError(f"vocabulary size {vocab_size} is below the {len(vocab)} special and character tokens "
                             "the text needs; use a larger vocabulary")
    seen = set(vocab)
    words = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if w not in seen]
    return vocab + words[: vocab_size - len(vocab)]


def default_vocab_file(lower_case: bool = True, cache_dir: str | None = None) -> Path:
    """The cached vocab.txt built from the bundled corpus (built on first use; safe under concurrent ranks:
    the first complete file to be linked into place wins, every rank then reads that one)."""
    case = "uncased" if lower_case else "cased"
    path = (Path(cache_dir or default_cache_dir()) / "tokenizers"
            / f"moby_dick_wordpiece_{case}_{DEFAULT_VOCAB_SIZE}.txt")
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_text("\n".join(build_wordpiece_vocab(moby_dick_documents(), DEFAULT_VOCAB_SIZE,
                                                   lower_case=lower_case)) + "\n", encoding="utf-8")
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path
