"""``--torch-compile``: each transformer layer compiled once (regional), traced without graph breaks, reused by
every layer, micro-batch and pipeline chunk, and training the same model as eager.

Tracing checks use dynamo's ``aot_eager`` backend (the forward and backward graphs dynamo and AOTAutograd
build, run op by op): what is tested is the capture, not inductor's code generation, which takes minutes on
a loaded 2-core machine (the inductor variant is marked slow).
"""
from __future__ import annotations

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.core.config import ConfigError
from omnitron.testing.distributed import run_distributed
from omnitron.testing.parity import relative_error

STEPS = 3

# Eager and compiled runs differ only in the order of float32 sums: eager runs the C++ kernels (LayerNorm,
# bias-GeLU, bias-dropout-add), the compiled layers their plain-torch references, which reduce the same n = 32
# (hidden) terms in another order: ~sqrt(n) u = 3.4e-7 relative per reduction (u = 2^-24, random-rounding
# model), inherited by the loss and gradients with condition ~1 (d on the first loss). As in
# test_loop_3d.py's bound for the same optimizer settings (AdamW, lr 1e-2, clipping at 1.0, ~2.6e4
# parameters), each step adds at most lr sqrt(N) d ||g|| / loss ~ 1.3e-7 + d from the clip factor: over 3
# steps d + 3 (1.3e-7 + d) ~ 1.8e-6. REL leaves ~5x; a compiled layer computing something else (a dropped
# bias, a wrong collective) moves the losses by 1e-3 or more.
REL = 1e-5


def _argv(*extra: str) -> list[str]:
    """GPT-2 flavour (LayerNorm, GeLU, learned positions, tied embeddings): 2 layers, 2 micro-batches per step."""
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
            "--seq-length", "16", "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "96", "--num-workers", "0", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", str(STEPS), "--eval-interval", "0", "--optimizer", "adam",
            "--lr", "1e-2", "--clip-grad", "1.0", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--log-interval", "1", "--no-tensorboard", "--seed", "1234", *extra]


def _train(root: str, world: int, *extra: str) -> tuple[list[float], int]:
    """(losses per step, graphs dynamo compiled in this process) of ``omnitron train`` with ``extra`` flags."""
    from torch._dynamo.utils import counters

    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    torch.set_num_threads(1)
    torch._dynamo.reset()
    counters.clear()
    res = train(parse_settings(_argv("--data-cache-path", root + "/cache", *extra), world), get_backend())
    return [res["losses"][i] for i in sorted(res["losses"])], int(counters["stats"]["unique_graphs"])


def _layer(groups=None, **overrides):
    """A one-layer GPT model on this process's backend (one process unless ``groups``); every fused op resolved,
    as compile_layers does."""
    from omnitron.backends import get_backend
    from omnitron.core.models.gpt import GPTModel, gpt2_tiny
    from omnitron.core.parallel.groups import ParallelGroups

    be = get_backend()
    shape = dict(vocab_size=61, num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=8)
    cfg = gpt2_tiny(**{**shape, **overrides})
    model = GPTModel(cfg, groups or ParallelGroups.single(), seed=3, backend=be)
    be.kernels.table()
    return model.to(be.current_device()), be


LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", num_query_groups=2,
             add_bias_linear=False)


@pytest.mark.parametrize("flavour", [dict(hidden_dropout=0.1, attention_dropout=0.1), dict(LLAMA, hidden_dropout=0.0,
                                     attention_dropout=0.0)], ids=["gpt2-dropout", "llama"])
def test_a_layer_traces_without_graph_breaks(flavour):
    """Default kernel table (the C++ kernels are preferred on cpu) and dropout drawn inside the layer."""
    model, be = _layer(**flavour)
    x = torch.randn(8, 2, 32, device=be.device(), requires_grad=True)
    freqs = model._rope_freqs(None, 8, x.device) if flavour.get("position_embedding_type") == "rope" else None
    explained = torch._dynamo.explain(model.decoder.layers["0"])(x, freqs)
    assert explained.graph_break_count == 0, [str(b.reason).splitlines()[0] for b in explained.break_reasons]


@pytest.mark.parametrize("recompute", [(), ("--recompute-granularity", "selective")], ids=["plain", "selective"])
def test_compiled_training_matches_eager_and_compiles_one_graph(tmp_path, monkeypatch, recompute):
    """Selective recomputation checkpoints core attention INSIDE the compiled layer."""
    monkeypatch.setenv("OMNITRON_TORCH_COMPILE_BACKEND", "aot_eager")
    eager, graphs = _train(str(tmp_path / "eager"), 1, *recompute)
    assert graphs == 0 and len(set(eager)) == STEPS
    compiled, graphs = _train(str(tmp_path / "compiled"), 1, "--torch-compile", *recompute)
    assert compiled == pytest.approx(eager, rel=REL), (compiled, eager)
    # 2 layers x 2 micro-batches x 3 steps ran through ONE graph: no recompilation after the first call
    assert graphs == 1


def test_compiled_fp16_training_matches_eager_in_one_graph(tmp_path, monkeypatch):
    """--fp16 (activations in half precision, fp32 master weights, the dynamic loss scaler outside the layers).
    NOTE: the compiled layer's norms and activations (plain-torch references) and eager's C++ kernels both compute
    in fp32 and round to fp16; they differ by fp32 reordering (~3.4e-7 relative, REL's analysis), which moves a
    fraction ~3.4e-7 / 2^-11 ~ 7e-4 of the elements across an fp16 rounding boundary, one fp16 step (2^-11
    relative) each: norm-wise sqrt(7e-4) 2^-11 ~ 1.3e-5 per layer's output, two layers, carried into the loss with
    condition ~1 and, through the steps, as REL's analysis carries its d: ~3 x 2.6e-5 ~ 8e-5. FP16_REL = 3e-4 leaves
    ~4x; a layer computing another function (a lost cast to fp16, a dropped bias) moves the losses by 1e-3 or more."""
    monkeypatch.setenv("OMNITRON_TORCH_COMPILE_BACKEND", "aot_eager")
    eager, _ = _train(str(tmp_path / "eager"), 1, "--fp16")
    compiled, graphs = _train(str(tmp_path / "compiled"), 1, "--torch-compile", "--fp16")
    assert compiled == pytest.approx(eager, rel=3e-4) and graphs == 1, (compiled, eager, graphs)
    assert len(set(eager)) == STEPS


MOE_AUX = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--fp16",
           "--train-iters", "6")


def test_compiled_moe_with_a_load_balancing_loss_under_fp16_keeps_its_graphs(tmp_path, monkeypatch):
    """MoE with a load-balancing loss and the dynamic loss scaler (--fp16), which backs off at each of the first
    steps' overflows: the expert counts have a fixed size (a data-dependent bincount broke the graph at each
    router use) and the aux-loss gradient weight (loss scale / micro-batches) is a tensor input of the graph (a
    float attribute was a guarded constant: a recompilation at every new loss scale, 17 graphs in 6 steps and
    eager after dynamo's limit of 8). 5 graphs: eager's exchange splits the layer into 4 (the ep2 test) and
    the first micro-batch of a step (no logged aux loss yet) has its own. NOTE: losses within the fp16 test's
    bound above (3e-4, the same fp32 reordering carried through fp16 rounding); the router's top-2 picks could
    only flip on a logit gap below ~1e-5 relative, which these 64 tokens per micro-batch do not come near."""
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    monkeypatch.setenv("OMNITRON_TORCH_COMPILE_BACKEND", "aot_eager")
    eager, _ = _train(str(tmp_path / "eager"), 1, *MOE_AUX)
    compiled, graphs = _train(str(tmp_path / "compiled"), 1, "--torch-compile", *MOE_AUX)
    assert compiled == pytest.approx(eager, rel=3e-4) and graphs == 5, (compiled, eager, graphs)
    # the loss scale moved (its back-off is what recompiled): a step's scale is not the first one's
    settings = parse_settings(_argv("--data-cache-path", str(tmp_path / "cache"), *MOE_AUX), 1)
    scaler = train(settings, get_backend())["components"].optimizer.loss_scaler
    assert scaler.scale < settings.precision.initial_loss_scale, scaler.scale


def test_expert_counts_are_bincounts():
    """The fixed-size expert counts (compiled layers) against ``torch.bincount`` on random picks, exact: small
    integers in float32."""
    from omnitron.core.transformer.moe.router import expert_counts

    experts = torch.randint(0, 7, (50, 3))
    want = torch.bincount(experts.reshape(-1), minlength=9).double()
    assert torch.equal(expert_counts(experts, 9, torch.float32).double(), want)


def test_recomputation_inside_a_compiled_region_keeps_the_dropout_mask():
    """omnitron's checkpoint traced by dynamo: the gradient flows exactly where the forward kept elements."""
    from omnitron.core.parallel.tensor.random import checkpoint

    def region(x):
        return torch.nn.functional.dropout(x, 0.5, training=True) * 3.0

    x = torch.randn(4096, requires_grad=True)
    y = torch.compile(lambda t: checkpoint(region, None, t), backend="aot_eager")(x)
    (grad,) = torch.autograd.grad(y.sum(), x)
    kept = y != 0  # x is continuous: a kept element is nonzero with probability 1
    assert 0.4 < kept.float().mean() < 0.6  # 4096 draws of p = 0.5: sd 0.008, so +-0.1 is 12 sd
    assert torch.equal(grad, kept.float() * 3.0 / 0.5)  # exact: one multiply of representable values


@pytest.mark.parametrize("recipe", ["tensorwise", pytest.param("blockwise", marks=pytest.mark.slow)])
def test_an_fp8_layer_traces_whole_and_matches_eager(recipe):
    """Emulated FP8 (cpu): amax, scale, casts and the GEMMs of every linear in one graph with the layer."""
    from omnitron.core.compile import compile_layers
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.precision.fp8 import enable_fp8
    from omnitron.core.precision.fp8.config import FP8Config

    model, be = _layer(hidden_size=128, ffn_hidden_size=256, seq_length=128, hidden_dropout=0.0,
                       attention_dropout=0.0)  # 128: the block-wise recipe's tile
    enable_fp8([model], FP8Config(fp8_recipe=recipe), ParallelGroups.single(), num_layers=1, backend=be)
    layer, x = model.decoder.layers["0"], torch.randn(128, 2, 128, device=be.device(), requires_grad=True)
    explained = torch._dynamo.explain(layer)(x, None)
    assert explained.graph_break_count == 0, [str(b.reason).splitlines()[0] for b in explained.break_reasons]
    want = layer(x, None)
    (want_grad,) = torch.autograd.grad(want.square().sum(), x)
    compile_layers([model], be, "aot_eager")
    got = layer(x, None)
    (got_grad,) = torch.autograd.grad(got.square().sum(), x)
    # The compiled layer's norms and activations are the references, eager's the C++ kernels: values differ by
    # fp32 reordering, ~1e-6 relative, which moves an element across an e4m3 rounding boundary (spacing 2^-3
    # relative) with probability ~1e-6 / 2^-3 ~ 1e-5; each crossing changes it by one e4m3 step. Norm-wise:
    # <= 2^-3 sqrt(1e-5) = 4e-4 on the quantized operands, carried with condition ~1. 2e-3 leaves 5x; an FP8
    # path that lost a scale or a cast is off by O(1).
    assert relative_error(got, want) < 2e-3 and relative_error(got_grad, want_grad) < 2e-3


def test_blockwise_fp8_on_the_scaled_mm_path_compiles(monkeypatch):
    """On a device whose FP8 GEMM path is ``scaled_mm`` (a GPU; forced here where ``torch._scaled_mm`` runs), the
    block-wise recipe's first GEMM probes the native block-scaled kernel and catches its refusal. Traced, that
    refusal raised out of the compilation (torch 2.11-2.13 refuse the (1,128)x(128,128) scale layout); compiled,
    the GEMMs now run the emulation, the path eager falls back to. Against eager on the same path: the same
    dequantizations and fp32 GEMMs, so only fp32 reordering differs (~sqrt(K) u = 16 x 6e-8 = 1e-6); 1e-5."""
    from omnitron.backends.fp8 import PATH_ENV, FP8Provider, scaled_mm_runs
    from omnitron.core.precision.fp8 import FP8Config, FP8Linear

    be = get_backend()
    if not scaled_mm_runs(be.device()):
        pytest.skip(f"torch._scaled_mm does not run on {be.device()}")
    monkeypatch.setenv(PATH_ENV, "scaled_mm")
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ())))
    x = torch.randn(128, 256, generator=g).to(be.device()).requires_grad_()
    w = (torch.randn(128, 256, generator=g) * 0.05).to(be.device()).requires_grad_()
    outs = []
    for compiled in (False, True):
        ex = FP8Linear(FP8Config(fp8_recipe="blockwise", fp8_format="hybrid"), FP8Provider(be))
        fn = torch.compile(lambda x, w: ex(x, w, None), backend="aot_eager", fullgraph=True) if compiled else ex
        y = fn(x, w)
        outs.append((y, *torch.autograd.grad(y.square().sum(), (x, w))))
    for want, got in zip(*outs):
        assert relative_error(got, want) < 1e-5


def _delayed_fp8_steps(compiled: bool, steps: int = 3) -> list:
    """A one-layer GPT with delayed-scaling FP8 updated once per step (as training does: ``per_step``) run for
    ``steps`` steps of one use each: per step, the output, the input gradient and every role's history."""
    from omnitron.core.compile import compile_layers
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.precision.fp8 import enable_fp8
    from omnitron.core.precision.fp8.config import FP8Config
    from omnitron.core.precision.fp8.enable import fp8_step

    model, be = _layer(hidden_dropout=0.0, attention_dropout=0.0)
    enabled = enable_fp8([model], FP8Config(fp8_recipe="delayed"), ParallelGroups.single(), num_layers=1,
                         backend=be, per_step=True)
    layer, outs = model.decoder.layers["0"], []
    if compiled:
        compile_layers([model], be, "aot_eager")
    for i in range(steps):
        x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(i)).to(be.device()).requires_grad_()
        y = layer(x, None)
        outs.append((y, torch.autograd.grad(y.square().sum(), x)[0]))
        fp8_step(enabled)
        outs[-1] += tuple(ex.states[r].amax_history.clone() for ex in enabled.values() for r in ex.states)
    return outs


def test_delayed_fp8_layer_traces_whole_and_matches_eager():
    """The delayed recipe for the compiler: no graph break (the scale and history change at the step boundary,
    outside the layer; a use only max-accumulates its amax into a buffer, in place) and two graphs, the first
    step's (no history: current scaling) and every later step's (the scale in force; step 3 recompiles nothing);
    the same outputs, input gradients and amax histories as eager, step after step.
    NOTE: outputs and gradients: the tensorwise test's bound above (2e-3: fp32 reordering moving an element
    across an FP8 rounding boundary). Histories: an amax is a max of values computed in another fp32 order,
    ~1e-6 relative (the input's and the weight's exact); 1e-5 leaves 10x. A scale or history update lost or
    doubled changes the next step's scale by the ratio of two steps' amaxes, O(10%)."""
    from torch._dynamo.utils import counters

    want = _delayed_fp8_steps(False)
    torch._dynamo.reset()
    counters.clear()
    got = _delayed_fp8_steps(True)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    for step, (g, w) in enumerate(zip(got, want)):
        assert relative_error(g[0], w[0]) < 2e-3 and relative_error(g[1], w[1]) < 2e-3, step
        for gh, wh in zip(g[2:], w[2:]):
            torch.testing.assert_close(gh, wh, rtol=1e-5, atol=0), step
    assert not torch.equal(got[-1][2], got[0][2])  # the histories moved


FP8_DELAYED = ("--fp8-format", "hybrid", "--fp8-recipe", "delayed")


@pytest.mark.slow
def test_compiled_delayed_fp8_training_matches_eager_at_tp1_and_tp2(tmp_path, monkeypatch):
    """Training with delayed scaling (one amax reduction and history push per step, at the step's end, outside
    the compiled layers): two graphs per process (the first step's, no history; every later step's) and eager's
    losses, at tp1 and at tp2 with sequence parallelism. NOTE: the bound is the FP8 layer test's (2e-3): the
    only difference is fp32 reordering moving an element across an FP8 rounding boundary (~1e-5 of the
    elements, one FP8 step each), inherited by the loss with condition ~1; lost or repeated scale updates change
    the scales by O(10%) and the losses by more than the bound within 3 steps only where they also change FP8's
    rounding (the graph count and the layer test's exact histories catch the rest)."""
    monkeypatch.setenv("OMNITRON_TORCH_COMPILE_BACKEND", "aot_eager")
    eager, _ = _train(str(tmp_path / "eager"), 1, *FP8_DELAYED)
    compiled, graphs = _train(str(tmp_path / "compiled"), 1, "--torch-compile", *FP8_DELAYED)
    assert compiled == pytest.approx(eager, rel=2e-3) and graphs == 2, (compiled, eager, graphs)
    tp2 = ("--tensor-model-parallel-size", "2", "--sequence-parallel", *FP8_DELAYED)
    want = run_distributed(_train, 2, str(tmp_path / "tp2"), 2, *tp2, timeout_s=600)
    got = run_distributed(_train, 2, str(tmp_path / "tp2c"), 2, "--torch-compile", *tp2, timeout_s=600)
    for rank, ((w, _), (g, graphs)) in enumerate(zip(want, got)):
        assert g == pytest.approx(w, rel=2e-3) and graphs == 2, (rank, g, w, graphs)


def _tp2_graph_breaks() -> dict:
    """Graph-break reasons of one tensor-parallel layer (with dropout) on this worker's rank, without and with
    sequence parallelism, and of one context-parallel layer (the ring; one spawn for all three)."""
    out = {sp: _layer_graph_breaks(dict(tensor_model_parallel_size=2, sequence_parallel=sp), 4 if sp else 8)
           for sp in (False, True)}
    out["cp2"] = _layer_graph_breaks(dict(context_parallel_size=2), 4)  # attention dropout: the hash's seed op
    return out


def _layer_graph_breaks(parallel: dict, seq: int, **dropout) -> list[str]:
    from omnitron.backends import get_backend
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups

    groups = ParallelGroups.build(ParallelConfig(**parallel), backend=get_backend())
    model, _ = _layer(groups, **(dropout or DROPOUT))  # training mode: dropout of split tensors inside the graph too
    x = torch.randn(seq, 2, 32, device=get_backend().device(), requires_grad=True)
    explained = torch._dynamo.explain(model.decoder.layers["0"])(x, None)
    return [str(b.reason).splitlines()[0] for b in explained.break_reasons] + [""] * explained.graph_break_count


DROPOUT = dict(hidden_dropout=0.2, attention_dropout=0.2)


def _tp_layer_with_dropout(tp: int, sp: bool, compiled: bool = True,
                           seed: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, input gradient) of one training-mode layer with dropout on this rank's slice (``sp``) or all of a
    fixed input, the default generator seeded identically on every rank just before the call (aot_eager runs
    the graph's random draws op by op on that generator)."""
    from omnitron.backends import get_backend
    from omnitron.core.compile import compile_layers
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups

    groups = None if tp == 1 else ParallelGroups.build(
        ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp), backend=get_backend())
    model, be = _layer(groups, **DROPOUT)
    model.train()
    if compiled:
        compile_layers([model], be, "aot_eager")
    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(7)).to(be.device())
    rank = torch.distributed.get_rank() if tp > 1 else 0
    x = (x.chunk(tp)[rank] if sp else x).clone().requires_grad_(True)
    be.manual_seed(seed)  # the generator the layer's dropout draws from: the backend device's
    y = model.decoder.layers["0"](x, None)
    return y.detach(), torch.autograd.grad(y.square().sum(), x)[0]


def _dropout_tp2_against_tp1() -> dict:
    """This rank's (got, want) relative errors: tp2 and tp2 + sp compiled layers against the compiled tp1 layer's
    matching slice, all with dropout."""
    rank, out = torch.distributed.get_rank(), {}
    want_y, want_g = _tp_layer_with_dropout(1, False)
    for sp in (False, True):
        got = _tp_layer_with_dropout(2, sp)
        want = (want_y.chunk(2)[rank], want_g.chunk(2)[rank]) if sp else (want_y, want_g)
        out[sp] = [relative_error(g, w) for g, w in zip(got, want)]
    return out


@pytest.mark.slow
def test_dropout_at_tp2_draws_the_unsplit_layers_masks():
    """Dropout of split tensors (local heads; sequence shards under sp) inside a compiled layer: each rank keeps its
    slice of one full-shape draw, so the tp2 layer computes the tp1 layer with the same masks. NOTE: the only
    differences left are fp32 sums split over two ranks (the row-parallel partial sums, the sp all-gather's order),
    ~sqrt(n) u = 4.5e-7 per reduction of n <= 64 terms, a handful chained with condition ~1: < 1e-5. A rank reusing
    another's mask, or an unsliced mask, changes ~p = 20% of the elements: O(0.1) relative."""
    for rank, res in enumerate(run_distributed(_dropout_tp2_against_tp1, 2)):
        for sp, errors in res.items():
            assert max(errors) < 1e-5, (rank, sp, errors)


def test_compiled_dropout_is_the_eager_layer_with_the_same_masks(monkeypatch):
    """tp1, aot_eager: the compiled layer against the eager layer run through the same explicit-mask path (forced);
    bound as REL above (C++ kernels eager, references compiled; same masks from the same generator)."""
    from omnitron.core.parallel.tensor.random import RNGTracker

    got = _tp_layer_with_dropout(1, False)
    monkeypatch.setattr(RNGTracker, "in_graph", staticmethod(lambda: True))
    want = _tp_layer_with_dropout(1, False, compiled=False)
    assert relative_error(got[0], want[0]) < REL and relative_error(got[1], want[1]) < REL
    # the masks matter: other masks (another seed) move the output by ~7e-3 (the residual dominates at init)
    assert relative_error(got[0], _tp_layer_with_dropout(1, False, compiled=False, seed=12)[0]) > 100 * REL


def test_a_tensor_or_context_parallel_layer_traces_its_collectives():
    """The all-reduce (tp2) and all-gather / reduce-scatter (tp2 with sequence parallelism) of a layer are
    functional collectives inside its graph, and dropout of split tensors draws explicit masks (no RNG fork); the
    ring attention's exchanges (cp2) are functional all-to-alls (was: 8 graphs, split at each point-to-point) and its
    attention dropout's seed an op in the graph (was: 3 breaks at the host-side draw)."""
    for rank, breaks in enumerate(run_distributed(_tp2_graph_breaks, 2)):
        assert breaks == {False: [], True: [], "cp2": []}, (rank, breaks)


def _cp_layer_calls(compiled: bool, selective: bool) -> tuple[list[torch.Tensor], int, dict]:
    """Outputs and input gradients of two training-mode calls of one cp2 layer with attention (hash) and hidden
    dropout on this rank's rows, the default generator seeded alike on every rank; the graphs dynamo compiled
    and its graph breaks. Eager runs the explicit hidden-dropout masks the compiled layer draws (forced)."""
    from torch._dynamo.utils import counters

    from omnitron.backends import get_backend
    from omnitron.core.compile import compile_layers
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.parallel.tensor.random import RNGTracker

    torch._dynamo.reset()
    counters.clear()
    groups = ParallelGroups.build(ParallelConfig(context_parallel_size=2), backend=get_backend())
    model, be = _layer(groups, **DROPOUT, seq_length=16, recompute_granularity="selective" if selective else None)
    model.train()
    if compiled:
        compile_layers([model], be, "aot_eager")
    saved, RNGTracker.in_graph = RNGTracker.in_graph, staticmethod(lambda: True)
    try:
        be.manual_seed(5)
        x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(7 + groups.cp.rank)).to(be.device())
        out = []
        for _ in range(2):  # the second call draws a new seed from the stream: other masks, the same graph
            x_ = x.clone().requires_grad_(True)
            y = model.decoder.layers["0"](x_, None)
            out += [y.detach(), torch.autograd.grad(y.square().sum(), x_)[0]]
    finally:
        RNGTracker.in_graph = saved
    return out, int(counters["stats"]["unique_graphs"]), dict(counters["graph_break"])


def _cp_compiled_against_eager(settings: tuple[bool, ...]) -> dict:
    """Per recomputation setting (selective or not): this rank's errors, graphs, breaks and call-to-call change."""
    out = {}
    for selective in settings:
        got, graphs, breaks = _cp_layer_calls(True, selective)
        want, _, _ = _cp_layer_calls(False, selective)
        out[selective] = dict(errors=[relative_error(g, w) for g, w in zip(got, want)], graphs=graphs, breaks=breaks,
                              calls_differ=relative_error(got[0], got[2]))
    return out


@pytest.mark.parametrize("selective", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["plain", "selective"])
def test_compiled_cp2_layer_with_attention_dropout_is_the_eager_layer(selective):
    """cp2 ring with attention dropout (the hash masks; was 3 graph breaks at the seed's host-side draw, 6 counted
    by explain): one graph per rank, no break, no recompilation as the seed changes, and each call's output and
    input gradient the eager layer's with the same seeds: the graph's seed op makes eager's draw, so the masks
    are the same bits. Bound as REL above (C++ kernels eager, references compiled; the attention itself is the
    same chunked reference on both sides). The backward's masks are the forward's, also when selective
    recomputation replays the core attention inside the graph (the seed op is saved, not recomputed: recomputed,
    it drew the next seed, and the gradient moved by 4e-3). Each call draws a new seed: calls differ by far more
    than REL."""
    for rank, res in enumerate(run_distributed(_cp_compiled_against_eager, 2, (selective,))):
        for selective, r in res.items():
            assert r["graphs"] == 1 and not r["breaks"], (rank, selective, r)
            assert max(r["errors"]) < REL, (rank, selective, r)
            assert r["calls_differ"] > 100 * REL, (rank, selective, r)


@pytest.mark.slow
def test_compiled_tp2_pp2_matches_one_eager_process(tmp_path, monkeypatch):
    """tp2 x pp2 with sequence parallelism: the layers' collectives are traced (functional collectives)."""
    monkeypatch.setenv("OMNITRON_TORCH_COMPILE_BACKEND", "aot_eager")
    eager, _ = _train(str(tmp_path / "one"), 1)
    ranks = run_distributed(_train, 4, str(tmp_path / "tp2pp2"), 4, "--tensor-model-parallel-size", "2",
                            "--pipeline-model-parallel-size", "2", "--sequence-parallel", "--torch-compile",
                            timeout_s=600)
    for rank, (losses, graphs) in enumerate(ranks):
        assert losses == pytest.approx(eager, rel=REL), (rank, losses, eager)
        assert graphs == 1, (rank, graphs)  # one layer per stage, every micro-batch and step reuses its graph


@pytest.mark.slow
@pytest.mark.parametrize("layout, graphs", [(("--context-parallel-size", "2"), 1),
                                            (("--context-parallel-size", "2", "--attention-dropout", "0.2"), 1),
                                            (("--num-experts", "4", "--expert-model-parallel-size", "2"), 4)],
                         ids=["cp2", "cp2-attention-dropout", "ep2"])
def test_compiled_cp2_and_ep2_match_eager_in_counted_graphs(tmp_path, monkeypatch, layout, graphs):
    """cp2: the ring inside the compiled layer (functional all-to-all shifts), one graph per rank (was 8). ep2: the
    MoE token exchange runs eagerly between graphs (``torch.compiler.disable``: its sizes come from the routing),
    4 graphs per rank whatever the routing (the layer and the MoE block, each before and after it; was 61-62,
    recompiled per routing). cp2 with attention dropout: the hash masks are eager's (the graph's seed op makes the
    eager draw), so the losses are eager's within REL too. Eager's losses within REL (the same ops; AOTAutograd's
    decompositions at most reorder fp32 sums)."""
    monkeypatch.setenv("OMNITRON_TORCH_COMPILE_BACKEND", "aot_eager")
    want = run_distributed(_train, 2, str(tmp_path / "eager"), 2, *layout, timeout_s=600)
    got = run_distributed(_train, 2, str(tmp_path / "compiled"), 2, *layout, "--torch-compile", timeout_s=600)
    for rank, ((w, _), (g, n)) in enumerate(zip(want, got)):
        assert g == pytest.approx(w, rel=REL) and n == graphs, (rank, g, w, n)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("--use-distributed-optimizer",), ("--use-torch-fsdp2",)],
                         ids=["dp2-distributed-optimizer", "fsdp2-dp2"])
def test_compiled_data_parallel_matches_eager(tmp_path, monkeypatch, layout):
    """dp2 with the distributed optimizer (its bucketed reduce-scatter hooks on the compiled layers' parameters)
    and FSDP2 (each layer sharded and gathered by its hooks): eager's losses within REL on both ranks (the same
    ops), and one graph a rank for every micro-batch and step (no recompilation as the shards are gathered and
    freed)."""
    monkeypatch.setenv("OMNITRON_TORCH_COMPILE_BACKEND", "aot_eager")
    want = run_distributed(_train, 2, str(tmp_path / "eager"), 2, *layout, timeout_s=600)
    got = run_distributed(_train, 2, str(tmp_path / "compiled"), 2, *layout, "--torch-compile", timeout_s=600)
    for rank, ((w, _), (g, n)) in enumerate(zip(want, got)):
        assert g == pytest.approx(w, rel=REL) and n == 1, (rank, g, w, n)


class NoCompiler:
    """A backend stand-in whose device has no ``torch.compile`` support (cpu's capabilities, compiler None)."""

    name = "nocc"

    def capabilities(self):
        from dataclasses import replace

        from omnitron.backends import get_backend

        return replace(get_backend("cpu").capabilities(), compiler=None)

    def compile_unsupported_reason(self):
        return "no compiler here"


def test_backends_state_their_compiler_and_refusal_is_one_line():
    from omnitron.backends import get_backend
    from omnitron.core.compile import compiler_for

    assert get_backend("cpu").capabilities().compiler == "inductor"
    with pytest.raises(ConfigError, match=r"^--torch-compile: the nocc backend .*\(no compiler here\); drop"):
        compiler_for(NoCompiler())


def test_capture_is_the_eager_callable_where_the_device_has_no_graphs():
    """cpu (and sim, checked in its worker below): ``capture`` hands back the callable itself."""
    from omnitron.backends import get_backend

    be = get_backend("cpu")
    mlp = torch.nn.Linear(4, 4)
    assert be.capabilities().graph_capture is False and be.capture(mlp, (torch.randn(2, 4),)) is mlp


def _sim_layer_eager_and_compiled() -> dict:
    """(eager, compiled) output and input gradient of one layer on this worker's backend, and its compiler."""
    from omnitron.core.compile import compile_layers

    model, be = _layer(hidden_dropout=0.0, attention_dropout=0.0)  # dropout masks would differ
    layer, out = model.decoder.layers["0"], {"compiler": be.capabilities().compiler}
    out["capture_noop"] = not be.capabilities().graph_capture and be.capture(layer, ()) is layer
    x = torch.randn(8, 2, 32).to(be.current_device()).requires_grad_(True)
    for name in ("eager", "compiled"):
        if name == "compiled":
            compile_layers([model], be)
        y = layer(x, None)
        out[name] = (y, torch.autograd.grad(y.square().sum(), x)[0])
    return out


def test_sim_layer_compiles_with_aot_eager_and_matches_eager():
    """sim states aot_eager (inductor cannot lower its PrivateUse1 device); the compiled layer runs the same
    reference ops as eager there, in the same order."""
    (res,) = run_distributed(_sim_layer_eager_and_compiled, 1, backend="sim")
    assert res["compiler"] == "aot_eager" and res["capture_noop"]
    # NOTE: same ops on the same device; AOTAutograd may decompose an op into an equivalent sequence, which
    # moves results by a few fp32 ulps: 1e-6 relative
    for got, want in zip(res["compiled"], res["eager"]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_inductor_compiled_training_matches_eager(tmp_path, monkeypatch):
    """The real code generator (C++/OpenMP on cpu): minutes to build on a loaded 2-core machine."""
    monkeypatch.delenv("OMNITRON_TORCH_COMPILE_BACKEND", raising=False)
    eager, _ = _train(str(tmp_path / "eager"), 1)
    compiled, graphs = _train(str(tmp_path / "compiled"), 1, "--torch-compile")
    assert compiled == pytest.approx(eager, rel=REL), (compiled, eager)
    assert graphs == 1
