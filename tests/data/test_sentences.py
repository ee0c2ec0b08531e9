"""Sentence splitting: the rule-based splitter on tricky text, and ``omnitron preprocess --split-sentences``
(one sequence per sentence, document boundaries in the ``.idx``, same bytes for 1 and 2 workers, BERT
samples built from the stored sentences)."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from omnitron.cli import main
from omnitron.core.data import IndexedDataset, build_tokenizer
from omnitron.core.data.corpus import moby_dick_documents
from omnitron.core.data.sentences import split_sentences

TRICKY = {
    "Mr. Smith met Dr. Jones at 3.15 p.m. on Jan. 5. They talked.":
        ["Mr. Smith met Dr. Jones at 3.15 p.m. on Jan. 5.", " They talked."],
    'He said, "Stop." Then he left. "Why?" she asked. (It was late.) Later...':
        ['He said, "Stop."', " Then he left.", ' "Why?" she asked.', " (It was late.)", " Later..."],
    "See Fig. 3 and No. 5. He said no. Then J. R. R. Tolkien wrote e.g. this. The U.S. Army came. So did I. Ok":
        ["See Fig. 3 and No. 5.", " He said no.", " Then J. R. R. Tolkien wrote e.g. this.", " The U.S. Army came.",
         " So did I.", " Ok"],
    "Wow! it stays. Pi is 3.14159 exactly? 1851 began.\n\nno stop here\n\n  Last one.  ":
        ["Wow! it stays.", " Pi is 3.14159 exactly?", " 1851 began.", "\n\nno stop here", "\n\n  Last one.  "],
    "\u201cAye, aye!\u201d cried he. \u201cWhere?\u201d Nowhere.":
        ["\u201cAye, aye!\u201d cried he.", " \u201cWhere?\u201d", " Nowhere."],
    "": [],
    "one sentence without an end": ["one sentence without an end"],
}


@pytest.mark.parametrize("text", sorted(TRICKY))
def test_splitter_on_tricky_text(text):
    assert split_sentences(text) == TRICKY[text]


def test_pieces_join_back_to_the_text():
    rng = random.Random()  # fresh every run
    atoms = ["Mr.", "e.g.", "3.5", "word", "Word", "I.", "No.", "7", "!", "?", ".", '"', "\u201d", "(", ")", "...",
             "A.", "x", "U.S."]
    for _ in range(300):
        text = "".join(rng.choice(atoms) + rng.choice(["", " ", "  ", "\n", "\n\n", " \n \n"])
                       for _ in range(rng.randint(0, 30)))
        pieces = split_sentences(text)
        assert "".join(pieces) == text
        assert all(p.strip() for p in pieces) or pieces == [text]


def _expected(tok, doc: str) -> list[list[int]]:
    """Longhand: each non-empty sentence's tokens, the eod appended to the last one."""
    out = [ids for ids in (tok.encode(s) for s in split_sentences(doc)) if ids]
    out[-1] = out[-1] + [tok.eod]
    return out


def test_preprocess_split_sentences(tmp_path, capsys):
    docs = list(TRICKY)[:5] + moby_dick_documents()[:40]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = build_tokenizer()
    outs = []
    for w in (1, 2):
        assert main(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / f"w{w}"),
                     "--append-eod", "--split-sentences", "--workers", str(w), "--no-progress"]) == 0
        assert f"w{w}_text_sentence.bin" in capsys.readouterr().out
        outs.append([(tmp_path / f"w{w}_text_sentence.{ext}").read_bytes() for ext in ("bin", "idx")])
    assert outs[0] == outs[1]  # multi-worker output equals single-worker output, byte for byte
    ds = IndexedDataset(tmp_path / "w1_text_sentence")
    assert ds.num_documents == len(docs) and len(ds) > 2 * len(docs)
    bounds = ds.document_indices
    for d, doc in enumerate(docs):
        want = _expected(tok, doc)
        got = [ds[i].tolist() for i in range(int(bounds[d]), int(bounds[d + 1]))]
        assert got == want, d
        # the document's sentences concatenated are the document's tokens (GPT-2 BPE cuts there anyway)
        assert ds.document(d).tolist() == tok.encode(doc) + [tok.eod]


def test_bert_dataset_uses_stored_sentences(tmp_path):
    from omnitron.core.data.bert_dataset import BertDataset

    docs = moby_dick_documents()[:12]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    assert main(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "b"),
                 "--tokenizer-type", "BertWordPieceLowerCase", "--split-sentences", "--no-progress"]) == 0
    tok = build_tokenizer("BertWordPieceLowerCase")
    ds = IndexedDataset(tmp_path / "b_text_sentence")
    stored = {tuple(ds[i].tolist()) for i in range(len(ds))}
    bert = BertDataset(ds, np.arange(ds.num_documents), 20, seq_length=512, seed=5, tokenizer=tok,
                       cache_dir=str(tmp_path / "cache"))
    seen = 0
    for i in range(20):
        for sentence in bert.sentences(i):  # whole stored sentences, not fixed spans (seq_length 512 fits them)
            assert tuple(sentence.tolist()) in stored
            seen += 1
    assert seen > 40
