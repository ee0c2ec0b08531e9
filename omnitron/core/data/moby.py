"""The bundled Moby Dick text (public domain) as chapters and documents: what the demo corpus and the
bundled-corpus WordPiece vocabulary are made of. The text ships xz-compressed in ``omnitron/data/corpus/``
(licence notice beside it).
"""
from __future__ import annotations

import lzma
import re
from pathlib import Path

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
