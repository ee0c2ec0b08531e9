"""The memory model's ``fp8`` term (:mod:`omnitron.plan.fp8_memory`), worked by hand in bytes from the layer's
weight shapes and :mod:`omnitron.core.precision.fp8.linear`'s code path: the layers ``--first-last-layers-bf16``
keeps wide hold no FP8 weight on the stage holding them; the block-wise recipe caches one FP8 byte an element and
one fp32 scale per 128x128 block; the per-tensor recipes the FP8 weight and its transpose; the delayed recipe
its amax histories."""
from __future__ import annotations

import math
import random

import pytest

H, FFN = 192, 320
"""The test layer: hidden and MLP sizes off multiples of 128, so the block-wise scales' ceilings count."""
SHAPES = [(3 * H, H), (H, H), (FFN, H), (H, FFN)]
"""(out, in) of one GPT layer's linears: qkv, attention projection, fc1, fc2 (the output layer stays wide)."""


def _settings(recipe: str, pp: int = 2, wide: tuple[int, int] | None = None, history: int = 1024):
    from omnitron.commands.plan import settings_of

    given = {"model": "gpt2_tiny", "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 256,
             "seq_length": 64, "max_position_embeddings": 64, "global_batch_size": 4, "micro_batch_size": 1,
             "bf16": True, "hidden_size": H, "num_attention_heads": 4, "ffn_hidden_size": FFN, "num_layers": 4,
             "layout": f"pp{pp}", "fp8_format": "e4m3" if recipe == "blockwise" else "hybrid", "fp8_recipe": recipe,
             "fp8_amax_history_len": history}
    if wide is not None:
        given |= {"first_last_layers_bf16": True, "num_layers_at_start_in_bf16": wide[0],
                  "num_layers_at_end_in_bf16": wide[1]}
    return settings_of(given)


def _stage(settings, r: int) -> int:
    from omnitron.plan.fp8_memory import fp8_bytes
    from omnitron.plan.memory import model_config

    return fp8_bytes(settings, model_config(settings), r)


def test_first_last_layers_bf16_hold_no_fp8_weight_per_stage():
    """4 layers on pp2 (two a stage), tensorwise: each FP8 linear caches its FP8 weight and transpose (2 bytes an
    element) and one fp32 scale. The first ``a`` and last ``z`` layers, kept wide, hold nothing, on whichever
    stage holds them; a random split so both stages and both ends are exercised."""
    per_layer = sum(2 * o * i + 4 for o, i in SHAPES)
    assert per_layer == 2 * (3 * 192 * 192 + 192 * 192 + 2 * 320 * 192) + 4 * 4
    assert [_stage(_settings("tensorwise"), r) for r in (0, 1)] == [2 * per_layer, 2 * per_layer]
    a, z = random.choice([(1, 0), (0, 1), (1, 2), (2, 1), (1, 1)])
    fp8_layers = [[i not in (*range(a), *range(4 - z, 4)) for i in layers] for layers in ((0, 1), (2, 3))]
    s = _settings("tensorwise", wide=(a, z))
    assert [_stage(s, r) for r in (0, 1)] == [sum(f) * per_layer for f in fp8_layers], (a, z)


def test_blockwise_caches_one_byte_and_a_scale_per_128x128_block():
    """Block-wise, pp1: one FP8 byte per weight element and one fp32 scale per 128x128 block (``ceil`` each
    way: qkv 576x192 has 5x2 blocks, fc1 320x192 3x2); no activation scale is saved (the input is saved wide)."""
    blocks = 5 * 2 + 2 * 2 + 3 * 2 + 2 * 3
    assert blocks == sum(math.ceil(o / 128) * math.ceil(i / 128) for o, i in SHAPES)
    per_layer = 3 * 192 * 192 + 192 * 192 + 2 * 320 * 192 + 4 * blocks
    assert _stage(_settings("blockwise", pp=1), 0) == 4 * per_layer


@pytest.mark.parametrize("history", [16, 1024])
def test_delayed_adds_three_amax_histories_per_linear(history):
    """Delayed, pp2: the per-tensor weight (2 bytes an element and a scale) plus, per role (input, weight, output
    gradient), the amax history (``--fp8-amax-history-len`` fp32) and three fp32 scalars (scale, its inverse,
    the step's amax)."""
    per_layer = sum(2 * o * i + 4 + 3 * 4 * (history + 3) for o, i in SHAPES)
    assert _stage(_settings("delayed", history=history), 1) == 2 * per_layer


def test_estimate_reports_the_fp8_term():
    """:func:`omnitron.plan.memory.estimate` carries the term, and without ``--fp8-format`` it is 0."""
    from dataclasses import replace

    from omnitron.plan.memory import estimate

    s = _settings("blockwise", wide=(1, 0))
    got = estimate(s, transients=False)
    assert [m.fp8 for m in got] == [_stage(s, 0), _stage(s, 1)]
    assert _stage(s, 0) * 2 == _stage(s, 1)  # stage 0 holds one FP8 layer, stage 1 two
    assert _stage(replace(s, fp8=None), 1) == 0
