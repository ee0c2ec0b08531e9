"""The eod and pad of omnitron's HuggingFaceTokenizer are Megatron's (megatron/core/tokenizers/text/libraries/
huggingface_tokenizer.py at d98e8a6): AutoTokenizer's roles, read from tokenizer_config.json /
special_tokens_map.json or, where those name none, the ``tokenizer_class``'s own defaults; the eod is the eos, or
the sep where there is no eos (Megatron's lines 129-137 set ``eos_token = sep_token`` then). The reference is
AutoTokenizer with that rule; with ``MEGATRON_LM`` set to a Megatron-LM checkout, Megatron's own tokenizer too."""
from __future__ import annotations

import inspect
import json
import os
import random
import sys

import pytest

from omnitron.core.data import build_tokenizer
from omnitron.core.data.tokenizers.bpe import CLASS_DEFAULTS, EOD_CANDIDATES

transformers = pytest.importorskip("transformers")

ROLES = ("bos_token", "eos_token", "sep_token", "pad_token")
VOCAB = ["[UNK]", "[PAD]", "[SEP]", "[CLS]", "[MASK]", "<s>", "</s>", "<pad>", "<unk>", "<mask>", "<|endoftext|>",
         "<|padding|>", "<bos>", "<eos>", "<sep>", "a", "b", "c"]  # every default the classes below name
LAYOUTS = {  # tokenizer_config.json, special_tokens_map.json (None: no such file)
    "sep_in_config": ({"sep_token": "[SEP]"}, None),
    "sep_in_map": ({}, {"sep_token": {"content": "[SEP]", "normalized": False}}),
    "eos_over_sep": ({"sep_token": "[SEP]", "eos_token": "</s>"}, None),
    "bert_class": ({"tokenizer_class": "BertTokenizer"}, None),
    "bert_fast_class_no_pad": ({"tokenizer_class": "BertTokenizerFast", "pad_token": None}, None),
    "bert_class_eos_in_map": ({"tokenizer_class": "BertTokenizer"}, {"eos_token": "</s>"}),
    "roberta_class": ({"tokenizer_class": "RobertaTokenizer"}, None),
    "gpt2_class": ({"tokenizer_class": "GPT2TokenizerFast"}, None),
    "gptneox_class": ({"tokenizer_class": "GPTNeoXTokenizer"}, None),
    "qwen2_class": ({"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|endoftext|>"}, None),
    "gemma_class": ({"tokenizer_class": "GemmaTokenizer"}, None),
    "llama_class_pad_in_config": ({"tokenizer_class": "LlamaTokenizer", "pad_token": "<pad>"}, None),
    "class_without_defaults": ({"tokenizer_class": "PreTrainedTokenizerFast", "sep_token": "<sep>"}, None),
}


def _folder(path, config, legacy, rng):
    """A tokenizer folder: a word-level tokenizer.json over :data:`VOCAB` in a fresh random order (so no id is
    where a rule might guess it), and the two JSON files."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir()
    words = rng.sample(VOCAB, len(VOCAB))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    for name, content in (("tokenizer_config.json", config), ("special_tokens_map.json", legacy)):
        if content is not None:
            (path / name).write_text(json.dumps(content))
    return str(path)


def _megatron_ids(path: str) -> tuple[int | None, int | None] | None:
    """(eod, pad) of Megatron's own HuggingFaceTokenizer, or None without ``MEGATRON_LM``."""
    root = os.environ.get("MEGATRON_LM")
    if not root:
        return None
    sys.path.insert(0, root)
    from megatron.core.tokenizers.text.libraries.huggingface_tokenizer import HuggingFaceTokenizer

    tok = HuggingFaceTokenizer(path)
    return tok.eod, tok.pad_id


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_hf_eod_and_pad_are_megatrons(tmp_path, layout):
    """eod: AutoTokenizer's eos id, else its sep id (Megatron's rule); pad (``own_pad``): its pad_token_id. Failed
    before: a folder naming a sep and no eos got the first known end-of-document token in the vocabulary (``</s>``
    ahead of ``[SEP]``), and a ``tokenizer_class``'s defaults (BertTokenizer's ``[PAD]`` / ``[SEP]``) were not read."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    path = _folder(tmp_path / "hf", *LAYOUTS[layout], rng)
    ref = transformers.AutoTokenizer.from_pretrained(path)
    assert len(ref) == len(VOCAB)  # nothing appended: the ids are tokenizer.json's
    eod = ref.eos_token_id if ref.eos_token is not None else ref.sep_token_id
    assert eod is not None
    got = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=path)
    assert (got.eod, got.own_pad) == (eod, ref.pad_token_id)
    megatron = _megatron_ids(path)
    assert megatron is None or megatron == (eod, ref.pad_token_id)


@pytest.mark.parametrize("name", sorted(CLASS_DEFAULTS))
def test_class_defaults_are_transformers(name):
    """Each transcribed default is the class's constructor default in transformers (also the ``...Fast`` name's,
    which AutoTokenizer picks first), the source AutoTokenizer takes it from where the files name no such role."""
    for cls_name in (name, name + "Fast"):
        cls = getattr(transformers, cls_name, None)
        if cls is None:
            assert cls_name != name, f"transformers has no {name}"
            continue
        params = inspect.signature(cls.__init__).parameters
        want = {k: params[k].default for k in ROLES if k in params and params[k].default is not None}
        assert CLASS_DEFAULTS[name] == want, cls_name


def test_multimodal_eod_stays_the_eos(tmp_path):
    """Megatron's MultimodalTokenizer's eod is AutoTokenizer's eos_token_id with no sep fallback: a folder naming only
    a sep keeps omnitron's known-token fallback there (the first of ``EOD_CANDIDATES`` in the vocabulary), not the
    sep."""
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    path = _folder(tmp_path / "hf", {"sep_token": "[SEP]"}, None, rng)
    got = build_tokenizer("MultimodalTokenizer", tokenizer_model=path, tokenizer_prompt_format="chatml")
    ref = transformers.AutoTokenizer.from_pretrained(path)
    assert ref.eos_token is None
    assert got.eod == ref.convert_tokens_to_ids(next(t for t in EOD_CANDIDATES if t in VOCAB)) != ref.sep_token_id
