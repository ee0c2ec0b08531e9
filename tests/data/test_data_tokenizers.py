"""Tokenizers against independent references: OpenAI's original GPT-2 BPE algorithm, trained models."""
from __future__ import annotations

import json
import shutil
from functools import lru_cache

import pytest

from omnitron.core.data.tokenizers import (GPT2_MERGES, GPT2_VOCAB, TokenizerError, bpe, build_tokenizer)


def _reference_gpt2_encoder():
    """OpenAI's gpt-2 ``encoder.py`` algorithm, re-typed: byte->unicode map, regex split, greedy merges."""
    regex = pytest.importorskip("regex")
    vocab = json.loads(GPT2_VOCAB.read_text(encoding="utf-8"))
    merges = [tuple(m.split()) for m in GPT2_MERGES.read_text(encoding="utf-8").split("\n")[1:] if m]
    ranks = {m: i for i, m in enumerate(merges)}
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_enc = dict(zip(bs, map(chr, cs)))
    pat = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    @lru_cache(maxsize=None)
    def bpe_word(token):
        word = tuple(token)
        while len(word) > 1:
            pairs = {(word[i], word[i + 1]) for i in range(len(word) - 1)}
            best = min(pairs, key=lambda p: ranks.get(p, float("inf")))
            if best not in ranks:
                break
            out, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            word = tuple(out)
        return word

    def encode(text):
        ids = []
        for tok in regex.findall(pat, text):
            ids += [vocab[p] for p in bpe_word("".join(byte_enc[b] for b in tok.encode("utf-8")))]
        return ids

    return encode


def test_gpt2_bundled_known_ids_and_reference():
    tok = build_tokenizer("GPT2BPETokenizer")
    assert tok.encode("Hello world") == [15496, 995]
    assert (tok.vocab_size, tok.eod, tok.pad) == (50257, 50256, 50256)
    ref = _reference_gpt2_encoder()
    from omnitron.core.data.corpus import moby_dick_documents
    import random

    rng = random.Random(7)
    docs = moby_dick_documents()
    texts = [rng.choice(docs)[:1500] for _ in range(6)]
    texts += ["naïve café — 東京 🐳  tabs\tand\n\nnewlines   ", "I'll've 3.14159 <|endoftext|> x"]
    texts.append("".join(chr(rng.randrange(32, 0x3000)) for _ in range(300)))
    for text in texts:
        ids = tok.encode(text)
        assert ids == ref(text)
        assert tok.decode(ids) == text
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_gpt2_sha256_mismatch_is_reported(tmp_path, monkeypatch):
    bad = tmp_path / "vocab.json"
    shutil.copy(GPT2_VOCAB, bad)
    with open(bad, "ab") as f:
        f.write(b" ")
    monkeypatch.setattr(bpe, "GPT2_VOCAB", bad)
    with pytest.raises(TokenizerError, match="sha256"):
        build_tokenizer("GPT2BPETokenizer")
    # explicit files are the user's choice: loaded without the bundled checksum
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=str(bad), merge_file=str(GPT2_MERGES))
    assert tok.encode("Hello world") == [15496, 995]


def test_tokenizer_argument_errors(tmp_path):
    with pytest.raises(TokenizerError, match="both --vocab-file and --merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(GPT2_VOCAB))
    with pytest.raises(TokenizerError, match="no such file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "x.json"), merge_file=str(GPT2_MERGES))
    with pytest.raises(TokenizerError, match="unknown --tokenizer-type"):
        build_tokenizer("BertWordPiece")
    with pytest.raises(TokenizerError, match="--tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer")
    with pytest.raises(TokenizerError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a valid tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert (tok.vocab_size, tok.eod) == (101, 100)
    assert tok.encode("3 1 4 100") == [3, 1, 4, 100]
    assert tok.decode([3, 1, 4]) == "3 1 4"
    with pytest.raises(TokenizerError, match="outside"):
        tok.encode("5 101")


def test_trained_hf_tokenizer_roundtrip(tmp_path):
    from omnitron.commands.tokenizer import train_bpe
    from omnitron.core.data.corpus import moby_dick_documents

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(moby_dick_documents()[:60]), encoding="utf-8")
    train_bpe([str(corpus)], 600, str(tmp_path / "tok" / "tokenizer.json"))
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tok"))
    assert tok.vocab_size == 600 and tok.eod == 0 and tok.pad == 1
    text = "Call me Ishmael. Some years ago — ünïcödé"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and max(ids) < 600
    # merges must compress relative to raw bytes
    assert len(tok.encode(corpus.read_text()[:5000])) < 0.6 * len(corpus.read_text()[:5000].encode())



@pytest.mark.parametrize("name,content", [("empty.txt", ""), ("blank.txt", "\n  \n\t\n"),
                                          ("other_key.jsonl", '{"body": "Call me Ishmael."}\n')])
def test_tokenizer_train_on_a_corpus_without_text_says_so(tmp_path, capsys, name, content):
    """``omnitron tokenizer train`` on a file with no text (empty, blank, or JSON lines without the --json-key
    field) stops in one line naming the input; it wrote a 258-token vocabulary and said nothing before."""
    from omnitron.cli import main

    corpus = tmp_path / name
    corpus.write_text(content, encoding="utf-8")
    out = tmp_path / "tok" / "tokenizer.json"
    assert main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "8000", "--output", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "holds no text" in err and str(corpus) in err, err
    assert ("--json-key" in err) == name.endswith(".jsonl") and not out.exists()


def test_tokenizer_train_says_when_the_corpus_gives_fewer_tokens(tmp_path, capsys):
    """A corpus too small for the --vocab-size asked for: the file is written with the vocabulary it allows, and one
    note line says how many tokens that is."""
    from omnitron.cli import main

    corpus = tmp_path / "small.txt"
    corpus.write_text("Call me Ishmael. Some years ago, never mind how long precisely.\n" * 3, encoding="utf-8")
    out = tmp_path / "tok" / "tokenizer.json"
    assert main(["tokenizer", "train", "--input", str(corpus), "--vocab-size", "8000", "--output", str(out)]) == 0
    size = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(out.parent)).vocab_size
    assert 258 < size < 8000
    assert f"the corpus allowed {size} tokens of the --vocab-size 8000" in capsys.readouterr().err

def test_hf_tokenizer_by_hub_name_from_the_local_cache(tmp_path, monkeypatch):
    """As Megatron's ``AutoTokenizer.from_pretrained(NAME)``: a hub name resolves in the local HF cache (nothing is
    downloaded), and the eod is the ``eos_token`` its tokenizer_config.json names (Megatron's eos_token_id)."""
    import json

    import huggingface_hub.constants as hub

    from omnitron.commands.tokenizer import SPECIAL_TOKENS, train_bpe
    from omnitron.core.data.corpus import moby_dick_documents

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(moby_dick_documents()[:20]), encoding="utf-8")
    snap = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc123"
    train_bpe([str(corpus)], 400, str(snap / "tokenizer.json"))
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    named = build_tokenizer("HuggingFaceTokenizer", tokenizer_model="org/tiny")
    direct = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(snap))
    assert named.encode("Call me Ishmael.") == direct.encode("Call me Ishmael.") and named.eod == direct.eod == 0
    eos = SPECIAL_TOKENS[1]
    (snap / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": eos}}))
    assert build_tokenizer("HuggingFaceTokenizer", tokenizer_model="org/tiny").eod == 1
    with pytest.raises(TokenizerError, match="no tokenizer.json of that hub name in the local Hugging Face cache"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model="org/absent")


def test_sentencepiece_tokenizer(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    from omnitron.core.data.corpus import moby_dick_documents

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(moby_dick_documents()[:40]), encoding="utf-8")
    spm.SentencePieceTrainer.Train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=300,
                                   model_type="bpe", pad_id=3, minloglevel=2)
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "sp.model"))
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    text = "Call me Ishmael, said the whale."
    assert tok.encode(text) == sp.encode(text)
    assert tok.decode(tok.encode(text)) == text
    assert (tok.vocab_size, tok.eod, tok.pad) == (300, sp.eos_id(), 3)
    for megatron_name in ("Llama2Tokenizer", "GPTSentencePieceTokenizer"):  # Megatron's other names of it
        same = build_tokenizer(megatron_name, tokenizer_model=str(tmp_path / "sp.model"))
        assert (same.encode(text), same.eod) == (sp.encode(text), sp.eos_id())
