"""Megatron's pad rule in GPT samples: fixtures.json was written by Megatron's own GPTDataset
(tests/data/megatron_pad/make_fixtures.py, which says how to re-run it) over a corpus holding the pad and eod ids
many times; omnitron's samples over the same corpus must be identical. Each tokenizer's own pad is checked
against the library Megatron's tokenizer of that kind reads it from (transformers, sentencepiece) or its
transcribed special-token list (TikTokenizer)."""
from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

from omnitron.core.data import DataConfig, IndexedDatasetBuilder, build_gpt_datasets, build_tokenizer
from omnitron.core.data.config import tokenizer_from_config
from omnitron.core.data.tokenizers import TokenizerError

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_pad")
FIXTURES = json.load(open(os.path.join(HERE, "fixtures.json")))
_spec = importlib.util.spec_from_file_location("make_pad_fixtures", os.path.join(HERE, "make_fixtures.py"))
make_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_fixtures)  # corpus_documents: the corpus Megatron read (imports numpy only)


class _Tokenizer:
    """What the GPT builder reads of a tokenizer; ``own_pad`` as each case's Megatron tokenizer reported it."""
    name, eod, vocab_size, fingerprint = "fixture", FIXTURES["eod"], FIXTURES["vocab_size"], None

    def __init__(self, own_pad):
        self.own_pad = own_pad


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("pad") / "corpus")
    b = IndexedDatasetBuilder(f"{prefix}.bin", np.int32)
    for doc in make_fixtures.corpus_documents():
        b.add_document(doc)
    b.finalize(f"{prefix}.idx")
    return prefix


@pytest.mark.parametrize("name", sorted(FIXTURES["cases"]))
def test_gpt_samples_follow_megatrons_pad_rule(corpus, tmp_path, name):
    """The ``null_*`` cases: omnitron's NullTokenizer from --null-tokenizer-pad-id (omnitron's --vocab-size V is
    Megatron's V + 1: the same eod, V), against Megatron's NullTokenizer from the same flag."""
    case = FIXTURES["cases"][name]
    null = {"tokenizer_type": "NullTokenizer", "vocab_size": FIXTURES["eod"], "null_tokenizer_pad_id": case["pad"]}
    cfg = DataConfig(data_path=[corpus], split="1", seq_length=FIXTURES["seq_length"], seed=case["seed"],
                     data_cache_path=str(tmp_path), eod_mask_loss=case["eod_mask_loss"],
                     reset_position_ids=case["reset_position_ids"],
                     allow_ambiguous_pad_tokens=case["allow_ambiguous_pad_tokens"],
                     **(null if case["null_tokenizer"] else {}))
    tokenizer = tokenizer_from_config(cfg) if case["null_tokenizer"] else _Tokenizer(case["pad"])
    train, _, _ = build_gpt_datasets(cfg, tokenizer, train_samples=40, valid_samples=0, test_samples=0)
    for i, want in enumerate(case["samples"]):
        got = train[i]
        for key, values in want.items():
            assert got[key].tolist() == values, f"{name}: sample {i} {key}"
    if case["pad"] not in (None, -1, FIXTURES["eod"]):  # the corpus does exercise the rule
        assert any(0.0 in s["loss_mask"] for s in case["samples"])


def _hf_dir(path, pad_token):
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir()
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "<pad>": 2, "a": 3, "b": 4}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    config = {"eos_token": "</s>"} | ({"pad_token": pad_token} if pad_token else {})
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("pad_token", ["<pad>", None])
def test_hf_own_pad_is_the_configs_pad_token(tmp_path, pad_token):
    """Megatron's HuggingFaceTokenizer reports AutoTokenizer's pad_token_id: the config's pad_token, else None
    (a ``<pad>`` in the vocabulary alone is no pad)."""
    transformers = pytest.importorskip("transformers")
    path = _hf_dir(tmp_path / "hf", pad_token)
    ref = transformers.AutoTokenizer.from_pretrained(str(path))
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(path))
    assert (tok.own_pad, tok.eod) == (ref.pad_token_id, ref.eos_token_id)


_LAYOUTS = {  # tokenizer_config.json, special_tokens_map.json (None: no such file); tokenizer.json always has <pad>
    "added_token_only": (None, None),
    "map_only": (None, {"pad_token": "<pad>", "eos_token": "</s>"}),
    "config_eos_map_pad": ({"eos_token": "</s>"}, {"pad_token": {"content": "<pad>", "normalized": False}}),
    "map_over_config": ({"eos_token": "<pad>", "pad_token": "<unk>"}, {"pad_token": "<pad>", "eos_token": "</s>"}),
    "decoder_ignores_map": ({"eos_token": "</s>", "added_tokens_decoder": {"2": {"content": "<pad>", "special": True}}},
                            {"pad_token": "<pad>"}),
    "config_pad_decoder": ({"eos_token": "</s>", "pad_token": "<unk>", "added_tokens_decoder": {}}, {"pad_token": "a"}),
}


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_hf_pad_and_eod_are_autotokenizers(tmp_path, layout):
    """Megatron's HuggingFaceTokenizer's ``pad`` and ``eod`` are AutoTokenizer's ``pad_token_id`` / ``eos_token_id``
    (checked equal, Megatron's and AutoTokenizer's, on these layouts with Megatron at d98e8a6): special_tokens_map.json
    counts (over the config) unless the config has ``added_tokens_decoder``; a special token of tokenizer.json alone
    is no pad."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    config, legacy = _LAYOUTS[layout]
    path = tmp_path / "hf"
    path.mkdir()
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "<pad>": 2, "a": 3, "b": 4}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken("<pad>", special=True), AddedToken("</s>", special=True)])
    tok.save(str(path / "tokenizer.json"))
    for name, content in (("tokenizer_config.json", config), ("special_tokens_map.json", legacy)):
        if content is not None:
            (path / name).write_text(json.dumps(content))
    ref = transformers.AutoTokenizer.from_pretrained(str(path))
    assert len(ref) == 5  # no token added: the ids are tokenizer.json's
    if ref.eos_token_id is None:  # omnitron falls back to a known end-of-document token (Megatron has no eod)
        assert layout == "added_token_only"
    got = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(path))
    assert got.own_pad == ref.pad_token_id
    assert got.eod == (ref.eos_token_id if ref.eos_token_id is not None else 1)


def test_hf_pad_token_missing_from_the_vocabulary_is_refused(tmp_path):
    """AutoTokenizer appends a configured pad the vocabulary lacks as a new id (Megatron's vocabulary grows by one);
    omnitron encodes with tokenizer.json alone, so it stops in one line instead of dropping the pad."""
    transformers = pytest.importorskip("transformers")
    path = _hf_dir(tmp_path / "hf", "<PAD2>")
    ref = transformers.AutoTokenizer.from_pretrained(str(path))
    assert (ref.pad_token_id, len(ref)) == (5, 6)
    with pytest.raises(TokenizerError) as err:
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(path))
    assert "pad_token '<PAD2>' is not in tokenizer.json" in str(err.value) and "\n" not in str(err.value)


def test_gpt2_and_null_have_no_own_pad():
    """GPT-2's files name no pad (transformers' GPT2 tokenizer: pad_token None); Megatron's NullTokenizer: -1."""
    assert build_tokenizer("GPT2BPETokenizer").own_pad is None
    assert build_tokenizer("NullTokenizer", vocab_size=10).own_pad is None


def test_null_tokenizer_pad_id_flag():
    """--null-tokenizer-pad-id (Megatron's flag, default -1) reaches the NullTokenizer a run builds; given with
    another tokenizer, which has its own pad, it is one line (Megatron ignores it there)."""
    from omnitron.core.training.arguments import parse_settings

    base = ["--model", "gpt2_tiny", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "60"]
    assert tokenizer_from_config(parse_settings(base, world_size=1).data).own_pad is None
    data = parse_settings(base + ["--null-tokenizer-pad-id", "7"], world_size=1).data
    assert data.null_tokenizer_pad_id == 7 and tokenizer_from_config(data).own_pad == 7
    with pytest.raises(TokenizerError) as err:
        build_tokenizer("GPT2BPETokenizer", null_tokenizer_pad_id=7)
    line = str(err.value)
    assert line.startswith("--null-tokenizer-pad-id 7 sets NullTokenizer's pad") and "\n" not in line, line


@pytest.mark.parametrize("pad_id", [3, -1, 0])  # 0: a pad at id 0 is a pad (only a negative id means none)
def test_sentencepiece_own_pad_is_the_models(tmp_path, pad_id):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(f"the whale {i} and the sea {i * 7}" for i in range(200)), encoding="utf-8")
    spm.SentencePieceTrainer.Train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=60,
                                   model_type="bpe", pad_id=pad_id, unk_id=3 if pad_id == 0 else 0, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "sp.model"))
    assert tok.own_pad == (sp.pad_id() if sp.pad_id() >= 0 else None)
    assert (tok.own_pad is None) == (pad_id < 0)
