"""``--cuda-graph-impl local`` / ``--enable-cuda-graph``: parsed with Megatron's spellings, refused with the options
a per-layer graph cannot run with, refused on backends without device graphs, and (through a backend double that
states graph support and records what it is handed) each layer captured once with its call's shapes while the
capture-time code paths run, training the same model as eager. The CUDA replay itself runs in the GPU script.
"""
from __future__ import annotations

import pytest
import torch

from omnitron.core.config import ConfigError

from test_torch_compile import REL, STEPS, _argv


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
    (("--cuda-graph-impl", "local", "--torch-compile", "--num-experts", "2", "--moe-expert-capacity-factor", "1.0"),
     "drop --torch-compile"),
    (("--cuda-graph-impl", "local", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"), "--fp8-recipe tensorwise"),
    (("--cuda-graph-impl", "local", "--num-experts", "2"), "--moe-expert-capacity-factor"),
    (("--cuda-graph-impl", "local", "--context-parallel-size", "2", "--attention-dropout", "0.1"),
     "--attention-dropout 0"),
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
    paths were on while it ran the callable's forward and backward once as a real capture's warm-up does
    (``torch.cuda.make_graphed_callables``: grad enabled, ``autograd.grad`` to the inputs and parameters, so
    nothing accumulates into ``.grad``), then returns it."""

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

        wrt = [a for a in sample_args if a.requires_grad] + [p for p in fn.parameters() if p.requires_grad]
        torch.autograd.grad(fn(*sample_args).square().sum(), wrt)
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



FP8 = ("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise")


@pytest.mark.parametrize("fp8, rel", [(FP8, 2e-3), pytest.param((), REL, marks=pytest.mark.slow)],
                         ids=["fp8-tensorwise", "fp32"])
def test_compiled_layers_are_captured_once_and_train_as_eager(tmp_path, monkeypatch, fp8, rel):
    """--torch-compile with --cuda-graph-impl local (the A/B the GPU script runs): what each layer's capture is
    handed is its COMPILED forward (one dynamo graph for both layers, traced in the first capture's warm-up with
    the FP8 weight re-quantized in the graph, never again: 2 layers x 2 micro-batches x 3 steps and the warm-ups
    all reuse it), each layer captured once with the capture-time paths on, and eager's losses. NOTE: the bounds
    are test_torch_compile.py's: REL (fp32: the compiled references reduce in another float32 order) and, with
    FP8, its FP8 layer test's 2e-3 (that reordering moves ~1e-5 of the elements across an FP8 rounding boundary,
    one FP8 step each, carried into the loss with condition ~1); a lost scale or cast moves the loss by O(1)."""
    from torch._dynamo.utils import counters

    from omnitron.backends import get_backend

    monkeypatch.setenv("OMNITRON_TORCH_COMPILE_BACKEND", "aot_eager")
    eager = _losses(str(tmp_path / "eager"), get_backend("cpu"), *fp8)
    torch._dynamo.reset()
    counters.clear()
    double, graphs_at_capture = GraphDouble(), []
    capture = double.capture
    double.capture = lambda fn, args: (capture(fn, args), graphs_at_capture.append(
        int(counters["stats"]["unique_graphs"])))[0]
    captured = _losses(str(tmp_path / "graphs"), double, "--cuda-graph-impl", "local", "--torch-compile", *fp8)
    assert captured == pytest.approx(eager, rel=rel), (captured, eager)
    assert double.captured == [([(16, 2, 32)], True, True)] * 2
    assert graphs_at_capture == [1, 1] and int(counters["stats"]["unique_graphs"]) == 1


def _bert_run(root: str, backend, *extra: str) -> tuple[list[float], list[float]]:
    """(training losses, validation losses) of a 2-layer BERT (BertLayer: ``forward(x, padding_mask)``) that
    validates after each of its 2 steps."""
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    argv = ["--model", "bert_tiny", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--ffn-hidden-size", "128", "--seq-length", "32", "--max-position-embeddings", "32", "--mock-data",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--num-workers", "0", "--no-tensorboard", "--train-iters", "2",
            "--eval-interval", "1", "--eval-iters", "1", "--data-cache-path", root + "/cache", "--seed", "7", *extra]
    torch.set_num_threads(1)
    res = train(parse_settings(argv, 1), backend)
    return [res["losses"][i] for i in sorted(res["losses"])], [v["val_loss"] for v in res["validation"]]


def test_bert_layers_are_captured_with_their_padding_mask_and_validate_eagerly(tmp_path):
    """BERT's layers (also T5's encoder's and the vision encoder's) take ``(x, padding_mask)``: each is captured
    once with the mask as its second input, and validation runs the eager forward with the mask (it was handed
    a third argument: TypeError at the first evaluation). Losses: eager's exactly (the double replays by running
    the callable: the same ops in the same order)."""
    from omnitron.backends import get_backend

    eager = _bert_run(str(tmp_path / "eager"), get_backend("cpu"))
    double = GraphDouble()
    captured = _bert_run(str(tmp_path / "graphs"), double, "--cuda-graph-impl", "local")
    assert captured == eager and len(eager[1]) == 3
    assert double.captured == [([(32, 2, 64), (2, 32)], True, True)] * 2
