"""``--lr-warmup-fraction F`` as Megatron reads it (``lr_warmup_steps = F * lr_decay_steps``, not rounded): the
fraction of ``--lr-decay-iters`` (of ``--train-iters`` when not given), or of ``--lr-decay-samples`` (of
``--train-samples``) when training is counted in samples; a fraction of 1 is refused (the warm-up must end before the
decay). Reference: the product computed here in Python floats on random fractions."""
from __future__ import annotations

import random

import pytest

from omnitron.core.config import ConfigError

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]


def _optim(*extra: str):
    from omnitron.core.training.arguments import parse_settings

    return parse_settings(BASE + list(extra), 1).optim


@pytest.mark.parametrize("seed", range(3))
def test_the_warmup_is_the_fraction_of_the_decay_unrounded(seed):
    rng = random.Random(seed)
    f = rng.uniform(0.01, 0.9)
    train, decay = rng.randint(50, 200), rng.randint(20, 49)
    assert _optim("--train-iters", str(train), "--lr-decay-iters", str(decay),
                  "--lr-warmup-fraction", repr(f)).lr_warmup_iters == f * decay
    assert _optim("--train-iters", str(train), "--lr-warmup-fraction", repr(f)).lr_warmup_iters == f * train
    samples, decay_samples = 4 * train, 4 * decay
    got = _optim("--train-samples", str(samples), "--lr-decay-samples", str(decay_samples),
                 "--lr-warmup-fraction", repr(f))
    assert got.lr_warmup_samples == f * decay_samples and got.lr_warmup_iters == 0


def test_a_whole_warmup_is_an_int_and_a_fraction_of_one_is_refused():
    got = _optim("--train-iters", "40", "--lr-decay-iters", "30", "--lr-warmup-fraction", "0.5").lr_warmup_iters
    assert got == 15 and isinstance(got, int)
    with pytest.raises(ConfigError, match=r"^--lr-warmup-fraction must lie in \[0, 1\)"):
        _optim("--train-iters", "40", "--lr-warmup-fraction", "1.0")
