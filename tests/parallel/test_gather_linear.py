"""A sequence-parallel column-parallel linear at tp2 (omnitron/core/parallel/tensor/gather_linear.py): its output and
gradients against one process's ``X W^T + b`` in float64, and what its forward saves for backward: the input SHARD
(``s/tp x b x h`` elements), not the all-gathered ``[s, b, h]`` input that ``gather_from_sp`` + ``F.linear`` saved
(before 2026-12-05: twice the bytes at tp2, so the memory check fails on the old path), eager and compiled
(``torch.compile``, aot_eager, one graph: without the checkpointed gather the partitioner saved the gathered input).

Tolerance: float64 (u = 1.1e-16); the layout only reorders the sums (h = 24 terms in dx, s b = 16 in dW and db,
and one 2-rank reduce-scatter), a relative error of a few u; 1e-12 leaves a factor > 1000, and a wrong shard,
a missing reduce-scatter or a gradient of the wrong rows moves them by O(1). One spawn runs every case; with
``--backend sim`` the same checks run on the simulated device under the suite's strict collective checking."""
from __future__ import annotations

import os

import torch

from omnitron.testing.distributed import run_distributed

S, B, H, OUT = 8, 2, 24, 12


def _case(bias: bool, recompute: bool, compiled: bool = False) -> dict:
    """One forward + backward of the tp2 layer and of the one-process reference; relative errors and saved bytes."""
    from omnitron.backends import get_backend
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.parallel.tensor import checkpoint
    from omnitron.core.parallel.tensor.layers import ColumnParallelLinear
    from omnitron.plan.measure import SavedBytes
    from omnitron.testing.parity import relative_error

    be = get_backend()
    groups = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), backend=be)
    tp, r = groups.tp.size, groups.tp.rank
    dev = be.device()
    gen = torch.Generator().manual_seed(7)  # the same fresh inputs on both ranks
    x = torch.randn(S, B, H, generator=gen, dtype=torch.float64)
    w = torch.randn(OUT, H, generator=gen, dtype=torch.float64)
    bvec, dy = (torch.randn(OUT, generator=gen, dtype=torch.float64),
                torch.randn(S, B, OUT, generator=gen, dtype=torch.float64))
    rows, seq = slice(r * OUT // tp, (r + 1) * OUT // tp), slice(r * S // tp, (r + 1) * S // tp)

    layer = ColumnParallelLinear(H, OUT, group=groups.tp, bias=bias, sequence_parallel=True, dtype=torch.float64,
                                 device=dev)
    with torch.no_grad():
        layer.weight.copy_(w[rows])
        if bias:
            layer.bias.copy_(bvec[rows])
    shard = x[seq].clone().to(dev).requires_grad_()
    fn = layer
    if compiled:  # one graph; AOTAutograd's partitioner decides what the compiled forward saves
        torch._dynamo.reset()
        fn = torch.compile(layer, backend="aot_eager", fullgraph=True)
    rec = SavedBytes(layer.parameters())
    with rec.record():
        y = checkpoint(fn, None, shard) if recompute else fn(shard)
    (y * dy[:, :, rows].to(dev)).sum().backward()

    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    br = bvec.clone().requires_grad_() if bias else None
    yr = torch.nn.functional.linear(xr, wr, br)
    (yr * dy).sum().backward()
    err = {"y": relative_error(y.cpu(), yr[:, :, rows].detach()), "dx": relative_error(shard.grad.cpu(), xr.grad[seq]),
           "dw": relative_error(layer.weight.grad.cpu(), wr.grad[rows])}
    if bias:
        err["db"] = relative_error(layer.bias.grad.cpu(), br.grad[rows])
    return {"err": err, "saved": rec.total, "shard": S // tp * B * H * 8}


def _cases() -> dict:
    torch.set_num_threads(1)
    out = {(bias, rec, False): _case(bias, rec) for bias in (True, False) for rec in (False, True)}
    out[(True, False, True)] = _case(True, False, compiled=True)
    return out


def test_sp_column_parallel_grads_and_saved_shard_tp2():
    for rank in run_distributed(_cases, 2):
        for (bias, recompute, compiled), got in rank.items():
            assert max(got["err"].values()) < 1e-12, (bias, recompute, compiled, got["err"])
            if not recompute:  # the saved bytes: the shard only (the parameters are not activations)
                assert got["saved"] == got["shard"], (bias, compiled, got["saved"], got["shard"])


def _split_case(seed: int) -> dict:
    """The layer's backward split as the zero-bubble schedules split it (pipeline/wgrad.py): per half, the
    collectives it ran; and the gradients' relative errors against the one-process float64 reference."""
    from omnitron.backends import get_backend
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.parallel.pipeline.wgrad import backward_input
    from omnitron.core.parallel.tensor import mappings
    from omnitron.core.parallel.tensor.layers import ColumnParallelLinear
    from omnitron.testing.parity import relative_error

    torch.set_num_threads(1)
    be = get_backend()
    groups = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), backend=be)
    tp, r = groups.tp.size, groups.tp.rank
    gen = torch.Generator().manual_seed(seed)  # the test's fresh seed: the same inputs on both ranks
    x, w, bvec, dy = (torch.randn(*shape, generator=gen, dtype=torch.float64)
                      for shape in ((S, B, H), (OUT, H), (OUT,), (S, B, OUT)))
    rows, seq = slice(r * OUT // tp, (r + 1) * OUT // tp), slice(r * S // tp, (r + 1) * S // tp)
    layer = ColumnParallelLinear(H, OUT, group=groups.tp, bias=True, sequence_parallel=True, dtype=torch.float64,
                                 device=be.device())
    with torch.no_grad():
        layer.weight.copy_(w[rows])
        layer.bias.copy_(bvec[rows])
    shard = x[seq].clone().to(be.device()).requires_grad_()
    calls = []
    for name in ("reduce_scatter_first", "gather_first"):
        real = getattr(mappings, name)
        setattr(mappings, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    y = layer(shard)
    calls.clear()
    g_in, plan = backward_input(y, dy[:, :, rows].to(be.device()), shard, list(layer.parameters()))
    in_b, calls[:] = list(calls), []
    plan.run()
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, bvec))
    (torch.nn.functional.linear(xr, wr, br) * dy).sum().backward()
    db = layer.bias.grad  # W's: B must leave it to W (None here when neither half computed it)
    return {"b": in_b, "w": list(calls), "fallback": plan.fallback,
            "err": {"dx": relative_error(g_in.cpu(), xr.grad[seq]),
                    "dw": relative_error(layer.weight.grad.cpu(), wr.grad[rows]),
                    "db": float("inf") if db is None else relative_error(db.cpu(), br.grad[rows])}}


def test_split_backward_runs_each_collective_once_tp2():
    """B runs the data gradient and its reduce-scatter only, W the re-gather and the weight and bias gradients only
    (once both ran in each: two reduce-scatters and two all-gathers a layer, split_backward.py); gradients as above,
    the bias's included (a bias gradient made in B is dropped: B's autograd.grad asks for the stage input only)."""
    seed = int.from_bytes(os.urandom(4), "little")
    for got in run_distributed(_split_case, 2, seed):
        assert not got["fallback"], seed
        assert (got["b"], got["w"]) == (["reduce_scatter_first"], ["gather_first"]), (seed, got)
        # float64 sums in another order: dx sums OUT = 12 products (6 a rank, then the reduce-scatter adds the
        # two), dW and db s b = 16 each. A sum of n terms errs by at most n u sum|terms|; on these normal draws
        # sum|terms| / |sum| is ~ sqrt(n) ~ 4 in the norm, so ~ 16 x 4 x 1.1e-16 ~ 7e-15 relative: 1e-12 leaves
        # > 100x, and a wrong shard, a missing reduce-scatter, the wrong rows or a lost bias gradient err by O(1)
        assert max(got["err"].values()) < 1e-12, (seed, got["err"])


def _autocast_case(seed: int) -> dict:
    """The tp2 sequence-parallel layer (float32 parameters) under bf16 autocast, and what its forward saved: the
    shard cast as autocast's ``F.linear`` casts it (bf16), so the backward's GEMMs meet operands of one dtype.
    Relative errors against float64 on the bf16-rounded operands (the roundings autocast itself makes)."""
    from omnitron.backends import get_backend
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.parallel.tensor.layers import ColumnParallelLinear
    from omnitron.testing.parity import relative_error

    torch.set_num_threads(1)
    be = get_backend()
    dev = be.device()
    if not torch.amp.is_autocast_available(dev.type):
        return {}
    groups = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), backend=be)
    tp, r = groups.tp.size, groups.tp.rank
    gen = torch.Generator().manual_seed(seed)
    x, w, bvec, dy = (torch.randn(*shape, generator=gen) for shape in ((S, B, H), (OUT, H), (OUT,), (S, B, OUT)))
    rows, seq = slice(r * OUT // tp, (r + 1) * OUT // tp), slice(r * S // tp, (r + 1) * S // tp)
    layer = ColumnParallelLinear(H, OUT, group=groups.tp, bias=True, sequence_parallel=True, device=dev)
    with torch.no_grad():
        layer.weight.copy_(w[rows])
        layer.bias.copy_(bvec[rows])
    shard = x[seq].clone().to(dev).requires_grad_()
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        y = layer(shard)
    saved = [t.dtype for t in y.grad_fn.saved_tensors] if hasattr(y.grad_fn, "saved_tensors") else []
    (y.float() * dy[:, :, rows].to(dev)).sum().backward()  # y.float()'s backward rounds dy to bf16
    xr, wr, br = (t.bfloat16().double().requires_grad_() for t in (x, w, bvec))
    yr = torch.nn.functional.linear(xr, wr, br)
    (yr * dy.bfloat16().double()).sum().backward()
    return {"dtype": y.dtype, "saved": saved,
            "err": {"y": relative_error(y.cpu(), yr[:, :, rows].detach()),
                    "dx": relative_error(shard.grad.cpu(), xr.grad[seq]),
                    "dw": relative_error(layer.weight.grad.cpu(), wr.grad[rows]),
                    "db": relative_error(layer.bias.grad.cpu(), br.grad[rows])}}


def test_sp_column_parallel_under_autocast_tp2():
    """Under bf16 autocast the layer computes in bf16 from its float32 shard and weights (as ``F.linear`` would)
    and saves the bf16 shard; its backward then multiplies bf16 by bf16 (a float32 shard saved there fails the
    weight gradient's GEMM). Bounds: with the operands rounded to bf16 in the reference too, what is left is the
    float32 accumulation (<= 24 terms: ~1e-6) and the bf16 rounding of each result, at most u = 2^-8 relative per
    element (y, dW, db: normwise <= u); dx is each rank's bf16 partial product (u each; on these normal draws
    normwise ~sqrt(2) u over the two independent partials) summed by the reduce-scatter in bf16 (u more): ~2.4 u.
    3 u bounds all four (measured: ~0.5 u on y, dW, db, ~0.65 u on dx); a gradient of the wrong rows or a lost
    term errs by O(1)."""
    seed = int.from_bytes(os.urandom(4), "little")
    for got in run_distributed(_autocast_case, 2, seed):
        if not got:  # no autocast on this device type
            continue
        assert got["dtype"] == torch.bfloat16, (seed, got)
        assert got["saved"] and set(got["saved"]) <= {torch.bfloat16}, (seed, got["saved"])
        assert max(got["err"].values()) < 3 * 2 ** -8, (seed, got["err"])
