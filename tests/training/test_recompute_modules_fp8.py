"""``--recompute-modules layernorm`` under FP8, as Megatron's TransformerConfig decides it: refused with the
delayed recipe, which is also the recipe when ``--fp8-recipe`` is not given (Megatron's default, and omnitron's), and
accepted with the other recipes or without FP8."""
from __future__ import annotations

import pytest

from omnitron.core.config import ConfigError

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--train-iters", "10",
        "--recompute-granularity", "selective", "--recompute-modules", "layernorm"]


def _parse(*extra: str):
    from omnitron.core.training.arguments import parse_settings

    return parse_settings(BASE + list(extra), 1)


@pytest.mark.parametrize("recipe", [(), ("--fp8-recipe", "delayed")], ids=["default-recipe", "delayed"])
def test_layernorm_recomputation_is_refused_with_the_delayed_recipe(recipe):
    with pytest.raises(ConfigError) as err:
        _parse("--fp8-format", "hybrid", *recipe)
    assert str(err.value) == ("--recompute-modules layernorm: Megatron refuses it with the delayed FP8 recipe; drop it "
                              "or use another --fp8-recipe")


@pytest.mark.parametrize("fp8", [(), ("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise")],
                         ids=["no-fp8", "tensorwise"])
def test_layernorm_recomputation_is_accepted_otherwise(fp8):
    s = _parse(*fp8)
    assert s.model.recompute_granularity == "selective"
    assert (s.fp8.fp8_recipe if s.fp8 is not None else None) == ("tensorwise" if fp8 else None)
