"""``--fp8-impl omnitron|torchao``: torchao's Float8Linear math on omnitron's linears, against omnitron's own
tensorwise recipe (same definition: per-tensor current scaling, e4m3 forward, e5m2 gradients under hybrid), and
the one-line refusals."""
from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from omnitron.core.config import ConfigError
from omnitron.core.precision.fp8.config import FP8Config
from omnitron.testing.parity import relative_error


@pytest.mark.parametrize("kw, names", [
    (dict(fp8_impl="te"), "Transformer Engine is not bound"),
    (dict(fp8_impl="apex"), "use one of omnitron, torchao"),
])
def test_unknown_or_unbound_implementations_are_refused(kw, names):
    with pytest.raises(ConfigError, match=names):
        FP8Config(fp8_recipe="tensorwise", **kw)


def test_torchao_refused_when_missing_or_off_recipe_or_sharded(monkeypatch):
    from omnitron.core.precision.fp8.torchao_impl import check_layout

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^--fp8-impl torchao: torchao is not installed; pip install torchao"):
        FP8Config(fp8_recipe="tensorwise", fp8_impl="torchao")
    monkeypatch.undo()
    if real("torchao") is not None:
        with pytest.raises(ConfigError, match="use --fp8-recipe tensorwise"):
            FP8Config(fp8_recipe="blockwise", fp8_impl="torchao")
    with pytest.raises(ConfigError, match="reduces the amax over the shards"):
        check_layout(SimpleNamespace(tp_cp=SimpleNamespace(size=2)))


def test_the_flag_is_parsed_with_the_fp8_settings():
    from omnitron.core.training.arguments import parse_settings

    argv = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            "96", "--micro-batch-size", "2", "--train-iters", "1", "--fp8-format", "hybrid", "--fp8-recipe",
            "tensorwise"]
    assert parse_settings(argv, 1).fp8.fp8_impl == "omnitron"
    with pytest.raises(ConfigError, match="--fp8-impl te"):
        parse_settings(argv + ["--fp8-impl", "te"], 1)


def _layer_out_and_grads(impl: str, fmt: str):
    """A one-layer GPT's output and every gradient (input and parameters) with FP8 linears of ``impl``."""
    from omnitron.backends import get_backend
    from omnitron.core.models.gpt import GPTModel, gpt2_tiny
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.precision.fp8 import enable_fp8

    be = get_backend("cpu")
    cfg = gpt2_tiny(vocab_size=61, num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                    seq_length=8, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(cfg, ParallelGroups.single(), seed=3, backend=be)
    enable_fp8([model], FP8Config(fp8_format=fmt, fp8_recipe="tensorwise", fp8_impl=impl), ParallelGroups.single(),
               num_layers=1, backend=be)
    layer = model.decoder.layers["0"]
    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(5), requires_grad=True)
    y = layer(x, None)
    return y, torch.autograd.grad(y.square().sum(), [x, *layer.parameters()])


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_torchao_layer_matches_omnitrons_tensorwise_recipe(fmt):
    """Both cast the same operands with the same scale (fp8_max / amax, fp32) to the same FP8 values; only the
    fp32 GEMM accumulation order differs: ~sqrt(K) u <= 8 x 6e-8 = 5e-7 relative per GEMM (K <= 64), and 1e-5
    leaves 20x on the output. A gradient element nudged across an FP8 rounding boundary by that 5e-7 (probability
    ~5e-7 / 2^-3 per element, ~1e-3 over the layer's ~1e4 elements) moves by one e5m2 step, 2^-2 relative: at
    most 2^-2 / sqrt(64) = 3e-2 norm-wise on the smallest gradient (64 elements); 2e-3 covers the expected case
    and fails on a wrong scale or format (O(2^-4) = 6e-2 quantization noise or worse)."""
    pytest.importorskip("torchao")
    want_y, want_g = _layer_out_and_grads("omnitron", fmt)
    got_y, got_g = _layer_out_and_grads("torchao", fmt)
    assert relative_error(got_y, want_y) < 1e-5
    assert max(relative_error(g, w) for g, w in zip(got_g, want_g)) < 2e-3
