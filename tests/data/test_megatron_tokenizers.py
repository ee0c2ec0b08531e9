"""Megatron's TikTokenizer and MultimodalTokenizer against independent references: a tiktoken.Encoding built
directly from the same ranks and Megatron's pattern, and the Hugging Face tokenizer's own encoding of each
piece of a hand-written chat rendering."""
from __future__ import annotations

import base64
import json
import random
from collections import Counter

import pytest

from omnitron.core.data.tokenizers import TokenizerError, build_tokenizer

tiktoken = pytest.importorskip("tiktoken", reason="TikTokenizer needs the optional tiktoken package "
                                                  "(pip install tiktoken)")

# Megatron-LM d98e8a6, megatron/core/tokenizers/text/libraries/tiktoken_tokenizer.py, transcribed.
MEGATRON_V1 = r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
MEGATRON_V2 = ("[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|"
               "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|\\p{N}|"
               " ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
MEGATRON_SPECIAL = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]
CORPUS = ("the quick brown fox jumps over the lazy dog; the dog sleeps. Tokenizers split text into pieces, "
          "then merge the most frequent pairs: the, then, there, these, those! 1234 5678 naïve café über.")


def _train_ranks(text: str, merges: int) -> list[bytes]:
    """Byte-level BPE ranks learnt greedily from ``text`` (bytes 0..255 first, then each merge's token)."""
    words = [[bytes([b]) for b in w.encode()] for w in text.split(" ")]
    ranks = [bytes([i]) for i in range(256)]
    for _ in range(merges):
        pairs = Counter((w[i], w[i + 1]) for w in words for i in range(len(w) - 1))
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        ranks.append(a + b)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == (a, b):
                    w[i:i + 2] = [a + b]
                i += 1
    return ranks


@pytest.fixture
def vocab_file(tmp_path):
    ranks = _train_ranks(CORPUS, 80)
    path = tmp_path / "tiktoken.json"
    path.write_text(json.dumps([{"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str":
                                 t.decode("utf-8", "replace")} for i, t in enumerate(ranks)]))
    return str(path), ranks


def _sentences(seed: int, n: int = 6) -> list[str]:
    rng = random.Random(seed)
    words = CORPUS.replace(".", " .").split() + ["Ünïcode", "\n", "  ", "x/y", "42", "<s>", "</s>"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 20))) for _ in range(n)]


@pytest.mark.parametrize("pattern,regex", [("v1", MEGATRON_V1), ("v2", MEGATRON_V2)])
def test_tiktokenizer_encodes_as_tiktoken(vocab_file, pattern, regex):
    path, ranks = vocab_file
    tok = build_tokenizer("TikTokenizer", tokenizer_model=path, tiktoken_pattern=pattern, vocab_size=1000 + len(ranks))
    specials = MEGATRON_SPECIAL + [f"<SPECIAL_{i}>" for i in range(7, 1000)]
    ref = tiktoken.Encoding(name="ref", pat_str=regex, mergeable_ranks={t: i + 1000 for i, t in enumerate(ranks)},
                            special_tokens={t: i for i, t in enumerate(specials)})
    for text in _sentences(random.randrange(1 << 30)) + [CORPUS]:
        ids = tok.encode(text)
        assert ids == ref.encode(text, allowed_special="all")
        assert tok.decode(ids) == text
    assert tok.vocab_size == 1000 + len(ranks)


def test_tiktokenizer_special_tokens_have_megatrons_ids(vocab_file):
    path, ranks = vocab_file
    tok = build_tokenizer("TikTokenizer", tokenizer_model=path, vocab_size=1000 + len(ranks))
    assert (tok.bos, tok.eod, tok.pad) == (1, 2, 4)  # <s>, </s>, <pad> in Megatron's default list
    assert tok.own_pad == 4  # Megatron's TikTokenizer pad_id: GPT samples mask it (tests/data/test_gpt_pad_megatron.py)
    assert tok.encode("<unk><mask><cls><sep><SPECIAL_7><SPECIAL_999>") == [0, 3, 5, 6, 7, 999]
    assert tok.encode("a") == [1000 + ord("a")]  # rank r is id r + num_special
    mine = MEGATRON_SPECIAL[::-1] + ["<|im_start|>"]
    tok = build_tokenizer("TikTokenizer", tokenizer_model=path, tokenizer_special_tokens=mine,
                          tiktoken_num_special_tokens=16, vocab_size=16 + len(ranks))
    assert (tok.eod, tok.pad, tok.encode("<|im_start|><SPECIAL_8>")) == (4, 2, [7, 8])
    with pytest.raises(TokenizerError, match=r"--vocab-size"):
        build_tokenizer("TikTokenizer", tokenizer_model=path)  # 131072 by default: the file is too short
    with pytest.raises(TokenizerError, match="<pad>"):
        build_tokenizer("TikTokenizer", tokenizer_model=path, tokenizer_special_tokens=["<unk>"], vocab_size=2000)


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_tiktokenizer_export_loads_in_autotokenizer(vocab_file, tmp_path, pattern):
    transformers = pytest.importorskip("transformers", reason="the export check loads it with transformers")
    from omnitron.core.checkpoint.hf_tokenizer import write_tokenizer

    path, ranks = vocab_file
    run = {"tokenizer_type": "TikTokenizer", "tokenizer_model": path, "vocab_size": 1000 + len(ranks),
           "tiktoken_pattern": pattern}
    out = tmp_path / "export"
    out.mkdir()
    eod = write_tokenizer(run, str(out))
    tok = build_tokenizer(**run)
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    assert eod == tok.eod == hf.eos_token_id == 2 and hf.pad_token_id == 4
    for text in _sentences(random.randrange(1 << 30)) + [CORPUS]:
        ids = hf.encode(text, add_special_tokens=False)
        assert ids == tok.encode(text)
        assert hf.decode(ids) == text


LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


@pytest.fixture
def hf_dir(tmp_path):
    """A small byte-level BPE tokenizer directory with Llama 3's and ChatML's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = LLAMA3_SPECIAL + ["<|im_start|>", "<|im_end|>", "<|pad|>"]
    tok.train_from_iterator([CORPUS] * 4, trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[
        ("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": "<|pad|>"}))
    return tmp_path, tok


def test_multimodal_llama3_prompt_and_image_token(hf_dir):
    path, hf = hf_dir
    tok = build_tokenizer("MultimodalTokenizer", tokenizer_model=str(path), tokenizer_prompt_format="llama3")
    sid = hf.token_to_id
    enc = lambda s: hf.encode(s, add_special_tokens=False).ids  # noqa: E731
    image = hf.get_vocab_size(with_added_tokens=True)  # Megatron's add_tokens: the next id
    bos, sh, eh, eot = (sid(t) for t in ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"))
    assert (tok.image_token_id, tok.vocab_size, tok.eod, tok.pad) == (image, image + 1, eot, sid("<|end_of_text|>"))
    chat = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "<image>\nWhat is the fox?"},
            {"role": "assistant", "content": "The quick fox."}]
    system = [bos, sh, *enc("system"), eh, *enc("\n\nBe brief."), eot]
    user = [sh, *enc("user"), eh, *enc("\n\n"), image, *enc("\nWhat is the fox?"), eot]
    answer = [sh, *enc("assistant"), eh, *enc("\n\nThe quick fox."), eot]
    gen = [sh, *enc("assistant"), eh, *enc("\n\n")]
    tokens, target = tok.tokenize_conversation(chat, add_generation_prompt=True)
    assert tokens == system + user + answer + gen
    assert target == [-100] * len(system + user) + [-100] * 4 + answer[4:] + gen  # Megatron masks 4 header tokens
    assert tok.tokenize("<image> the dog") == [bos, image, *enc(" the dog")]
    assert tok.decode(tok.encode("<image> the dog")) == "<image> the dog"


def test_multimodal_chatml_with_internvl_tags(hf_dir):
    path, hf = hf_dir
    tok = build_tokenizer("MultimodalTokenizer", tokenizer_model=str(path), tokenizer_prompt_format="chatml",
                          tokenizer_special_tokens=["<image>", "<img>", "</img>"], image_tag_type="internvl")
    v, sid = hf.get_vocab_size(with_added_tokens=True), hf.token_to_id
    enc = lambda s: hf.encode(s, add_special_tokens=False).ids  # noqa: E731
    start, end = sid("<|im_start|>"), sid("<|im_end|>")
    tokens, target = tok.tokenize_conversation([{"role": "user", "content": "<image> dog?"},
                                                {"role": "assistant", "content": "the dog"}])
    user = [start, *enc("user\n"), v + 1, v, v + 2, *enc(" dog?"), end, *enc("\n")]
    answer = [start, *enc("assistant\n"), *enc("the dog"), end, *enc("\n")]
    assert tokens == user + answer and tok.pad == sid("<|pad|>")
    assert target == [-100] * len(user) + [-100] * 3 + answer[3:]
    with pytest.raises(TokenizerError, match="--tokenizer-prompt-format"):
        build_tokenizer("MultimodalTokenizer", tokenizer_model=str(path), tokenizer_prompt_format="nvlm-yi-34b")


def test_megatron_tokenizer_flags_reach_the_tokenizer(vocab_file, hf_dir):
    """Megatron's spellings (--tiktoken-special-tokens, --special-tokens) parse into the data settings, and the run's
    tokenizer is built from them."""
    from omnitron.core.data.config import tokenizer_from_config
    from omnitron.core.training.arguments import parse_settings

    path, ranks = vocab_file
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--train-iters", "1", "--lr", "1e-3", "--mock-data"]
    tik = parse_settings(base + ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", path, "--tiktoken-pattern",
                                 "v1", "--tiktoken-num-special-tokens", "8", "--vocab-size", str(8 + len(ranks)),
                                 "--tiktoken-special-tokens", *MEGATRON_SPECIAL, "<|x|>"], 1).data
    tok = tokenizer_from_config(tik)
    assert (tok.pattern_name, tok.vocab_size, tok.encode("<|x|>")) == ("v1", 8 + len(ranks), [7])
    mm = parse_settings(base + ["--tokenizer-type", "MultimodalTokenizer", "--tokenizer-model", str(hf_dir[0]),
                                "--tokenizer-prompt-format", "llama3p1", "--special-tokens", "<image>", "<img>",
                                "</img>", "--image-tag-type", "internvl"], 1).data
    tok = tokenizer_from_config(mm)
    v = hf_dir[1].get_vocab_size(with_added_tokens=True)
    assert tok.encode("<image>") == [v + 1, v, v + 2] and tok.format.pad == "<|finetune_right_pad_id|>"
