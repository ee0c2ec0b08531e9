"""``--mock-data`` and ``--split``: Megatron's mock data ignores the split. With no --data-path its
``BlendedMegatronDatasetConfig`` sets ``mock = True`` and overwrites ``split`` with "1,1,1" (d98e8a6,
megatron/core/datasets/blended_megatron_dataset_config.py), so a split of weight 0 still gets its mock
dataset; omnitron's mock builds every split that gets samples, whatever --split says, and accepts the flags."""
from __future__ import annotations

import pytest

from omnitron.core.data import DataConfig, build_gpt_datasets, build_tokenizer
from omnitron.core.data.bert_dataset import build_bert_datasets


@pytest.mark.parametrize("split", ["1,0,0", "0,1,0", "969,30,1"])
def test_mock_data_builds_every_split_whatever_the_split_says(split):
    data = DataConfig(mock_data=True, seq_length=16, split=split)
    gpt = build_gpt_datasets(data, build_tokenizer("NullTokenizer", vocab_size=64), train_samples=8,
                             valid_samples=4, test_samples=4)
    bert = build_bert_datasets(data, build_tokenizer("BertWordPieceLowerCase"), train_samples=8, valid_samples=4,
                               test_samples=4)
    assert [len(d) for d in gpt] == [8, 4, 4] == [len(d) for d in bert]


def test_mock_data_takes_a_split_without_validation_share():
    from omnitron.core.training.arguments import parse_settings

    s = parse_settings(["--model", "gpt2_tiny", "--mock-data", "--split", "1,0,0", "--eval-interval", "2",
                        "--train-iters", "4",
                        "--tokenizer-type", "NullTokenizer", "--vocab-size", "64"], world_size=1)
    assert s.data.mock_data and s.data.split == "1,0,0"
