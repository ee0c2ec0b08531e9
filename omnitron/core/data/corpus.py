"""The bundled demo corpus: Moby Dick (public domain), tokenized on first use and cached.

``demo_corpus_prefix()`` returns the prefix of an indexed dataset (runs of paragraphs of at least
1000 characters within a chapter as documents, eod appended), tokenized with the run's tokenizer, so the
first training run needs no preprocessing step. The text ships
xz-compressed in ``omnitron/data/corpus/`` (licence notice beside it).
"""
from __future__ import annotations

import lzma
import os
import re
import uuid
from pathlib import Path

import numpy as np

from .config import default_cache_dir
from .indexed import IndexedDatasetBuilder, data_file, exists, index_file, optimal_dtype
from .tokenizers import build_tokenizer, sha256_of

CORPUS_DIR = Path(__file__).resolve().parents[2] / "data" / "corpus"
MOBY_DICK = CORPUS_DIR / "moby_dick.txt.xz"
DOC_MIN_CHARS = 1000
_CHAPTER = re.compile(r"^(?=CHAPTER \d+\.)", re.MULTILINE)


def moby_dick_text() -> str:
    """The full text (1,190,317 characters)."""
    with lzma.open(MOBY_DICK, "rt", encoding="utf-8") as f:
        return f.read()


def moby_dick_chapters() -> list[str]:
    """The text split before each ``CHAPTER N.`` heading (135 chapters; empty pieces dropped)."""
    return [c.strip() for c in _CHAPTER.split(moby_dick_text()) if c.strip()]


def moby_dick_documents(min_chars: int = DOC_MIN_CHARS) -> list[str]:
    """Documents of whole paragraphs, at least ``min_chars`` long, never crossing a chapter; each paragraph
    on one line (the Gutenberg text breaks lines at about 70 characters: kept, one token in 15 of the
    GPT-2 encoding was a line break, and a small model learned mostly to print them).

    NOTE: chapters alone (135) are too few for ``--split 969,30,1`` to give the test split a
    document; runs of paragraphs give about a thousand documents.
    """
    docs = []
    for chapter in moby_dick_chapters():
        run: list[str] = []
        for para in re.split(r"\n\s*\n", chapter):
            run.append(" ".join(para.split()))  # the text's hard line breaks (about 70 characters) unwrapped
            if sum(len(p) for p in run) >= min_chars:
                docs.append("\n\n".join(run))
                run = []
        if run:
            docs.append("\n\n".join(run))
    return docs


def demo_corpus_prefix(tokenizer=None, cache_dir: str | None = None, *, build: bool = True) -> str:
    """Prefix of the demo corpus tokenized with ``tokenizer`` (default: the bundled GPT-2 BPE) under
    ``cache_dir`` (default ``$OMNITRON_CACHE`` or ~/.cache/omnitron), keyed by the text and the tokenizer's
    fingerprint, so a run with its own vocabulary never reads ids of another.

    Built the first time (about a second); later calls return at once. Concurrent builders are
    safe: each writes private temporary files and renames them into place. ``build=False``
    only computes the prefix and fails if it is not there yet.
    """
    tok = tokenizer or build_tokenizer("GPT2BPETokenizer")
    if tok.fingerprint is None:
        raise ValueError(f"the demo corpus needs a tokenizer with a vocabulary file; {tok.name} has none: "
                         "pass --data-path, or --mock-data")
    tag = f"{tok.fingerprint[:12]}_{sha256_of(MOBY_DICK)[:12]}_{DOC_MIN_CHARS}_unwrapped"
    prefix = os.path.join(cache_dir or default_cache_dir(), "corpus", f"moby_dick_{tok.name}_{tag}_text_document")
    if exists(prefix):
        return prefix
    if not build:
        raise FileNotFoundError(f"demo corpus {prefix}.bin/.idx not built yet: call demo_corpus_prefix() "
                                "on the builder rank first (build_gpt_datasets does)")
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    tmp = f"{prefix}.tmp-{uuid.uuid4().hex[:8]}"
    builder = IndexedDatasetBuilder(data_file(tmp), optimal_dtype(tok.vocab_size))
    for ids in tok.encode_batch(moby_dick_documents()):
        builder.add_document(np.asarray(ids + [tok.eod]))
    builder.finalize(index_file(tmp))
    os.replace(data_file(tmp), data_file(prefix))  # .bin first: .idx marks completion
    os.replace(index_file(tmp), index_file(prefix))
    return prefix
