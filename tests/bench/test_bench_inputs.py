"""What ``omnitron bench`` measures, against independent definitions: the byte sizes its flags parse (binary units,
as nccl-tests' ``-b 1K``), the GEMM shapes of a preset's layer (the model's own weights), and the unfused attention
it times against the fused one (the definition in float64)."""
from __future__ import annotations

import random

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.bench import attention, gemm
from omnitron.commands.bench import _bytes
from omnitron.core.models.family import get_family
from omnitron.core.models.gpt.model import GPTModel
from omnitron.core.parallel.groups import ParallelGroups


def test_byte_flags_are_binary_units():
    """``--min-bytes 3K`` is 3 x 2^10 bytes (nccl-tests' units), with or without ``B`` / ``iB``, any case; a plain
    number is bytes."""
    rng = random.Random()
    for _ in range(50):
        n, power = rng.randint(1, 4096), rng.randint(0, 3)
        unit = "" if power == 0 else "KMG"[power - 1]
        tail = rng.choice(["", "b", "B", "ib", "iB"]) if unit else ""
        text = f"{n}{rng.choice([unit.lower(), unit])}{tail}"
        assert _bytes(text) == n * 1024 ** power, text
    assert _bytes("1.5K") == 1536


@pytest.mark.parametrize("preset", ["llama_tiny", "gpt2_tiny"])
def test_model_gemm_shapes_are_the_layers_weights(preset):
    """``bench gemm --model P``: each (m, n, k) is ``[tokens, k] @ [k, n]`` with ``[n, k]`` the weight of that linear
    in the model the preset builds (llama_tiny: grouped-query attention and SwiGLU, whose fc1 is two halves);
    the weight-gradient GEMM of fc1 is ``[fc1, tokens] @ [tokens, h]``."""
    tokens = random.randint(1, 4096)
    model = GPTModel(get_family("gpt").presets[preset](), ParallelGroups.single(), backend=get_backend("cpu"))
    layer = dict(model.named_parameters())
    weight = {name: tuple(layer[f"decoder.layers.0.{path}.weight"].shape) for name, path in
              (("qkv", "self_attention.linear_qkv"), ("proj", "self_attention.linear_proj"), ("fc1", "mlp.linear_fc1"),
               ("fc2", "mlp.linear_fc2"))}
    want = {f"{preset}:{name}": (tokens, n, k) for name, (n, k) in weight.items()}
    want[f"{preset}:fc1-wgrad"] = (weight["fc1"][0], weight["fc1"][1], tokens)
    assert {name: (m, n, k) for name, m, n, k in gemm.model_shapes(preset, tokens)} == want


@pytest.mark.parametrize("causal", [True, False])
def test_unfused_attention_is_attention(causal):
    """The ``math`` row's attention equals softmax(q k^T / sqrt(d), causal mask) v in float64 on fresh inputs.
    Bound: fp32 scores of d = 16 terms err by at most ~d u sum|q_i k_i| / sqrt(d) ~ 16 x 6e-8 x 2.5 = 2.4e-6 for
    unit normals; softmax turns that into a relative error of about twice it in each weight, and the weighted sum
    of |v| <= ~4 adds a few u: ~2e-5 in the worst entry. 1e-4 leaves 5x; a mask off by one position moves
    entries by ~0.1."""
    b, h, s, d = 2, 3, 12, 16
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    scores = q.double() @ k.double().transpose(-1, -2) / d ** 0.5
    if causal:
        future = torch.arange(s)[None, :] > torch.arange(s)[:, None]
        scores = scores.masked_fill(future, float("-inf"))
    want = torch.softmax(scores, -1) @ v.double()
    torch.testing.assert_close(attention._math(q, k, v, causal).double(), want, atol=1e-4, rtol=0)
