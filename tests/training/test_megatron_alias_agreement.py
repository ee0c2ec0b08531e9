"""A Megatron alias given together with the omnitron setting it stands for: accepted when both say the same (a
script passing both spellings), refused in one line naming both flags when they disagree."""
from __future__ import annotations

import pytest

from omnitron.core.config import ConfigError

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--train-iters", "10"]

ALIASES = [  # (alias, the setting's flag, the value the alias means, another value, where the setting lands)
    ("--use-rotary-position-embeddings", "--position-embedding-type", "rope", "learned_absolute",
     lambda s: s.model.position_embedding_type),
    ("--recompute-activations", "--recompute-granularity", "selective", "full",
     lambda s: s.model.recompute_granularity),
]


def _parse(*extra: str):
    from omnitron.core.training.arguments import parse_settings

    return parse_settings(BASE + list(extra), 1)


@pytest.mark.parametrize("alias, flag, value, other, read", ALIASES, ids=[a[0] for a in ALIASES])
def test_an_alias_agreeing_with_its_setting_is_accepted_and_a_disagreeing_one_refused(alias, flag, value, other,
                                                                                      read):
    assert read(_parse(alias, flag, value)) == value == read(_parse(alias))
    extra = ("--recompute-method", "uniform", "--recompute-num-layers", "1") if other == "full" else ()
    with pytest.raises(ConfigError) as err:
        _parse(alias, flag, other, *extra)
    msg = str(err.value)
    assert msg == f"{alias} means {flag} {value}, but {flag} {other} was given: drop one of them"
