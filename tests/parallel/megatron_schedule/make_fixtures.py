"""Writes ``fixtures.json`` beside this file WITH MEGATRON-LM'S OWN CODE: the order in which each pipeline rank runs
the forward and backward passes of each (model chunk, micro-batch), and the micro-batch counts Megatron refuses.

Needs a Megatron-LM checkout (snapshot d98e8a64dd was used) and torch; it runs on CPU with gloo, offline, in
``pp`` spawned processes per pipeline size. Run from the omnitron root:

    MEGATRON_LM=/path/to/Megatron-LM python tests/parallel/megatron_schedule/make_fixtures.py

omnitron is not imported. Each rank's model chunks are one linear layer each; Megatron's
``forward_backward_pipelining_without_interleaving`` (one chunk: 1F1B) and ``..._with_interleaving`` (``vp``
chunks, ``--microbatch-group-size-per-virtual-pipeline-stage`` N at its default, pp, and at pp + 1 and pp + 2
for every count from 1 to 3 pp + 1 at pp 2 and 3; Megatron's default ``--overlap-p2p-communication``) drive
them. A chunk logs ``"{chunk}F{micro-batch}"`` when it runs forward and its output's identity autograd node logs
``"{chunk}B{micro-batch}"`` when backward reaches it. The few CUDA calls of the schedule code
(``torch.cuda.current_device``, ``torch.cuda.synchronize``, ``device="cuda"`` counters) are pointed at the CPU.
A case Megatron refuses stores the exception's first line instead of tables.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import typing

import torch

if not hasattr(typing, "override"):  # Megatron imports it; Python < 3.12 lacks it
    typing.override = lambda f: f

HERE = os.path.dirname(os.path.abspath(__file__))
PIPELINE_SIZES = (2, 3, 4)
VIRTUAL_SIZES = (1, 2, 3)  # 1: the 1F1B schedule
H, S, B = 4, 2, 1  # hidden size, sequence length, micro-batch size of the messages (their values do not matter)


GROUPED_SIZES = (2, 3)
"""Pipeline sizes of the cases with N > pp. NOTE: at pp 4 Megatron's run of vp 3, m 6, N 6 did not finish on gloo
in 4 minutes (its overlapped point-to-point; not looked into), so pp 4 keeps the default N only."""


def cases(pp: int) -> list[tuple[int, int, int | None]]:
    """(vp, micro-batches, group size N) for one pipeline size: every count from 1 to 2 pp + 1 at N's default
    (None), then N = pp + 1 and pp + 2 on the interleaved schedule for every count from 1 to 3 pp + 1."""
    default = [(vp, m, None) for vp in VIRTUAL_SIZES for m in range(1, 2 * pp + 2)]
    if pp not in GROUPED_SIZES:
        return default
    return default + [(vp, m, n) for vp in VIRTUAL_SIZES[1:] for n in (pp + 1, pp + 2) for m in range(1, 3 * pp + 2)]


def _cpu_for_cuda() -> None:
    zeros = torch.zeros

    def zeros_here(*args, **kw):
        if str(kw.get("device", "")).startswith("cuda"):
            kw["device"] = "cpu"
        return zeros(*args, **kw)

    torch.zeros = zeros_here
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None


class _Logged(torch.autograd.Function):
    """Identity whose backward appends ``tag`` to ``log``."""

    @staticmethod
    def forward(ctx, x, log, tag):
        ctx.log, ctx.tag = log, tag
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(ctx.tag)
        return grad, None, None


def _chunks(vp: int, config, log: list) -> list[torch.nn.Module]:
    from megatron.core.enums import ModelType

    class Chunk(torch.nn.Module):
        def __init__(self, index: int):
            super().__init__()
            self.index, self.config, self.model_type = index, config, ModelType.encoder_or_decoder
            self.lin, self.input, self.seen = torch.nn.Linear(H, H), None, 0

        def set_input_tensor(self, tensors):
            self.input = tensors[0] if isinstance(tensors, list) else tensors

        def forward(self, batch):
            mb, self.seen = self.seen, self.seen + 1
            log.append(f"{self.index}F{mb}")
            x = batch if self.input is None else self.input
            return _Logged.apply(self.lin(x), log, f"{self.index}B{mb}")

    return [Chunk(c) for c in range(vp)]


def _one_case(pp: int, vp: int, m: int, n: int | None) -> dict:
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel import schedules

    virtual = vp if vp > 1 else None
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=virtual)
    config = ModelParallelConfig(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=virtual,
                                 pipeline_dtype=torch.float32, overlap_p2p_comm=vp > 1, batch_p2p_comm=vp == 1,
                                 microbatch_group_size_per_vp_stage=n)
    config.hidden_size = H
    log: list[str] = []
    chunks = _chunks(vp, config, log)

    def step(_iterator, model):
        out = model(torch.randn(S, B, H))
        return out, lambda o: (o.sum(), {"loss": o.sum().detach()})

    iterators = [iter(()) for _ in range(vp)]
    kw = dict(forward_step_func=step, num_microbatches=m, seq_length=S, micro_batch_size=B, forward_only=False)
    try:
        if vp > 1:
            schedules.forward_backward_pipelining_with_interleaving(data_iterator=iterators, model=chunks, **kw)
        else:
            schedules.forward_backward_pipelining_without_interleaving(data_iterator=iterators[0],
                                                                       model=chunks[0], **kw)
        result = {"table": log}
    except (ValueError, RuntimeError, AssertionError) as err:  # Megatron's checks, before any message
        result = {"error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
    parallel_state.destroy_model_parallel()
    return result


def _worker(rank: int, pp: int, port: int, out: str) -> None:
    import faulthandler
    import logging

    faulthandler.dump_traceback_later(900, exit=True)  # a hang shows where, instead of waiting forever

    import torch.distributed as dist

    sys.path.insert(0, os.environ["MEGATRON_LM"])
    logging.disable(logging.WARNING)
    _cpu_for_cuda()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=pp)
    results = [_one_case(pp, vp, m, n) for vp, m, n in cases(pp)]
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def main() -> None:
    import warnings

    import torch.multiprocessing as mp

    warnings.filterwarnings("ignore")
    out = {"megatron": "d98e8a64dd", "cases": []}
    for pp in PIPELINE_SIZES:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_worker, args=(pp, 29500 + pp, tmp), nprocs=pp)
            per_rank = []
            for r in range(pp):
                with open(os.path.join(tmp, f"{r}.json")) as f:
                    per_rank.append(json.load(f))
        for i, (vp, m, n) in enumerate(cases(pp)):
            errors = [res[i]["error"] for res in per_rank if "error" in res[i]]
            entry = {"pp": pp, "vp": vp, "m": m} if n is None else {"pp": pp, "vp": vp, "m": m, "n": n}
            entry.update({"error": errors[0]} if errors else {"tables": [res[i]["table"] for res in per_rank]})
            out["cases"].append(entry)
    with open(os.path.join(HERE, "fixtures.json"), "w") as f:
        json.dump(out, f, separators=(",", ":"))


if __name__ == "__main__":
    main()
