"""``--seed`` <= 0 stops every model family at parse, as Megatron's ``_set_random_seed``
(megatron/training/initialize.py) stops every pretrain script (GPT, BERT, T5, VLM: all call
``initialize_megatron`` without ``skip_random_seed``) before any model or data is built."""
from __future__ import annotations

import ast
import os
import typing

import pytest
import torch

from omnitron.core.config.parallel import ConfigError

MEGATRON_INIT = "/tmp/megatron/megatron/training/initialize.py"


def _megatron_seed_error(seed: int) -> str | None:
    """The message Megatron's own ``_set_random_seed`` raises for ``seed`` (None: it accepts it), the function taken
    from its source (the module's imports need Python 3.12) and called before it touches any process group."""
    with open(MEGATRON_INIT) as f:
        tree = ast.parse(f.read())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_set_random_seed")
    space = {"Optional": typing.Optional, "torch": torch}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), MEGATRON_INIT, "exec"), space)  # noqa: S102
    try:
        space["_set_random_seed"](seed)
    except ValueError as err:
        return str(err)
    except NameError:  # an accepted seed goes on to the process groups this stub does not give
        return None
    return None


@pytest.mark.parametrize("preset", ["gpt2_tiny", "llama_tiny", "bert_tiny", "t5_tiny", "llava_tiny"])
@pytest.mark.parametrize("seed", [0, -3])
def test_seed_at_most_0_stops_every_family_at_parse_as_megatron(preset, seed):
    """One line quoting Megatron's message for the same seed; --seed 1 parses."""
    from omnitron.core.training.arguments import parse_settings

    want = f"Seed ({seed}) should be a positive integer."
    if os.path.exists(MEGATRON_INIT):  # the message quoted is the one Megatron's code raises
        assert _megatron_seed_error(seed) == want
        assert _megatron_seed_error(1) is None
    base = ["--model", preset, "--mock-data", "--train-iters", "1"]
    with pytest.raises(ConfigError) as err:
        parse_settings(base + ["--seed", str(seed)], world_size=1)
    line = str(err.value)
    assert line.startswith(f"--seed {seed}: ") and "\n" not in line, line
    assert want in line and line.endswith("give --seed 1 or more"), line
    assert parse_settings(base + ["--seed", "1"], world_size=1).training.seed == 1
