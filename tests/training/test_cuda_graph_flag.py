"""``--cuda-graph-impl local`` / ``--enable-cuda-graph``: parsed with Megatron's spellings, refused with the options
a per-layer graph cannot run with, refused on backends without device graphs, and (through a backend double that
states graph support and records what it is handed) each layer captured once with its call's shapes while the
capture-time code paths run, training the same model as eager. The CUDA replay itself runs in the GPU script.
"""
from __future__ import annotations

import pytest
import torch

from omnitron.core.config import ConfigError

from test_torch_compile import STEPS, _argv


def _settings(*extra: str, world: int = 2):
    from omnitron.core.training.arguments import parse_settings

    return parse_settings(_argv(*extra), world)


@pytest.mark.parametrize("flags", [("--cuda-graph-impl", "local"), ("--enable-cuda-graph",)])
def test_both_spellings_select_the_local_implementation(flags):
    assert _settings(*flags).training.cuda_graph_impl == "local"
    assert _settings().training.cuda_graph_impl == "none"


@pytest.mark.parametrize("extra, names", [
    (("--enable-cuda-graph", "--cuda-graph-impl", "local"), "give one of them"),
    (("--cuda-graph-impl", "transformer_engine"), "use --cuda-graph-impl local"),
    (("--cuda-graph-impl", "local", "--pipeline-model-parallel-size", "2"), "--pipeline-model-parallel-size 1"),
    (("--cuda-graph-impl", "local", "--recompute-granularity", "selective"), "drop --recompute-granularity"),
    (("--cuda-graph-impl", "local", "--torch-compile"), "choose one"),
    (("--cuda-graph-impl", "local", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"), "--fp8-recipe tensorwise"),
    (("--cuda-graph-impl", "local", "--num-experts", "2"), "--moe-expert-capacity-factor"),
])
def test_incompatible_options_are_refused_in_one_line(extra, names):
    with pytest.raises(ConfigError) as err:
        _settings(*extra)
    assert names in str(err.value) and "\n" not in str(err.value)


def test_backends_without_graphs_refuse_naming_the_fix():
    from omnitron.backends import get_backend
    from omnitron.core.capture import capture_layers

    with pytest.raises(ConfigError, match=r"^--cuda-graph-impl local: the cpu backend has no device graphs .*drop "):
        capture_layers([torch.nn.Linear(2, 2)], get_backend("cpu"))


class GraphDouble:
    """The cpu backend stating graph support; ``capture`` records what it is handed and whether the capture-time
    paths were on while it ran the callable once (as a real capture's warm-up does), then returns it."""

    def __init__(self) -> None:
        from omnitron.backends import get_backend

        self.inner, self.captured = get_backend("cpu"), []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def capabilities(self):
        from dataclasses import replace

        return replace(self.inner.capabilities(), graph_capture=True)

    def capture(self, fn, sample_args):
        from omnitron.core.capture import in_graph

        with torch.no_grad():
            fn(*sample_args)
        self.captured.append(([tuple(a.shape) for a in sample_args], in_graph(), isinstance(fn, torch.nn.Module)
                              and len(list(fn.parameters())) > 0))
        return fn


def _losses(root: str, backend, *extra: str) -> list[float]:
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    torch.set_num_threads(1)
    res = train(parse_settings(_argv("--data-cache-path", root + "/cache", *extra), 1), backend)
    return [res["losses"][i] for i in sorted(res["losses"])]


def test_each_layer_is_captured_once_and_trains_as_eager(tmp_path):
    """2 layers x 2 micro-batches x 3 steps: 2 captures (one per layer, at its first training call, with the
    capture-time paths on and the layer's parameters in the captured module); the double replays by running the
    callable, so the losses are eager's exactly (same ops in the same order)."""
    from omnitron.backends import get_backend

    eager = _losses(str(tmp_path / "eager"), get_backend("cpu"))
    double = GraphDouble()
    captured = _losses(str(tmp_path / "graphs"), double, "--enable-cuda-graph")
    assert captured == eager and len(set(eager)) == STEPS
    assert double.captured == [([(16, 2, 32)], True, True)] * 2
