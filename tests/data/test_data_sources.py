"""Where the data comes from, by Megatron's rules (d98e8a6): one source (validate_args asserts ``mock_data +
bool(data_path) + any(per-split paths) <= 1``), ``--split`` never with the per-split paths
(BlendedMegatronDatasetConfig: "split and blend_per_split are incompatible"), and every family that reads files
reads the per-split paths (pretrain_bert / pretrain_t5 pass ``blend_per_split`` as pretrain_gpt does)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from omnitron.core.config.parallel import ConfigError
from omnitron.core.data import DataConfig, build_tokenizer
from omnitron.core.data.bert_dataset import build_bert_datasets
from omnitron.core.data.multimodal_dataset import build_multimodal_datasets
from omnitron.core.data.t5_dataset import build_t5_datasets
from omnitron.core.training.arguments import parse_settings
from omnitron.testing.data import write_documents

ARGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--train-iters", "4", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
RANGES = {"train": (1000, 2000), "valid": (2000, 3000), "test": (3000, 4000)}
"""Each split's file holds ids of its own range only (BERT WordPiece ids, no special ones)."""


@pytest.fixture
def split_files(tmp_path):
    """One sentence-split dataset per split, 8-20 documents of 2-5 sentences of 1-12 ids from the split's range."""
    rng = np.random.default_rng()
    out = {}
    for name, (lo, hi) in RANGES.items():
        docs = [[rng.integers(lo, hi, int(rng.integers(1, 13))) for _ in range(int(rng.integers(2, 6)))]
                for _ in range(int(rng.integers(8, 21)))]
        out[name] = str(tmp_path / name)
        write_documents(out[name], docs)
    return out


@pytest.mark.parametrize("paths", [["--train-data-path", "A"], ["--train-data-path", "A", "--valid-data-path", "B"],
                                   ["--per-split-data-args-path", "FILE"]])
def test_split_with_per_split_paths_is_refused(tmp_path, paths):
    f = tmp_path / "splits.json"
    f.write_text(json.dumps({"train": "A", "valid": None, "test": None}))
    paths = [str(f) if p == "FILE" else p for p in paths]
    run = ARGS + paths + ["--eval-interval", "0"]
    assert parse_settings(run, world_size=1).data.per_split  # without --split: read whole, as Megatron
    with pytest.raises(ConfigError, match=r"^--split 98,2 with --train-data-path.*drop --split"):
        parse_settings(run + ["--split", "98,2"], world_size=1)


@pytest.mark.parametrize("paths", [["--data-path", "A"], ["--train-data-path", "A"], ["--data-args-path", "FILE"]])
def test_mock_data_with_data_paths_is_refused(tmp_path, paths):
    f = tmp_path / "blend.txt"
    f.write_text("A")
    paths = [str(f) if p == "FILE" else p for p in paths]
    assert parse_settings(ARGS + ["--mock-data"], world_size=1).data.mock_data
    with pytest.raises(ConfigError, match=r"^--mock-data with --(train-)?data-path: give one data source"):
        parse_settings(ARGS + ["--mock-data"] + paths + ["--eval-interval", "0"], world_size=1)


@pytest.mark.parametrize("family", ["bert", "t5"])
def test_bert_and_t5_read_each_split_from_its_own_files(split_files, tmp_path, family):
    """--train-data-path / --valid-data-path / --test-data-path: every document of the split's own file (all its
    sentences in the sample mapping) and no id of another split's file; BERT and T5 used to read the bundled
    corpus instead."""
    cfg = DataConfig(train_data_path=[split_files["train"]], valid_data_path=[split_files["valid"]],
                     test_data_path=[split_files["test"]], seq_length=32, data_cache_path=str(tmp_path / "cache"),
                     seed=int(np.random.default_rng().integers(0, 2**20)))
    if family == "bert":
        tok = build_tokenizer("BertWordPieceLowerCase")
        splits = build_bert_datasets(cfg, tok, train_samples=30, valid_samples=10, test_samples=5)
    else:
        tok = build_tokenizer("BertWordPieceLowerCase", vocab_extra_ids=30)
        splits = build_t5_datasets(cfg, tok, train_samples=30, valid_samples=10, test_samples=5,
                                   decoder_seq_length=16)
    special = np.asarray(list(tok.special_ids) + list(getattr(tok, "sentinels", ())))
    for (name, (lo, hi)), ds in zip(RANGES.items(), splits):
        assert ds.indexed.prefix == split_files[name]
        assert len(ds.table["bounds"]) - 1 == ds.indexed.num_documents  # the whole file
        for i in range(len(ds)):
            x = ds[i]
            masked, text = x["loss_mask"].bool(), ~x["padding_mask"]
            if family == "bert":  # a masked position may hold [MASK] or a random id: its label is the file's
                text = text & ~masked
            ids = np.concatenate([x["tokens"][text].numpy(), x["labels"][masked].numpy()])
            ids = ids[~np.isin(ids, special)]
            assert len(ids) and ((ids >= lo) & (ids < hi)).all(), (name, i)


def test_multimodal_refuses_per_split_paths():
    with pytest.raises(ValueError, match="--train-data-path: the multimodal family trains on synthetic"):
        build_multimodal_datasets(DataConfig(seq_length=32, train_data_path=["x"]), build_tokenizer("GPT2BPETokenizer"),
                                  train_samples=1, valid_samples=0, test_samples=0, img_h=32, img_w=32,
                                  num_channels=3, num_image_tokens=16)


@pytest.mark.parametrize("flag", ["--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"])
@pytest.mark.parametrize("value,match", [(["0.5", "A", "B", "C"], "should be a weight"),
                                         (["0", "A", "1", "B"], "must be > 0"), (["A", "0.5"], "a number among")])
def test_a_bad_data_path_error_names_the_flag_given(flag, value, match):
    field = flag[2:].replace("-", "_")
    with pytest.raises(ConfigError, match=rf"^{flag}\b.*{match}") as info:
        DataConfig(**{field: value})
    others = {"--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"} - {flag}
    assert not any(f in str(info.value) for f in others)


@pytest.mark.parametrize("family", ["bert", "t5"])
@pytest.mark.parametrize("flag", ["--data-path", "--valid-data-path"])
def test_bert_and_t5_refuse_a_blend_by_size_naming_the_flag(split_files, tmp_path, family, flag):
    """Prefixes without weights: Megatron's BERT and T5 datasets fail there (helpers.build_mapping gets no sample
    count: a TypeError), so omnitron stops in one line naming the flag that holds them, before any index is built."""
    two = [split_files["train"], split_files["valid"]]
    paths = {"data_path": two} if flag == "--data-path" else {
        "train_data_path": [split_files["train"]], "valid_data_path": two, "test_data_path": [split_files["test"]]}
    cfg = DataConfig(seq_length=32, data_cache_path=str(tmp_path / "cache"), **paths)
    build = build_bert_datasets if family == "bert" else build_t5_datasets
    kw = {} if family == "bert" else {"decoder_seq_length": 16}
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_extra_ids=30 if family == "t5" else 0)
    with pytest.raises(ValueError, match=rf"^{flag} {' '.join(two)}: \w+ blends need weights") as info:
        build(cfg, tok, train_samples=30, valid_samples=10, test_samples=5, **kw)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.npy"))
