"""The pipeline runtime in one process (pp = 1): gradient accumulation, forward-only, error grid."""
import os

import pytest
import torch

from omnitron.core.parallel.data import DistributedDataParallel, finalize_model_grads
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.core.parallel.pipeline import PipelineError, forward_backward

S, B, H, M = 5, 3, 6, 4
# The runtime's results against plain torch, both in float64 (u = 2**-53 = 1.1e-16): the same maths in another
# order. A gradient sums <= M x S x B = 60 token products plus the M micro-batch partial sums (and H = 6-term
# contractions), a loss <= 60 masked token losses: reordering n <= 64 terms moves a sum by <= n u = 7e-15 of the
# sum of its terms' magnitudes, which cancellation between signs can make a few times the value. REL = 1e-12
# leaves a factor > 10 over that worst case; ABS = 1e-14 covers entries whose value cancels to ~0 (terms of
# order 1: 64 u = 7e-15). What it catches that the float32 bounds (1e-5 / 1e-6) did not: a micro-batch weighted
# 1 / M +- 1e-6, a token counted with a weight off by 1e-6, a loss scale rounded to float32.
REL, ABS = 1e-12, 1e-14


def _model():
    """A float64 two-layer MLP (the same initial weights on every call)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.Tanh(), torch.nn.Linear(H, H)).double()


def _data():
    """M float64 micro-batches with a random loss mask (fresh random values, fixed seed)."""
    g = torch.Generator().manual_seed(3)
    f64 = torch.float64
    return [{"x": torch.randn(S, B, H, generator=g, dtype=f64), "y": torch.randn(S, B, H, generator=g, dtype=f64),
             "loss_mask": (torch.rand(S, B, generator=g) > 0.3).double()} for _ in range(M)]


def _step(chunk, batch, hidden):
    assert hidden is None
    return ((chunk(batch["x"]) - batch["y"]) ** 2).mean(-1)  # per-token loss [s, b]


def test_gradient_accumulation_matches_float64_reference():
    groups = ParallelGroups.single()
    model = DistributedDataParallel(_model(), groups)
    model.zero_grad_buffer()
    out = forward_backward(None, [model], iter(_data()), groups, num_microbatches=M, seq_length=S,
                           micro_batch_size=B, hidden_size=H, forward_step_fn=_step)
    finalize_model_grads([model], groups)
    ref = _model()
    means = []
    for d in _data():
        per_tok = ((ref(d["x"].double()) - d["y"].double()) ** 2).mean(-1)
        mean = (per_tok * d["loss_mask"]).sum() / d["loss_mask"].sum()  # masked tokens do not count
        (mean / M).backward()
        means.append(mean.item())
    assert out["schedule"].name == "none"
    assert out["loss"] == pytest.approx(sum(means) / M, rel=REL)
    assert out["tokens"] == sum(d["loss_mask"].sum().item() for d in _data())
    for p, r in zip(model.module.parameters(), ref.parameters()):
        assert p.grad is None  # moved into main_grad by the hook
        assert p.main_grad.dtype == torch.float64
        torch.testing.assert_close(p.main_grad, r.grad, rtol=REL, atol=ABS)
    # forward-only: same loss, no gradients touched
    before = [p.main_grad.clone() for p in model.module.parameters()]
    ev = forward_backward(None, [model], iter(_data()), groups, num_microbatches=M, seq_length=S,
                          micro_batch_size=B, hidden_size=H, forward_step_fn=_step, forward_only=True)
    assert ev["loss"] == pytest.approx(out["loss"], rel=REL)
    assert all(torch.equal(a, p.main_grad) for a, p in zip(before, model.module.parameters()))


def test_failure_reports_rank_step_and_grid():
    groups = ParallelGroups.single()
    calls = []

    def bad_step(chunk, batch, hidden):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("boom")
        return _step(chunk, batch, hidden)

    with pytest.raises(PipelineError) as err:
        forward_backward("none", [_model()], iter(_data()), groups, num_microbatches=M, seq_length=S,
                         micro_batch_size=B, hidden_size=H, forward_step_fn=bad_step)
    msg = str(err.value)
    assert "pipeline rank 0 failed at step 4 (0F2): ValueError: boom" in msg
    assert "step     r0" in msg and "0B3" in msg


def test_chunk_count_must_match_virtual_size():
    with pytest.raises(ValueError, match="virtual pipeline size"):
        forward_backward(None, [_model(), _model()], iter(_data()), ParallelGroups.single(), num_microbatches=M,
                         seq_length=S, micro_batch_size=B, hidden_size=H, forward_step_fn=_step)


def test_weight_grad_split_matches_full_backward_without_redoing_input_grads():
    from omnitron.core.parallel.pipeline.wgrad import backward_input

    torch.manual_seed(1)
    m = torch.nn.Sequential(torch.nn.Linear(H, 8), torch.nn.GELU(), torch.nn.LayerNorm(8), torch.nn.Linear(8, H))
    m = m.double()
    x, g = torch.randn(S, B, H, requires_grad=True, dtype=torch.float64), torch.randn(S, B, H, dtype=torch.float64)
    out = m(x)
    runs = []
    todo, gelu_node = [out.grad_fn], None  # the GELU's backward: input path only, no weights under it
    while gelu_node is None:
        node = todo.pop()
        gelu_node = node if "Gelu" in type(node).__name__ else None
        todo += [n for n, _ in node.next_functions if n is not None]
    gelu_node.register_prehook(lambda grads: runs.append(1))
    g_in, plan = backward_input(out, g, x, list(m.parameters()))
    assert not plan.fallback and len(runs) == 1
    assert all(p.grad is None for p in m.parameters())  # B touched no weight
    plan.run()
    assert len(runs) == 1  # W did not re-run the input-gradient chain
    got = [p.grad.clone() for p in m.parameters()]
    ref = m
    xr = x.detach().requires_grad_()
    ref.zero_grad()
    ref(xr).backward(g)
    # the split and the full backward differ in the order of the weight-gradient sums over S x B = 15 tokens
    torch.testing.assert_close(g_in, xr.grad, rtol=REL, atol=ABS)
    for a, p in zip(got, ref.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=REL, atol=ABS)


def test_weight_grad_split_falls_back_when_a_weight_is_shared():
    from omnitron.core.parallel.pipeline.wgrad import backward_input

    torch.manual_seed(2)
    lin = torch.nn.Linear(H, H).double()
    x, g = torch.randn(B, H, requires_grad=True, dtype=torch.float64), torch.randn(B, H, dtype=torch.float64)
    out = lin(torch.tanh(lin(x)))  # the same weight on two boundaries
    g_in, plan = backward_input(out, g, x, list(lin.parameters()))
    assert plan.fallback
    plan.run()
    w = lin.weight.detach().clone().requires_grad_()
    b = lin.bias.detach().clone().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    (torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(xr, w, b)), w, b) * g).sum().backward()
    torch.testing.assert_close(lin.weight.grad, w.grad, rtol=REL, atol=ABS)
    torch.testing.assert_close(g_in, xr.grad, rtol=REL, atol=ABS)


def test_fully_masked_microbatch_contributes_zero_with_zero_gradient():
    """A micro-batch whose loss mask is all zero contributes 0 to the loss and nothing to the gradients
    (Megatron-Core clamps the token count at 1), where it gave 0 / 0 = NaN; the others are unchanged.
    Reference: float64 plain torch over the unmasked micro-batches, each divided by the micro-batch count."""
    groups = ParallelGroups.single()
    model = DistributedDataParallel(_model(), groups)
    model.zero_grad_buffer()
    data = _data()
    data[1]["loss_mask"] = torch.zeros(S, B)
    out = forward_backward(None, [model], iter(data), groups, num_microbatches=M, seq_length=S,
                           micro_batch_size=B, hidden_size=H, forward_step_fn=_step)
    finalize_model_grads([model], groups)
    ref = _model()
    total = 0.0
    for i, d in enumerate(data):
        if i == 1:
            continue
        per_tok = ((ref(d["x"].double()) - d["y"].double()) ** 2).mean(-1)
        mean = (per_tok * d["loss_mask"]).sum() / d["loss_mask"].sum()
        (mean / M).backward()
        total += mean.item()
    assert out["loss"] == pytest.approx(total / M, rel=REL)
    for p, r in zip(model.module.parameters(), ref.parameters()):
        assert p.main_grad.dtype == torch.float64
        torch.testing.assert_close(p.main_grad, r.grad, rtol=REL, atol=ABS)


def test_weight_grad_fallback_reruns_a_loss_that_writes_its_gradient_in_place():
    """A chunk ending in the models' loss (``inplace_backward``) whose W falls back to a full backward (the output
    weight used twice, as multi-token prediction's heads share it): B must leave the logits intact for W's second
    pass, and the weight gradient is float64's. Failed before B ran under ``backward_reruns`` (zb-h1 / zb-v with
    --mtp-num-layers: 'modified by an inplace operation')."""
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.parallel.pipeline.wgrad import backward_input
    from omnitron.core.parallel.tensor import vocab_parallel_cross_entropy

    torch.manual_seed(3)
    vocab, tp = 40, ParallelGroups.single().tp
    head = torch.nn.Linear(H, vocab, bias=False)
    x, target = torch.randn(S, B, H, requires_grad=True), torch.randint(0, vocab, (S, B))

    def loss_of(w, inp):
        h = torch.tanh(inp @ w[:H].t())  # the shared weight on the input path too: no clean split
        return vocab_parallel_cross_entropy(h @ w.t(), target, tp, inplace_backward=True).sum()

    out = loss_of(head.weight, x)
    g_in, plan = backward_input(out, None, x, [head.weight])
    assert plan.fallback
    plan.run()
    w = head.weight.detach().double().requires_grad_()
    xr = x.detach().double().requires_grad_()
    h = torch.tanh(xr @ w[:H].t())
    torch.nn.functional.cross_entropy((h @ w.t()).reshape(-1, vocab), target.reshape(-1), reduction="sum").backward()
    # fp32 against float64: sums of at most S*B = 15 tokens x 40 classes of order-1 terms, each rounded to
    # u = 6e-8 relative, and the kernels' exp to ~2 ulp: errors ~1e-6 relative at worst, 10x under rtol 1e-5;
    # atol 1e-6 covers the entries near zero
    torch.testing.assert_close(head.weight.grad.double(), w.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_in.double(), xr.grad, rtol=1e-5, atol=1e-6)


def _held_bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors`` (a stride-0 stand-in counts its one element)."""
    from torch.utils._pytree import tree_leaves

    seen = {}
    for t in tree_leaves(list(tensors)):
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("recipe, dtype", [("tensorwise", torch.bfloat16), ("delayed", torch.float32),
                                           ("blockwise", torch.bfloat16)])
def test_weight_grad_split_quantizes_grad_output_once(recipe, dtype, monkeypatch):
    """B quantizes each FP8 layer's output gradient for its data-gradient GEMM and hands W the form its weight-
    gradient GEMM reads (per-tensor: the transposed codes and scale; block-wise: the token-tiled codes), with the
    bias gradient: the split backward issues exactly the unsplit backward's quantizations (it quantized the gradient
    again in W: twice a layer per-tensor, and under per-use delayed scaling the second pass moved the grad_output
    history, so W's scale was another than the unsplit backward's), gradients bit for bit those of the unsplit
    backward over three uses, and what W holds for a layer (the stash, and a one-element stand-in for the kept
    gradient) is at most the gradient W held before: FP8 codes are 1 byte against bf16's 2 and fp32's 4."""
    from omnitron.backends import get_backend
    from omnitron.core.parallel import split_backward
    from omnitron.core.parallel.pipeline.wgrad import backward_input
    from omnitron.core.precision.fp8 import FP8Config, FP8Linear

    prov = get_backend().fp8
    count = []
    blocks, per_tensor = type(prov).quantize_blocks, FP8Linear.quantize
    monkeypatch.setattr(type(prov), "quantize_blocks", lambda self, *a, **k: count.append(1) or blocks(self, *a, **k))
    monkeypatch.setattr(FP8Linear, "quantize", lambda self, role, *a: count.append(role) or per_tensor(self, role, *a))
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    tokens, width = 128, 64
    w1, w2 = (torch.nn.Parameter((torch.randn(width, width, generator=gen) / 8).to(dtype)) for _ in range(2))
    b1, b2 = (torch.nn.Parameter(torch.randn(width, generator=gen).to(dtype)) for _ in range(2))
    uses = [(torch.randn(tokens, width, generator=gen).to(dtype) * 3 ** k,
             torch.randn(tokens, width, generator=gen).to(dtype) * 5 ** k) for k in range(3)]  # growing: delayed moves
    results, counts = {}, {}
    for split in (True, False):
        layers = [FP8Linear(FP8Config(fp8_recipe=recipe, fp8_format="hybrid"), prov) for _ in range(2)]
        results[split], counts[split] = [], []
        for x, g in uses:
            for p in (w1, w2, b1, b2):
                p.grad = None
            xx = x.clone().requires_grad_()
            out = layers[1](torch.tanh(layers[0](xx, w1, b1)), w2, b2)
            count.clear()
            if split:
                g_in, plan = backward_input(out, g, xx, [w1, b1, w2, b2])
                assert not plan.fallback and len(plan.kept) == 2, seed
                held = [t for node in plan.kept for t in (*plan.kept[node], getattr(node, split_backward._STASH, ()))]
                # the gradient W held before: one [tokens, width] tensor a layer in the model's dtype
                assert _held_bytes(held) <= 2 * tokens * width * dtype.itemsize, (seed, _held_bytes(held))
                assert all(t.untyped_storage().nbytes() == dtype.itemsize for k in plan.kept.values() for t in k)
                plan.run()
            else:
                out.backward(g)
                g_in = xx.grad
            counts[split].append(list(count))
            results[split].append((g_in, w1.grad, w2.grad, b1.grad, b2.grad))
    assert counts[True] == counts[False], (seed, counts)
    for a, b in zip(results[True], results[False]):
        for u, v in zip(a, b):
            assert torch.equal(u, v), seed


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_weight_grad_split_runs_each_fp8_gemm_once(recipe, monkeypatch):
    """A custom autograd function's ``needs_input_grad`` is fixed at forward, so the FP8 linear (a boundary node of
    the split) once ran its data- AND weight-gradient GEMMs in B and again in W: four backward GEMMs a layer, not
    two (split_backward.py). Now B runs each layer's data-gradient GEMM only and W its weight-gradient GEMM only;
    the gradients are bit for bit those of one unsplit backward through the same FP8 layers (the same operands
    quantized the same way: current scaling, no state between the passes)."""
    from omnitron.backends import get_backend
    from omnitron.core.parallel.pipeline.wgrad import backward_input
    from omnitron.core.precision.fp8 import FP8Config, FP8Linear

    prov = get_backend().fp8
    gemm = "scaled_mm" if recipe == "tensorwise" else "blockwise_mm"
    calls = []
    real = getattr(type(prov), gemm)
    monkeypatch.setattr(type(prov), gemm, lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    w1, w2 = (torch.nn.Parameter(torch.randn(32, 32, generator=gen) / 6) for _ in range(2))
    x, g = torch.randn(S * B, 32, generator=gen), torch.randn(S * B, 32, generator=gen)
    results = []
    for split in (True, False):
        layers = [FP8Linear(FP8Config(fp8_recipe=recipe, fp8_format="hybrid"), prov) for _ in range(2)]
        w1.grad = w2.grad = None
        xx = x.clone().requires_grad_()
        out = layers[1](torch.tanh(layers[0](xx, w1)), w2)
        calls.clear()
        if split:
            g_in, plan = backward_input(out, g, xx, [w1, w2])
            assert not plan.fallback and len(calls) == 2 and w1.grad is None and w2.grad is None, seed  # 2 dgrads
            calls.clear()
            plan.run()
            assert len(calls) == 2, seed  # the two weight-gradient GEMMs, no dgrad again
        else:
            out.backward(g)
            g_in = xx.grad
        results.append((g_in, w1.grad.clone(), w2.grad.clone()))
    for a, b in zip(*results):
        assert torch.equal(a, b), seed
