"""The run's tokenizer written beside an HF export, so the folder is a usable model repository.

``AutoTokenizer.from_pretrained(out)`` needs the tokenizer's files and a ``tokenizer_config.json`` naming
its class, and ``generate`` stops only at an ``eos_token_id`` that ``config.json`` /
``generation_config.json`` declare. :func:`write_tokenizer` writes them for the tokenizer types that have
an HF equivalent (GPT-2 BPE: ``vocab.json`` + ``merges.txt``; a Hugging Face ``tokenizer.json``; SentencePiece:
``tokenizer.model`` as Llama's tokenizer; BERT WordPiece: ``vocab.txt``; NullTokenizer: a word-level
``tokenizer.json`` of the ids written as text, ``<eod>`` last; TikTokenizer: the same ranks as a byte-level BPE
``tokenizer.json``; MultimodalTokenizer: its ``tokenizer.json`` with the added image tokens) and returns the
end-of-document id. A checkpoint that records no tokenizer is refused (:class:`ExportTokenizerError`) rather than
exported as a repository whose ``AutoTokenizer`` would build an empty tokenizer.
"""
from __future__ import annotations

import json
import os
import shutil


class ExportTokenizerError(ValueError):
    """The export would have no tokenizer, or one that does not fit the model."""


def write_tokenizer(run: dict, out_dir: str) -> int | None:
    """Tokenizer files of ``run`` (a checkpoint's flat config) into ``out_dir``; the eod id or None."""
    from omnitron.core.data.tokenizers import GPT2_MERGES, GPT2_VOCAB, SENTENCEPIECE_TYPES, build_tokenizer

    kind = run.get("tokenizer_type")
    if kind == "GPT2BPETokenizer":
        vocab, merges = run.get("vocab_file") or GPT2_VOCAB, run.get("merge_file") or GPT2_MERGES
        tok = build_tokenizer(kind, vocab_file=run.get("vocab_file"), merge_file=run.get("merge_file"))
        shutil.copyfile(vocab, os.path.join(out_dir, "vocab.json"))
        shutil.copyfile(merges, os.path.join(out_dir, "merges.txt"))
        with open(vocab, encoding="utf-8") as f:
            eod_text = {i: t for t, i in json.load(f).items()}[tok.eod]
        _config(out_dir, "GPT2Tokenizer", eod_text)
        return tok.eod
    model = run.get("tokenizer_model")
    if kind == "HuggingFaceTokenizer" and model:  # a file, a directory holding it, or a cached hub name
        from omnitron.core.data.tokenizers.bpe import hf_tokenizer_file

        model = str(hf_tokenizer_file(model))
        tok = build_tokenizer(kind, tokenizer_model=model)
        shutil.copyfile(model, os.path.join(out_dir, "tokenizer.json"))
        from tokenizers import Tokenizer

        _config(out_dir, "PreTrainedTokenizerFast", Tokenizer.from_file(model).id_to_token(tok.eod))
        return tok.eod
    if kind in SENTENCEPIECE_TYPES and model and os.path.isfile(model):
        return _sentencepiece(model, out_dir)
    if kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        return _wordpiece(run, kind, out_dir)
    if kind == "NullTokenizer" and run.get("vocab_size"):
        return _null(int(run["vocab_size"]), out_dir)
    if kind in ("TikTokenizer", "MultimodalTokenizer"):
        from omnitron.core.data.tokenizers import tokenizer_kwargs

        tok = build_tokenizer(**tokenizer_kwargs(run))
        hf = tiktoken_to_hf(tok) if kind == "TikTokenizer" else tok._tok
        hf.save(os.path.join(out_dir, "tokenizer.json"))
        _config(out_dir, "PreTrainedTokenizerFast", hf.id_to_token(tok.eod), pad_token=hf.id_to_token(tok.pad))
        return tok.eod
    return None


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (what byte-level ``tokenizer.json`` files spell)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    out, extra = {b: chr(b) for b in kept}, 0
    for b in range(256):
        if b not in out:
            out[b], extra = chr(256 + extra), extra + 1
    return out


def tiktoken_to_hf(tok):
    """A TikTokenizer as a byte-level BPE ``tokenizers.Tokenizer`` with the same ids: each multi-byte token's
    merges are its splits into two known tokens, ranked by the token's own rank (tiktoken merges the pair whose
    join ranks lowest), and a pre-token that is itself a token is taken whole (``ignore_merges``, as tiktoken)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    from omnitron.core.data.tokenizers.tik import PATTERNS

    ranks, enc = tok.ranks, byte_to_unicode()
    text = {token: "".join(enc[b] for b in token) for token in ranks}
    merges = []
    for token, _ in sorted(ranks.items(), key=lambda kv: kv[1]):
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges += [(text[a], text[b]) for a, b in sorted(pairs, key=lambda p: (ranks[p[0]], ranks[p[1]]))]
    vocab = {**{t: i for i, t in enumerate(tok.special_tokens)}, **{text[t]: r for t, r in ranks.items()}}
    hf = Tokenizer(models.BPE(vocab, merges, ignore_merges=True))
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PATTERNS[tok.pattern_name]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(tok.special_tokens)  # in the vocabulary at ids 0..num_special-1, so they keep those ids
    return hf


def _null(v: int, out_dir: str) -> int:
    """Megatron's NullTokenizer (text = space-separated ids ``0..V-1``, eod = ``V``) as a word-level
    ``tokenizer.json``: AutoTokenizer encodes ``"3 1 4"`` to ``[3, 1, 4]`` and decodes it back."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {str(i): i for i in range(v)}
    vocab["<eod>"] = v
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eod>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<eod>"])
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    _config(out_dir, "PreTrainedTokenizerFast", "<eod>")
    return v


def _sentencepiece(model: str, out_dir: str) -> int:
    """A SentencePiece model as Llama's tokenizer (``tokenizer.model``), adding no BOS/EOS of its own: omnitron's
    SentencePieceTokenizer encodes the text alone."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=model)
    shutil.copyfile(model, os.path.join(out_dir, "tokenizer.model"))
    piece = {name: sp.id_to_piece(i) for name, i in (("bos", sp.bos_id()), ("eos", sp.eos_id()), ("unk", sp.unk_id()))
             if i >= 0}
    extra = {"add_bos_token": False, "add_eos_token": False, "legacy": True, "unk_token": piece.get("unk"),
             "bos_token": piece.get("bos", piece["eos"])}
    _config(out_dir, "LlamaTokenizer", piece["eos"], **extra)
    return sp.eos_id()


def _wordpiece(run: dict, kind: str, out_dir: str) -> int:
    """A BERT WordPiece vocabulary (``vocab.txt``) as BERT's tokenizer; end of document is ``[SEP]``."""
    from omnitron.core.data.tokenizers import build_tokenizer

    tok = build_tokenizer(kind, vocab_file=run.get("vocab_file"), vocab_extra_ids=int(run.get("vocab_extra_ids") or 0))
    shutil.copyfile(tok.vocab_file, os.path.join(out_dir, "vocab.txt"))
    sentinels = [f"<extra_id_{i}>" for i in range(len(tok.sentinels))]
    _config(out_dir, "BertTokenizer", "[SEP]", do_lower_case=kind == "BertWordPieceLowerCase", unk_token="[UNK]",
            bos_token="[CLS]", cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]",
            additional_special_tokens=sentinels)
    return tok.eod


def _config(out_dir: str, cls: str, eod_text: str, **extra) -> None:
    cfg = {"tokenizer_class": cls, "bos_token": eod_text, "eos_token": eod_text, "unk_token": eod_text}
    cfg.update({k: v for k, v in extra.items() if v is not None})
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def write_generation_config(out_dir: str, eod: int) -> None:
    """``generation_config.json``: HF ``generate`` stops at the end-of-document token."""
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": eod, "eos_token_id": eod, "_from_model_config": True}, f, indent=2)


def make_readable(out_dir: str) -> None:
    """Mode 0644 for every file (safetensors and ``mkstemp`` leave 0600), as a published repository has."""
    for name in os.listdir(out_dir):
        path = os.path.join(out_dir, name)
        if os.path.isfile(path):
            os.chmod(path, 0o644)
