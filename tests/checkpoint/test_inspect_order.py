"""``checkpoint inspect`` lists tensors in natural order: layer 10 after layer 9 (not after layer 1)."""
from __future__ import annotations

import random

from omnitron.commands.checkpoint import _natural


def test_tensor_names_sort_by_their_numbers():
    """Random layer and expert numbers up to 120 with random parts: layers come in the order of their numbers, and
    within a layer its experts (compared as integers; the reference: the numbers parsed from the names)."""
    rng = random.Random()
    parts = ["self_attention.linear_qkv.weight", "mlp.linear_fc1.weight", "input_layernorm.weight"]
    names = {f"decoder.layers.{rng.randint(0, 120)}.mlp.experts.{rng.randint(0, 120)}.{rng.choice(parts)}"
             for _ in range(60)} | {f"decoder.layers.{rng.randint(0, 120)}.{rng.choice(parts)}" for _ in range(60)}

    got = sorted(names, key=_natural)
    layers = [int(n.split(".")[2]) for n in got]
    assert layers == sorted(layers)
    for layer in set(layers):  # within a layer: experts by number
        experts = [int(n.split(".")[5]) for n in got if n.split(".")[2] == str(layer) and ".experts." in n]
        assert experts == sorted(experts), layer
