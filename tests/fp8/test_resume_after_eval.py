"""Delayed FP8 scaling resumes bit-exact from a checkpoint written right after an evaluation.

Per-step delayed scaling (scaling.py) max-accumulates every FP8 forward's amax into its role's step-amax buffer
and pushes it into the history at the next optimizer step's end. An evaluation between two steps runs FP8
forwards too, so the uninterrupted run's next push folds in the evaluation's amaxes. A run stopped right after
that evaluation (--eval-interval 2, --exit-interval 2) must carry the buffer in its checkpoint: without it, the
resumed step 3 pushes only its own amaxes, its scales for step 4 differ, and so does the loss of step 4
(measured before the fix: 4.872516 against 4.872546, history 0.3203 against 0.3652 for an attention
projection's input). The reference is the uninterrupted run itself: losses and every role's history, scale and
buffer compared for exact equality.
"""
from __future__ import annotations

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.core.precision.fp8 import linear_modules
from omnitron.core.training.arguments import parse_settings
from omnitron.core.training.loop import train


def _args(save, algo, extra=()):
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "128", "--num-workers", "0", "--micro-batch-size", "1", "--global-batch-size", "2",
            "--train-iters", "4", "--lr", "3e-3", "--log-interval", "1", "--seed", "11", "--no-tensorboard",
            "--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "2",
            "--fp8-amax-compute-algo", algo, "--eval-interval", "2", "--eval-iters", "1",
            "--save", str(save), "--data-cache-path", str(save / "cache"), *extra]


def _run(args):
    """Per-iteration losses, the FP8 state as saved, and the live roles' step-amax buffers."""
    result = train(parse_settings(args, 1), get_backend("cpu"))
    c = result["components"]
    pending = [float(s.step_amax) for _, m in linear_modules(c.modules) for s in m.fp8.states.values()]
    return result["losses"], c.extra["fp8_state"](), pending


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_delayed_fp8_resumes_after_an_evaluation(tmp_path, algo):
    full, full_state, _ = _run(_args(tmp_path / "full", algo))
    part = tmp_path / "part"
    first, _, pending = _run(_args(part, algo, ["--exit-interval", "2"]))
    # the evaluation at iteration 2 observed amaxes that no step has pushed yet (-1: none): the case under test
    assert max(pending) >= 0
    second, state, _ = _run(_args(part, algo, ["--load", str(part)]))
    assert sorted(first) == [1, 2] and sorted(second) == [3, 4]
    assert {**first, **second} == full, (full, first, second)  # exact, every iteration
    assert state.keys() == full_state.keys()
    for name, roles in full_state.items():
        for role, fields in roles.items():
            for key, value in fields.items():
                assert torch.equal(state[name][role][key], value), (name, role, key, value, state[name][role][key])
