"""The bundled demo corpus: Moby Dick (public domain), tokenized on first use and cached.

``demo_corpus_prefix()`` returns the prefix of an indexed dataset (runs of paragraphs of at least
1000 characters within a chapter as documents, eod appended), tokenized with the run's tokenizer, so the
first training run needs no preprocessing step. The text ships
xz-compressed in ``omnitron/data/corpus/`` (licence notice beside it).
"""
from __future__ import annotations

import os
import uuid

import numpy as np

from .cache import default_cache_dir
from .indexed import IndexedDatasetBuilder, data_file, exists, index_file, optimal_dtype
from .moby import (  # noqa: F401 - re-exported: callers import them from here
    CORPUS_DIR, DOC_MIN_CHARS, MOBY_DICK, moby_dick_chapters, moby_dick_documents, moby_dick_text)
from .tokenizers import build_tokenizer, sha256_of


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
