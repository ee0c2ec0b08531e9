"""``omnitron preprocess``: output equals direct tokenization for 1 and 2 workers; bad input counted or refused."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from omnitron.cli import main
from omnitron.core.data import IndexedDataset, build_tokenizer
from omnitron.core.data.corpus import moby_dick_documents
from omnitron.core.data.preprocess import PreprocessError, preprocess_files


def test_jsonl_workers_and_bad_lines(tmp_path, capsys):
    docs = moby_dick_documents()[:300]
    lines = [json.dumps({"text": d, "id": i}).encode() for i, d in enumerate(docs)]
    lines[10] = b'{"title": "no text key"}'
    lines[20] = b"{not json"
    lines[30] = json.dumps({"text": "caf\u00e9 bad byte"}).encode().replace(b"\\u00e9", b"\xe9")
    lines[40] = json.dumps({"text": ""}).encode()
    lines[50] = b"[1, 2]"
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    tok = build_tokenizer()
    expected = [tok.encode(d) + [tok.eod] for i, d in enumerate(docs) if i not in (10, 20, 30, 40, 50)]
    expected.insert(28, tok.encode("caf\ufffd bad byte") + [tok.eod])
    outs = []
    for w in (1, 2):
        rc = main(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / f"w{w}"),
                   "--append-eod", "--workers", str(w), "--no-progress"])
        assert rc == 0
        out = capsys.readouterr().out
        assert "296 documents" in out and "invalid UTF-8 lines 1" in out
        assert "bad_json 2" in out and "missing_key 1" in out and "(and 1 empty, kept without tokens)" in out
        ds = IndexedDataset(tmp_path / f"w{w}_text_document")
        assert ds.dtype == np.uint16 and [ds[i].tolist() for i in range(len(ds))] == expected
        # the empty text (line 40: document 38, after the 38 good or repaired lines 0-39 but 10 and 20) is a
        # document of no sequences, as Megatron writes it: its boundary repeats
        di = ds.document_indices.tolist()
        assert len(di) == len(expected) + 2 and di[38] == di[39] == 38 and di[37] == 37
        outs.append((tmp_path / f"w{w}_text_document.bin").read_bytes())
    assert outs[0] == outs[1]


def test_text_modes_skip_and_empty_input(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"first para\nline two\n\n\nsecond \xff para\n\nthird\n")
    tok = build_tokenizer("GPT2BPETokenizer")
    s = preprocess_files([str(tmp_path / "a.txt")], str(tmp_path / "p"), txt_mode="paragraph", append_eod=False)
    ds = IndexedDataset(str(tmp_path / "p_text_document"))
    assert [tok.decode(ds[i]) for i in range(len(ds))] == ["first para\nline two", "second \ufffd para", "third"]
    s = preprocess_files([str(tmp_path / "a.txt")], str(tmp_path / "l"), invalid_utf8="skip")
    assert s.documents == 3 and s.skipped["invalid_utf8"] == 1
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(PreprocessError, match="no documents"):
        preprocess_files([str(tmp_path / "empty.jsonl")], str(tmp_path / "e"))
    assert not (tmp_path / "e_text_document.bin").exists()
    with pytest.raises(PreprocessError, match="no such file"):
        preprocess_files([str(tmp_path / "missing.jsonl")], str(tmp_path / "e"))
    (tmp_path / "k.jsonl").write_text('{"body": "x"}\n')
    assert main(["preprocess", "--input", str(tmp_path / "k.jsonl"), "--output-prefix", str(tmp_path / "k"),
                 "--no-progress"]) == 1


def test_merge_command_and_demo_corpus(tmp_path):
    from omnitron.core.data import demo_corpus_prefix

    prefix = demo_corpus_prefix(cache_dir=str(tmp_path))
    assert demo_corpus_prefix(cache_dir=str(tmp_path)) == prefix  # cached
    ds = IndexedDataset(prefix)
    tok = build_tokenizer()
    docs = moby_dick_documents()
    assert len(ds) == len(docs) > 800 and docs[0].startswith("CHAPTER 1. Loomings.")
    for i in (0, 400, len(docs) - 1):
        assert ds[i].tolist() == tok.encode(docs[i]) + [tok.eod]
    assert main(["preprocess", "--merge", prefix, prefix, "--output-prefix", str(tmp_path / "m")]) == 0
    merged = IndexedDataset(tmp_path / "m")
    assert len(merged) == 2 * len(ds) and merged[len(ds)].tolist() == ds[0].tolist()


def test_demo_corpus_follows_the_run_tokenizer(tmp_path):
    """The bundled corpus is cached per tokenizer: the Moby Dick BPE (and GPT-2 BPE from copied files) get their
    own ids, never GPT-2's cache; a tokenizer without a vocabulary is refused by name."""
    import shutil

    from omnitron.core.data import demo_corpus_prefix
    from omnitron.core.data.tokenizers.bpe import GPT2_MERGES, GPT2_VOCAB

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    moby = build_tokenizer("HuggingFaceTokenizer",
                           tokenizer_model=os.path.join(root, "omnitron", "data", "moby_dick_bpe", "tokenizer.json"))
    gpt2 = build_tokenizer()
    docs = moby_dick_documents()
    p_moby, p_gpt2 = (demo_corpus_prefix(t, cache_dir=str(tmp_path)) for t in (moby, gpt2))
    assert p_moby != p_gpt2 and moby.vocab_size == 4096
    ds = IndexedDataset(p_moby)
    for i in (0, 500, len(docs) - 1):
        assert ds[i].tolist() == moby.encode(docs[i]) + [moby.eod]
    assert max(int(ds[i].max()) for i in range(len(ds))) < 4096
    # GPT-2 BPE from other (here: identical, copied) files shares GPT-2's ids, so the same cache is correct;
    # the cache key is what the files say, not their names
    shutil.copy(GPT2_VOCAB, tmp_path / "vocab.json")
    shutil.copy(GPT2_MERGES, tmp_path / "merges.txt")
    copied = build_tokenizer(vocab_file=str(tmp_path / "vocab.json"), merge_file=str(tmp_path / "merges.txt"))
    assert demo_corpus_prefix(copied, cache_dir=str(tmp_path)) == p_gpt2
    vocab = json.load(open(GPT2_VOCAB))  # the same merges with two ids swapped: another vocabulary, another cache
    vocab["the"], vocab[","] = vocab[","], vocab["the"]
    json.dump(vocab, open(tmp_path / "vocab.json", "w"))
    swapped = build_tokenizer(vocab_file=str(tmp_path / "vocab.json"), merge_file=str(tmp_path / "merges.txt"))
    p_swapped = demo_corpus_prefix(swapped, cache_dir=str(tmp_path))
    assert p_swapped != p_gpt2 and IndexedDataset(p_swapped)[0].tolist() == swapped.encode(docs[0]) + [swapped.eod]
    with pytest.raises(ValueError, match="NullTokenizer has none"):
        demo_corpus_prefix(build_tokenizer("NullTokenizer", vocab_size=50), cache_dir=str(tmp_path))


def test_crlf_paragraphs_and_lone_surrogates(tmp_path):
    """Paragraph mode strips a CRLF file's line ends as line mode does (it left '\\r' at each paragraph's end);
    a lone surrogate escape in valid JSON ("\\ud800") is invalid UTF-8 by --invalid-utf8 (it crashed the
    tokenizer and left a half-written .bin): replaced by U+FFFD, or the document skipped and counted."""
    tok = build_tokenizer("GPT2BPETokenizer")
    (tmp_path / "c.txt").write_bytes(b"para one a\r\nline b\r\n\r\npara two\r\n\r\n\r\npara three\r\n")
    preprocess_files([str(tmp_path / "c.txt")], str(tmp_path / "c"), txt_mode="paragraph", append_eod=False)
    ds = IndexedDataset(str(tmp_path / "c_text_document"))
    assert [tok.decode(ds[i]) for i in range(len(ds))] == ["para one a\r\nline b", "para two", "para three"]
    (tmp_path / "s.jsonl").write_text('{"text": "fine"}\n{"text": "lone \\ud800 here"}\n', encoding="ascii")
    preprocess_files([str(tmp_path / "s.jsonl")], str(tmp_path / "s"), append_eod=False)
    ds = IndexedDataset(str(tmp_path / "s_text_document"))
    assert [tok.decode(ds[i]) for i in range(len(ds))] == ["fine", "lone \ufffd here"]
    s = preprocess_files([str(tmp_path / "s.jsonl")], str(tmp_path / "k"), invalid_utf8="skip")
    assert s.documents == 1 and s.skipped["invalid_utf8"] == 1


def test_a_split_the_data_cannot_fill_is_one_line(tmp_path, capsys):
    """`--split 98,2` over 6 documents leaves the validation split none: found when the ranks index the data, and
    reported as the DataError's one line with exit code 2 (it came inside a 29-line traceback)."""
    docs = "".join(json.dumps({"text": f"document {i} " * (20 + i)}) + "\n" for i in range(6))
    (tmp_path / "d.jsonl").write_text(docs)
    preprocess_files([str(tmp_path / "d.jsonl")], str(tmp_path / "d"))
    argv = ["train", "--model", "gpt2_tiny", "--num-layers", "1", "--seq-length", "16", "--micro-batch-size", "1",
            "--global-batch-size", "1", "--train-iters", "1", "--eval-interval", "1", "--eval-iters", "1",
            "--data-path", str(tmp_path / "d_text_document"), "--split", "98,2", "--num-workers", "0",
            "--data-cache-path", str(tmp_path / "cache"), "--log-dir", str(tmp_path / "log"), "--no-tensorboard"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "the valid split of --split 98,2 gets no documents" in err, err


def _random_texts(rng, n: int) -> list[str]:
    words = ["whale", "Ishmael", "sea", "the", "of", "naïve", "café", "鯨", "🐋", "—", "line\nbreak", "Mr.", "  "]
    return [" ".join(rng.choice(words) for _ in range(rng.choice([0, 1, 4, 30]))) for _ in range(n)]


@pytest.mark.parametrize("no_special", [False, True])
def test_hf_tokenizer_documents_are_megatrons(tmp_path, capsys, no_special):
    """A Llama-style tokenizer.json (its post-processor adds ``<s>``): each document's ids are what Megatron's
    HuggingFaceTokenizer writes, ``AutoTokenizer(text).input_ids`` (BOS first, empty texts too) then the eod,
    for each of two keys and 1 or 2 workers; ``--tokenizer-hf-no-include-special-tokens`` drops the BOS
    (``add_special_tokens=False``). Before the fix the BOS was always missing."""
    import random

    transformers = pytest.importorskip("transformers")
    from omnitron.testing.data import llama_style_tokenizer

    tok_dir = llama_style_tokenizer(tmp_path / "tok")
    ref = transformers.AutoTokenizer.from_pretrained(tok_dir)
    rng = random.Random()
    docs = [{"text": t, "title": s} for t, s in zip(_random_texts(rng, 40), _random_texts(rng, 40))]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    flag = ["--tokenizer-hf-no-include-special-tokens"] if no_special else []
    for w in (1, 2):
        rc = main(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / f"w{w}"),
                   "--json-keys", "text", "title", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                   tok_dir, "--append-eod", "--workers", str(w), "--no-progress", *flag])
        assert rc == 0, capsys.readouterr().err
        for key in ("text", "title"):
            want = [ref(d[key], add_special_tokens=not no_special).input_ids for d in docs]
            want = [ids + [ref.eos_token_id] if ids else [] for ids in want]  # Megatron: eod after a non-empty doc
            ds = IndexedDataset(str(tmp_path / f"w{w}_{key}_document"))
            got = [ds[i].tolist() for i in range(len(ds))]
            assert got == [ids for ids in want if ids]
            sizes = np.cumsum([0] + [1 if ids else 0 for ids in want])  # an empty document holds no sequence
            assert ds.document_indices.tolist() == sizes.tolist()


@pytest.mark.parametrize("partitions, workers", [(2, 1), (3, 2), (7, 1)])
def test_partitions_give_megatrons_round_robin_order(tmp_path, partitions, workers):
    """--partitions N: Megatron's preprocess_data.py deals the input lines round robin into N files and merges
    their outputs in partition order (checked against its output at d98e8a6 byte for byte, N = 2 and 3), so the
    documents come as 0, N, 2N, ..., 1, N + 1, ... (empty ones keep their place); --keep-sequential-samples
    keeps the input order. The reference is the plain run's documents in that order, written by hand."""
    rng = np.random.default_rng()
    docs = [d if rng.random() > 0.15 else "" for d in moby_dick_documents()[:int(rng.integers(20, 60))]]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": d, "t": d[:20]}) + "\n" for d in docs))
    common = ["preprocess", "--input", str(tmp_path / "in.jsonl"), "--json-keys", "text", "t", "--append-eod",
              "--no-progress", "--workers", str(workers)]
    assert main(common + ["--output-prefix", str(tmp_path / "plain")]) == 0
    assert main(common + ["--output-prefix", str(tmp_path / "rr"), "--partitions", str(partitions)]) == 0
    assert main(common + ["--output-prefix", str(tmp_path / "seq"), "--partitions", str(partitions),
                          "--keep-sequential-samples"]) == 0
    order = [i for p in range(partitions) for i in range(p, len(docs), partitions)]
    for key in ("text", "t"):
        plain = IndexedDataset(tmp_path / f"plain_{key}_document")
        rr = IndexedDataset(tmp_path / f"rr_{key}_document")
        assert rr.num_documents == plain.num_documents == len(docs)
        assert [rr.document(i).tolist() for i in range(len(docs))] == [plain.document(i).tolist() for i in order]
        for ext in ("bin", "idx"):
            assert (tmp_path / f"seq_{key}_document.{ext}").read_bytes() == \
                (tmp_path / f"plain_{key}_document.{ext}").read_bytes()
    outputs = [f"{r}_{k}_document.{e}" for r in ("plain", "rr", "seq") for k in ("text", "t") for e in ("bin", "idx")]
    assert sorted(os.listdir(tmp_path)) == sorted(["in.jsonl"] + outputs)  # no partition left behind


def test_megatrons_sentence_flags(tmp_path, capsys):
    """--keep-newlines is what the splitter always does (the sentences join back to the text, newlines
    included); --lang other than english is refused in one line (the splitter's rules are English)."""
    text = "First line.\nSecond one!  Third?\n\nA new paragraph."
    (tmp_path / "in.jsonl").write_text(json.dumps({"text": text}) + "\n")
    common = ["preprocess", "--input", str(tmp_path / "in.jsonl"), "--split-sentences", "--no-progress"]
    assert main(common + ["--output-prefix", str(tmp_path / "k"), "--keep-newlines", "--log-interval", "5"]) == 0
    ds = IndexedDataset(tmp_path / "k_text_sentence")
    tok = build_tokenizer()
    assert len(ds) == 4 and tok.decode(np.concatenate([ds[i] for i in range(len(ds))]).tolist()) == text
    capsys.readouterr()
    assert main(common + ["--output-prefix", str(tmp_path / "g"), "--lang", "german"]) == 1
    err = capsys.readouterr().err.strip()
    assert "--lang german" in err and "\n" not in err and not (tmp_path / "g_text_sentence.bin").exists()


def test_json_lines_are_json_whatever_the_file_is_called(tmp_path):
    """Megatron reads every --input as JSON lines: a JSON-lines corpus named .ndjson, .txt or without an extension
    gives the .jsonl output (it was tokenized as text, braces and keys included); a text file stays text."""
    rng = np.random.default_rng()
    docs = moby_dick_documents()[:int(rng.integers(5, 15))]
    body = "\n" + "".join(json.dumps({"text": d}) + "\n" for d in docs)  # a blank first line too
    for name in ("ref.jsonl", "c.ndjson", "c.txt", "train_00"):
        (tmp_path / name).write_text(body)
        assert main(["preprocess", "--input", str(tmp_path / name), "--output-prefix", str(tmp_path / name.replace(
            ".", "_")), "--no-progress"]) == 0
    ref = (tmp_path / "ref_jsonl_text_document.bin").read_bytes()
    tok = build_tokenizer()
    assert ref == np.concatenate([tok.encode(d) for d in docs]).astype(np.uint16).tobytes()
    for out in ("c_ndjson", "c_txt", "train_00"):
        assert (tmp_path / f"{out}_text_document.bin").read_bytes() == ref, out
    (tmp_path / "plain.txt").write_text("{ not json } but text\nsecond line\n")
    assert main(["preprocess", "--input", str(tmp_path / "plain.txt"), "--output-prefix", str(tmp_path / "plain"),
                 "--no-progress"]) == 0
    assert IndexedDataset(tmp_path / "plain_text_document")[0].tolist() == tok.encode("{ not json } but text")


def test_a_list_of_sentences_is_one_document_of_those_sentences(tmp_path):
    """Megatron's encoder takes a JSON list as the document's sentences (the format its --split-sentences step
    writes): each non-empty one a sequence, the eod on the last, the document kept when all are empty (checked
    byte for byte against Megatron's preprocess_data.py at d98e8a6). They were skipped as records without the key."""
    rng = np.random.default_rng()
    words = ["whale", "sea", "naïve", "鯨", "🐋", ",", "."]
    docs = [[" ".join(rng.choice(words, int(rng.integers(0, 6)))) for _ in range(int(rng.integers(0, 5)))]
            for _ in range(int(rng.integers(10, 30)))] + [[], [""], "a plain string"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    assert main(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "o"),
                 "--append-eod", "--no-progress"]) == 0
    ds = IndexedDataset(tmp_path / "o_text_document")
    tok = build_tokenizer()
    assert ds.num_documents == len(docs)
    for d, doc in enumerate(docs):
        want = [tok.encode(s) for s in ([doc] if isinstance(doc, str) else doc)]
        want = [w for w in want if w]
        if want:
            want[-1] = want[-1] + [tok.eod]
        lo, hi = ds.document_indices[d], ds.document_indices[d + 1]
        assert [ds[i].tolist() for i in range(lo, hi)] == want, d
