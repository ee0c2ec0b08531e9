"""A small dependency-free sentence splitter for ``omnitron preprocess --split-sentences`` and BERT data.

Megatron splits with NLTK's punkt; this is a rule-based stand-in (punkt is not a dependency and
its model needs a download). A sentence ends after ``.``, ``!`` or ``?`` (a run of them, then any
closing quotes or brackets) when whitespace follows and the next text starts, after any opening
quotes or brackets, with an upper-case letter or a digit. A ``.`` does not end a sentence after a
known abbreviation (``Mr.``, ``Dr.``, months, ...; ``No.``/``Vol.``/``Fig.`` before a number), a
single letter other than ``I`` (an initial: ``J. R. Smith``) or a dotted word (``U.S.``, ``e.g.``). Decimals (``3.14``)
never split (no whitespace). A blank line always ends a sentence (paragraphs).

Whitespace between sentences goes to the FOLLOWING sentence, so ``"".join(split_sentences(t)) == t``
and a byte-level BPE (GPT-2) tokenizes the pieces into the same tokens as the whole text: every cut
falls where the BPE's pre-tokenizer cuts anyway.
"""
from __future__ import annotations

import re

ABBREVIATIONS = frozenset("""
mr mrs ms messrs dr prof sr jr st mt ft rev hon gen col maj capt cmdr lt sgt adm gov sen rep pres supt insp
cf viz al vs ed eds trans inc ltd co corp bros dept univ assn approx jan feb mar apr jun jul aug sep sept oct nov dec
""".split())
NUMBER_ABBREVIATIONS = frozenset("no nos vol vols fig figs ch chap sec pp art".split())
"""Abbreviations only before a number (``No. 5``; but ``He said no. Then ...`` ends a sentence)."""
_OPENERS = "\"'\u201c\u2018([{"
_CLOSERS = "\"'\u201d\u2019)]}"
_END = re.compile(r"[.!?]+[" + re.escape(_CLOSERS) + r"]*(?=\s)")
_PARAGRAPH = re.compile(r"\s*\n[ \t\r\f\v]*\n")


def _starts_sentence(text: str, pos: int) -> bool:
    """True when ``text[pos:]`` (after whitespace) opens a sentence: an upper-case letter or a digit."""
    while pos < len(text) and (text[pos].isspace() or text[pos] in _OPENERS):
        pos += 1
    return pos < len(text) and (text[pos].isupper() or text[pos].isdigit())


def _is_abbreviation(text: str, dot: int, next_pos: int) -> bool:
    """Whether the ``.`` at ``text[dot]`` closes an abbreviation, an initial or a dotted acronym
    (``next_pos``: where the whitespace after it begins)."""
    start = dot
    while start > 0 and not text[start - 1].isspace():
        start -= 1
    word = text[start:dot].lstrip(_OPENERS)
    if not word:
        return False
    if word.lower() in ABBREVIATIONS or "." in word:  # "Mr", "e.g", "U.S"
        return True
    if word.lower() in NUMBER_ABBREVIATIONS:
        return text[next_pos:].lstrip()[:1].isdigit()
    return len(word) == 1 and word.isalpha() and word != "I"  # an initial


def sentence_starts(text: str) -> list[int]:
    """Character offsets where each sentence after the first begins (sorted, inside the text)."""
    cuts = set()
    for m in _END.finditer(text):
        punct = m.group().rstrip(_CLOSERS)
        if not _starts_sentence(text, m.end()):
            continue
        if punct == "." and _is_abbreviation(text, m.start(), m.end()):
            continue
        cuts.add(m.end())
    for m in _PARAGRAPH.finditer(text):
        if m.start() > 0 and text[:m.start()].strip() and text[m.end():].strip():
            cuts.add(m.start())
    return sorted(c for c in cuts if 0 < c < len(text))


def split_sentences(text: str) -> list[str]:
    """``text`` cut into sentences; joining them gives ``text`` back (see the module docstring).
    Whitespace-only pieces are merged into the next sentence; ``""`` gives ``[]``."""
    bounds = [0, *sentence_starts(text), len(text)]
    pieces = [text[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    out: list[str] = []
    carry = ""
    for piece in pieces:
        if not piece.strip():
            carry += piece
            continue
        out.append(carry + piece)
        carry = ""
    if carry:
        if out:
            out[-1] += carry
        else:
            out.append(carry)
    return out
