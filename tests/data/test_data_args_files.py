"""--data-args-path and --per-split-data-args-path: files holding the data-path values, read as Megatron reads them
(megatron/training/utils/common_utils.py get_blend_and_blend_per_split at d98e8a6: ``f.read().split()``; a JSON
object with "train", "valid" and "test", each a string split at whitespace or a list)."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from omnitron.core.config.parallel import ConfigError
from omnitron.core.data import DataConfig, IndexedDatasetBuilder, build_gpt_datasets, build_tokenizer
from omnitron.core.training.arguments import parse_settings

ARGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--train-iters", "4", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]


@pytest.fixture
def corpora(tmp_path):
    rng = np.random.default_rng()
    out = []
    for name in "ab":
        prefix = str(tmp_path / name)
        b = IndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
        for _ in range(int(rng.integers(40, 80))):
            b.add_document(rng.integers(0, 127, int(rng.integers(1, 40))))
        b.finalize(f"{prefix}.idx")
        out.append(prefix)
    return out


def _tokens(datasets):
    return [None if d is None else [d[i]["tokens"].tolist() for i in range(len(d))] for d in datasets]


def test_data_args_path_is_the_data_path_it_holds(corpora, tmp_path):
    a, b = corpora
    f = tmp_path / "blend.txt"
    f.write_text(f"0.3 {a}\n\t0.7\n{b}\n")  # any whitespace separates, as str.split
    want = ["0.3", a, "0.7", b]
    settings = parse_settings(ARGS + ["--data-args-path", str(f), "--split", "90,8,2", "--data-cache-path",
                               str(tmp_path / "cache")], 1)
    assert settings.data.data_path == want and settings.data.data_args_path is None
    tok = build_tokenizer("NullTokenizer", vocab_size=128)
    sizes = {"train_samples": 30, "valid_samples": 6, "test_samples": 2}
    got = build_gpt_datasets(settings.data, tok, **sizes)
    direct = build_gpt_datasets(DataConfig(data_path=want, split="90,8,2", seq_length=16,
                                           data_cache_path=settings.data.data_cache_path), tok, **sizes)
    assert _tokens(got) == _tokens(direct)
    again = DataConfig(**dataclasses.asdict(settings.data))  # a checkpoint's settings read back
    assert again.data_path == want


def test_per_split_data_args_path_reads_strings_lists_and_null(corpora, tmp_path):
    a, b = corpora
    f = tmp_path / "splits.json"
    f.write_text(json.dumps({"train": f"0.6 {a} 0.4 {b}", "valid": [b], "test": None}))
    cfg = DataConfig(per_split_data_args_path=str(f), seq_length=16)
    assert (cfg.train_data_path, cfg.valid_data_path, cfg.test_data_path) == (["0.6", a, "0.4", b], [b], [])
    assert cfg.per_split and cfg.per_split_data_args_path is None
    again = DataConfig(**dataclasses.asdict(cfg))
    assert again.train_data_path == cfg.train_data_path


@pytest.mark.parametrize("content, flag, words", [
    (None, "data_args_path", "cannot read"),
    ("", "data_args_path", "empty"),
    ("{not json", "per_split_data_args_path", "not JSON"),
    ('{"train": "a", "valid": "b"}', "per_split_data_args_path", "'test'"),
    ('{"train": 3, "valid": null, "test": null}', "per_split_data_args_path", "'train' must be"),
])
def test_bad_files_are_refused_in_one_line(tmp_path, content, flag, words):
    f = tmp_path / "args"
    if content is not None:
        f.write_text(content)
    with pytest.raises(ConfigError, match=words) as err:
        DataConfig(**{flag: str(f)})
    assert "\n" not in str(err.value) and "--" + flag.replace("_", "-") in str(err.value)


def test_a_file_and_the_flag_it_stands_for_are_not_both_given(tmp_path):
    f = tmp_path / "args"
    f.write_text('{"train": "a", "valid": null, "test": null}')
    with pytest.raises(ConfigError, match="not both"):
        DataConfig(data_path=["x"], data_args_path=str(f))
    with pytest.raises(ConfigError, match="not both"):
        DataConfig(train_data_path=["x"], per_split_data_args_path=str(f))
