"""Writes ``fixtures.json`` beside this file WITH THE PUBLISHED CODE of the two V-shaped schedules: per pipeline
rank, the order of the forward (F), input-gradient (B) and weight-gradient (W) passes of each (model chunk,
micro-batch), and for DualPipeV which forward runs overlapped with the backward after it.

* DualPipeV: deepseek-ai/DualPipe (3da1bbe was used), ``dualpipe.DualPipeV.step`` run for real on CPU with gloo in
  ``p`` spawned processes. Each chunk is one linear layer whose weight gradient goes through the library's
  ``WeightGradStore`` (as its example's ``LinearFunc``); a chunk logs ``{chunk}F{mb}`` when it runs forward,
  ``{chunk}B{mb}`` when its backward starts, ``{chunk}W{mb}`` when its stored weight gradient runs, and
  ``pair`` when the library calls ``overlapped_forward_backward``. Its few CUDA calls (the device check,
  ``device="cuda"`` receive buffers) are pointed at the CPU.
* ZB-V: sail-sg/zero-bubble-pipeline-parallelism (39f2c18 was used), ``scheduler/zbv.py``'s
  ``PipelineGraph.create_schedule`` (pure Python), with F = B = W = 1 and no transfer time, in two memory
  settings: ``zb-v``, a chunk's activations counted until its W (f_mem 1, b_mem 0, w_mem -1, ``max_mem`` at its
  default ``2 p f_mem``); ``zb-v b_mem 1``, a B adding as much again (omnitron's B keeps the graph and adds the
  gradients its W needs: f_mem 1, b_mem 1, w_mem -2, ``max_mem`` ``2 p + 1``).

omnitron is not imported. Run from the omnitron root:

    DUALPIPE=/path/to/DualPipe ZERO_BUBBLE=/path/to/zero-bubble-pipeline-parallelism \\
        python tests/parallel/vshape_reference/make_fixtures.py
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

HERE = os.path.dirname(os.path.abspath(__file__))
DUALPIPE_CASES = [(p, m) for p in (2, 3, 4) for m in range(2 * p, 4 * p + 2)]
ZBV_CASES = [(p, m) for p in (2, 3, 4) for m in range(1, 4 * p + 2)] + [(8, m) for m in (8, 16, 17, 32, 33)] + [
    (5, 4), (5, 10), (6, 12), (6, 13), (16, 32), (16, 64)]


def zbv_tables(root: str, p: int, m: int, b_mem: int) -> list[list[str]]:
    """Per rank, ZB-V's passes as ``{chunk}{F|B|W}{mb}`` (the model chunk, as its create_schedule maps it)."""
    base = os.path.join(root, "megatron/core/pipeline_parallel/zerobubble/scheduler")
    pkg = "megatron.core.pipeline_parallel.zerobubble.scheduler"
    for name in ("megatron", "megatron.core", "megatron.core.pipeline_parallel",
                 "megatron.core.pipeline_parallel.zerobubble", pkg):
        sys.modules.setdefault(name, types.ModuleType(name))  # the packages' __init__ import all of Megatron
    for mod in ("graph", "zbv"):
        if f"{pkg}.{mod}" not in sys.modules:
            spec = importlib.util.spec_from_file_location(f"{pkg}.{mod}", os.path.join(base, f"{mod}.py"))
            sys.modules[spec.name] = module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
    zbv = sys.modules[f"{pkg}.zbv"]
    config = types.SimpleNamespace(max_chunks=2, n_stages=p)
    graph = zbv.PipelineGraph(p, m, 1, 1, 1, 0, f_mem=1, b_mem=b_mem, w_mem=-1 - b_mem, max_mem=2 * p + b_mem)
    order = graph.create_schedule(config)
    return [[f"{n.chunk}{n.type.value}{n.microbatch}" for n in order[r]] for r in range(p)]


class _Logged(torch.autograd.Function):
    """A copy of a chunk's output that logs the chunk's B when its backward starts (not a view: DualPipeV frees
    what it sends and refuses views)."""

    @staticmethod
    def forward(ctx, x, log, tag):
        ctx.log, ctx.tag = log, tag
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(ctx.tag)
        return grad, None, None


def _stage_class(log: list, store, run_backward):
    class _LinearW(torch.autograd.Function):
        """``y = x w^T`` whose weight gradient is deferred through WeightGradStore when it is enabled."""

        @staticmethod
        def forward(ctx, x, w, tag):
            ctx.save_for_backward(x, w)
            ctx.tag = tag
            return F.linear(x, w)

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors

            def grad_w(deferred: bool = True):
                if deferred:  # a W of its own; else part of the backward (not split, no W in the table)
                    log.append(ctx.tag)
                w.grad = (w.grad if w.grad is not None else 0) + g.flatten(0, -2).T @ x.flatten(0, -2)

            store.put(grad_w) if store.enabled else grad_w(False)
            return g @ w, None, None

    class Stage(torch.nn.Module):
        def __init__(self, chunk: int, h: int) -> None:
            super().__init__()
            self.chunk, self.calls = chunk, 0
            self.weight = torch.nn.Parameter(torch.randn(h, h) / h)

        def forward(self, x):
            mb, self.calls = self.calls, self.calls + 1
            log.append(f"{self.chunk}F{mb}")
            return _Logged.apply(_LinearW.apply(x, self.weight, f"{self.chunk}W{mb}"), log, f"{self.chunk}B{mb}")

        @classmethod
        def overlapped_forward_backward(cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1,
                                        output_grads1):
            log.append("pair")
            outputs0 = [module0(*inputs0)]
            loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
            if loss1 is not None:
                loss1.backward()
                loss1.detach_()
            else:
                run_backward(outputs1, output_grads1)  # as the library's example (outputs freed once sent)
            return outputs0, loss0

    return Stage


class _DeviceArgOnCpu(TorchFunctionMode):
    """While on: a torch call's ``device=`` argument is the CPU (DualPipe's receive buffers name "cuda")."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs and "device" in kwargs:
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **(kwargs or {}))


def _dualpipe_worker(rank: int, p: int, cases: list, root: str, init: str, out: str) -> None:
    sys.path.insert(0, root)
    torch.cuda.current_device = lambda: "cpu"  # DualPipeV's device check, on the CPU
    import dualpipe
    import dualpipe.comm as comm
    from dualpipe.utils import WeightGradStore, run_backward
    build = comm.build_from_tensor_shapes

    def build_on_cpu():  # the library's own receive buffers, made on the CPU
        with _DeviceArgOnCpu():
            return build()

    comm.build_from_tensor_shapes = build_on_cpu
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=p)
    h, mbs, result = 4, 1, {}
    dualpipe.set_p2p_tensor_shapes([(mbs, h)])
    dualpipe.set_p2p_tensor_dtype(torch.float32)
    for m in cases:
        log: list = []
        stage = _stage_class(log, WeightGradStore, run_backward)
        model = dualpipe.DualPipeV((stage(0, h), stage(1, h)))
        x = torch.randn(m * mbs, h) if rank == 0 else None
        labels = (torch.randn(m * mbs, h),) if rank == 0 else ()
        model.step(x, num_chunks=m, criterion=lambda y, t: F.mse_loss(y, t), labels=labels)
        table, pairs = [], []
        for entry in log:
            if entry == "pair":
                pairs.append(len(table))
            else:
                table.append(entry)
        result[m] = {"table": table, "pairs": pairs}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def dualpipe_tables(root: str, p: int, ms: list[int]) -> dict[int, list[dict]]:
    """Per micro-batch count, per rank: DualPipeV's passes and the table indices of its overlapped forwards."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "log")
        torch.multiprocessing.spawn(_dualpipe_worker, args=(p, ms, root, f"file://{tmp}/init", out), nprocs=p)
        per_rank = []
        for r in range(p):
            with open(f"{out}.{r}") as f:
                per_rank.append(json.load(f))
    return {m: [per_rank[r][str(m)] for r in range(p)] for m in ms}


def main() -> None:
    fixtures = {"dualpipe-v": {}, "zb-v": {}, "zb-v b_mem 1": {}}
    for p in sorted({p for p, _ in DUALPIPE_CASES}):
        for m, ranks in dualpipe_tables(os.environ["DUALPIPE"], p, [m for q, m in DUALPIPE_CASES if q == p]).items():
            fixtures["dualpipe-v"][f"{p},{m}"] = ranks
    for p, m in ZBV_CASES:
        fixtures["zb-v"][f"{p},{m}"] = zbv_tables(os.environ["ZERO_BUBBLE"], p, m, 0)
        fixtures["zb-v b_mem 1"][f"{p},{m}"] = zbv_tables(os.environ["ZERO_BUBBLE"], p, m, 1)
    with open(os.path.join(HERE, "fixtures.json"), "w") as f:
        json.dump(fixtures, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
