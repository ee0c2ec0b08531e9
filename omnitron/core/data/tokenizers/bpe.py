"""Tokenizers backed by the ``tokenizers`` library: GPT-2 BPE files and HuggingFace ``tokenizer.json``.

Everything loads from local files: nothing is fetched from a model hub. The GPT-2 vocabulary
and merges bundled in ``omnitron/data/gpt2/`` are checked against their sha256 on every load,
so a corrupted or substituted file fails here and not as a silently different token stream.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .base import Tokenizer, TokenizerError

GPT2_DIR = Path(__file__).resolve().parents[3] / "data" / "gpt2"
GPT2_VOCAB = GPT2_DIR / "vocab.json"
GPT2_MERGES = GPT2_DIR / "merges.txt"
# sha256 of GPT-2's vocab.json (encoder.json) and merges.txt (vocab.bpe); see omnitron/data/gpt2/LICENSE.
GPT2_SHA256 = {
    "vocab": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "merges": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
GPT2_EOD_TOKEN = "<|endoftext|>"
# Tokens taken as end-of-document / padding in a HuggingFace tokenizer.json, first match wins.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
PAD_CANDIDATES = ("<pad>", "<|padding|>", "[PAD]", "<|pad|>")


def sha256_of(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _require_file(path: str | os.PathLike, flag: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise TokenizerError(f"{flag} {str(p)!r}: no such file; pass the path of an existing file")
    return p


class _HFBacked(Tokenizer):
    """Shared encode/decode over a ``tokenizers.Tokenizer``."""

    add_special = False
    """Whether ``encode`` adds the tokenizer's own special tokens (its post-processor's BOS / EOS)."""
    _own_pad: int | None = None  # GPT-2's vocabulary has no pad (Megatron's GPT2BPETokenizer reports None)

    def __init__(self, tok, eod: int, pad: int):
        self._tok = tok
        self._eod = eod
        self._pad = pad
        self._vocab_size = tok.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    @property
    def own_pad(self) -> int | None:
        return self._own_pad

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=self.add_special).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=self.add_special)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def fingerprint(self) -> str:
        mark = "\nwith special tokens" if self.add_special else ""  # the ids differ where a post-processor adds some
        return hashlib.sha256((self._tok.to_str() + mark).encode("utf-8")).hexdigest()


class GPT2BPETokenizer(_HFBacked):
    """GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt`` (Megatron's ``GPT2BPETokenizer``).

    Defaults to the bundled, sha256-verified files. ``<|endoftext|>`` (id 50256) is the eod and
    pad id; as in OpenAI's GPT-2 encoder and Megatron's tokenizer before 2025 it is NOT recognised inside raw text
    (text that spells it out is encoded as ordinary characters), so documents cannot inject document boundaries.
    NOTE: Megatron at d98e8a6 builds this tokenizer with ``transformers``, which does read the literal text as id
    50256: the one difference of ``omnitron preprocess`` output from Megatron's (compared byte for byte otherwise).
    """

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str | None = None, merge_file: str | None = None):
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

        bundled = vocab_file is None and merge_file is None
        vocab = _require_file(vocab_file or GPT2_VOCAB, "--vocab-file")
        merges = _require_file(merge_file or GPT2_MERGES, "--merge-file")
        if bundled:
            for kind, path in (("vocab", vocab), ("merges", merges)):
                got = sha256_of(path)
                if got != GPT2_SHA256[kind]:
                    raise TokenizerError(
                        f"bundled GPT-2 {kind} file {path} has sha256 {got}, expected {GPT2_SHA256[kind]}: "
                        "the file is corrupted or was replaced; restore it from git "
                        "(git checkout -- omnitron/data/gpt2) or pass --vocab-file/--merge-file explicitly")
        try:
            bpe = models.BPE.from_file(str(vocab), str(merges))
        except Exception as err:  # noqa: BLE001 - the library's message names the parse problem
            raise TokenizerError(f"cannot read GPT-2 BPE files {vocab} / {merges}: {err}") from err
        tok = HFTokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        eod = tok.token_to_id(GPT2_EOD_TOKEN)
        if eod is None:
            raise TokenizerError(f"vocabulary {vocab} has no {GPT2_EOD_TOKEN!r} token; it is not a GPT-2 vocab.json")
        super().__init__(tok, eod, eod)


class HuggingFaceTokenizer(_HFBacked):
    """Any ``tokenizer.json`` (for example one written by ``omnitron tokenizer train``).

    ``path`` is the file, a directory holding it, or (as Megatron's ``AutoTokenizer.from_pretrained``) a hub
    name such as ``meta-llama/Meta-Llama-3-8B`` already in the local Hugging Face cache (nothing is downloaded).
    The eod id is the ``eos_token`` the files beside it name (:func:`hf_special_token`: tokenizer_config.json or
    special_tokens_map.json, else the ``tokenizer_class``'s default, what Megatron's HF tokenizer uses), else their
    ``sep_token`` (Megatron's HuggingFaceTokenizer makes a tokenizer's sep its eos where it has no eos: a BERT
    tokenizer's ``[SEP]``), else the first of ``EOD_CANDIDATES`` present in the vocabulary (where Megatron has no
    eod at all; ``eod_token`` overrides); pad likewise. ``own_pad`` is the ``pad_token`` those files name (None
    without one), as ``AutoTokenizer``'s ``pad_token_id``; one missing from the vocabulary is refused.

    ``encode`` adds the tokenizer's own special tokens (``include_special_tokens``, on by default) as Megatron's
    HuggingFaceTokenizer does (``tokenizer(text).input_ids`` unless ``--tokenizer-hf-no-include-special-tokens``)
    and as ``transformers`` does: a Llama tokenizer's post-processor puts its BOS before every document and
    prompt; GPT-2- and Qwen-style tokenizer.json files have no such post-processor and add nothing.
    """

    name = "HuggingFaceTokenizer"
    _sep_is_eod = True
    """Megatron's HuggingFaceTokenizer sets eos = sep where the files name a sep and no eos; its MultimodalTokenizer
    reads AutoTokenizer's eos alone."""

    def __init__(self, path: str, eod_token: str | None = None, include_special_tokens: bool = True):
        from tokenizers import Tokenizer as HFTokenizer

        p = hf_tokenizer_file(path)
        try:
            tok = HFTokenizer.from_file(str(p))
        except Exception as err:  # noqa: BLE001
            raise TokenizerError(f"--tokenizer-model {str(p)!r} is not a valid tokenizer.json: {err}") from err
        eod_token = eod_token or hf_special_token(p.parent, "eos_token") or (
            hf_special_token(p.parent, "sep_token") if self._sep_is_eod else None)
        own_pad = hf_special_token(p.parent, "pad_token")
        self._own_pad = None if own_pad is None else tok.token_to_id(own_pad)
        if own_pad is not None and self._own_pad is None:
            raise TokenizerError(f"{p.parent}: pad_token {own_pad!r} is not in {p.name}; AutoTokenizer (Megatron's "
                                 "HuggingFaceTokenizer) would append it as a new id and grow the vocabulary; add it to "
                                 "the tokenizer (tokenizer.add_special_tokens) and save it again")
        names = (eod_token,) if eod_token else EOD_CANDIDATES
        eod = next((tok.token_to_id(t) for t in names if tok.token_to_id(t) is not None), None)
        if eod is None:
            raise TokenizerError(f"tokenizer {p} has none of the end-of-document tokens {list(names)}; "
                                 "retrain it with one of them as a special token")
        pad = next((tok.token_to_id(t) for t in PAD_CANDIDATES if tok.token_to_id(t) is not None), eod)
        super().__init__(tok, eod, pad)
        self.add_special = include_special_tokens


def hf_tokenizer_file(path: str) -> Path:
    """``tokenizer.json`` of ``path``: the file, in the directory, or in the local HF cache for a hub name."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    elif not p.exists() and path.count("/") == 1 and not path.startswith((".", "/")):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(path, "tokenizer.json")
        if not isinstance(cached, str):
            raise TokenizerError(f"--tokenizer-model {path!r}: no such file or directory, and no tokenizer.json of "
                                 "that hub name in the local Hugging Face cache; download it first (huggingface-cli "
                                 "download NAME) or pass its directory")
        p = Path(cached)
    return _require_file(p, "--tokenizer-model")


def hf_special_token(folder: Path, key: str) -> str | None:
    """The token ``transformers.AutoTokenizer`` gives the role ``key`` (``pad_token``, ``eos_token``, ...) from the
    files of a tokenizer folder, as Megatron's HuggingFaceTokenizer reads it: ``special_tokens_map.json``'s, over the
    config's, when ``tokenizer_config.json`` has no ``added_tokens_decoder`` (transformers reads that legacy file
    only then), else ``tokenizer_config.json``'s; where neither names the role (a ``null`` does name it: none), the
    default of the config's ``tokenizer_class`` (:data:`CLASS_DEFAULTS`: ``BertTokenizer``'s ``[PAD]``). A token of
    tokenizer.json's ``added_tokens`` has no role by itself."""
    config = _read_json(folder / "tokenizer_config.json")
    legacy = {} if "added_tokens_decoder" in config else _read_json(folder / "special_tokens_map.json")
    if key in legacy:
        token = legacy[key]
    elif key in config:
        token = config[key]
    else:
        token = class_default(config.get("tokenizer_class"), key)
    return token.get("content") if isinstance(token, dict) else token


_BERT = {"sep_token": "[SEP]", "pad_token": "[PAD]"}
_ROBERTA = {"bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>", "pad_token": "<pad>"}
_LLAMA = {"bos_token": "<s>", "eos_token": "</s>"}
_DEBERTA = {"bos_token": "[CLS]", "eos_token": "[SEP]", "sep_token": "[SEP]", "pad_token": "[PAD]"}
CLASS_DEFAULTS = {
    "BertTokenizer": _BERT, "ElectraTokenizer": _BERT, "RobertaTokenizer": _ROBERTA, "XLMRobertaTokenizer": _ROBERTA,
    "BartTokenizer": _ROBERTA, "MPNetTokenizer": _ROBERTA, "LlamaTokenizer": _LLAMA, "CodeLlamaTokenizer": _LLAMA,
    "GPT2Tokenizer": {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
    "GPTNeoXTokenizer": {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|padding|>"},
    "T5Tokenizer": {"eos_token": "</s>", "pad_token": "<pad>"},
    "Qwen2Tokenizer": {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    "GemmaTokenizer": {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
    "AlbertTokenizer": {**_DEBERTA, "pad_token": "<pad>"}, "DebertaV2Tokenizer": _DEBERTA,
    "XLNetTokenizer": {**_ROBERTA, "sep_token": "<sep>"},
}
"""The bos / eos / sep / pad defaults of a ``tokenizer_class``'s ``__init__`` (transformers 5.x; the ``...Fast``
name's the same), which AutoTokenizer gives a role the files do not name. Transcribed so that the eod and pad do not
depend on whether transformers is installed; a class not listed (``PreTrainedTokenizerFast``: it has none) gets none."""


def class_default(tokenizer_class: str | None, key: str) -> str | None:
    """The token ``tokenizer_class``'s constructor gives the role ``key`` by default (None: none, or a class not in
    :data:`CLASS_DEFAULTS`)."""
    return CLASS_DEFAULTS.get((tokenizer_class or "").removesuffix("Fast"), {}).get(key)


def _read_json(path: Path) -> dict:
    """A JSON object file's contents ({} when there is no such file)."""
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_vocab_size(vocab_file: str) -> int:
    """Entries in a GPT-2 style ``vocab.json`` (used by tools that only need the size)."""
    with open(vocab_file, encoding="utf-8") as f:
        return len(json.load(f))
