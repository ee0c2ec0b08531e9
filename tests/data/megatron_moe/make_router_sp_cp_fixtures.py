"""Writes ``router_sp_cp.json`` beside this file WITH MEGATRON-CORE'S OWN TopKRouter on two gloo ranks: the router
losses and gradients under tensor parallelism with sequence parallelism (tp 2, each rank routing its sequence shard)
and context parallelism (cp 2, each rank routing Megatron's load-balanced chunks r and 3 - r of every sequence),
which tests/models/test_megatron_router_sp_cp.py compares with omnitron's router on the whole micro-batch.

Needs a Megatron-LM checkout (snapshot d98e8a6 was used) and torch; CPU, offline, without Transformer Engine;
omnitron is not imported. Run from the omnitron root:

    PYTHONPATH=/path/to/Megatron-LM python tests/data/megatron_moe/make_router_sp_cp_fixtures.py

What is recorded is what Megatron's training makes of each rank's piece: the router weight's gradient reduced as
its grad sync does (summed over tp for a ``sequence_parallel`` weight; averaged over dp x cp), each rank's input
gradient (under cp divided by cp: Megatron's loss and MoEAuxLossAutoScaler scale both carry the factor cp) and the
logged losses reduced as its tracker does (the balancing losses summed over tp x cp, the z-loss averaged).
Stand-ins as make_fixtures.py (CUDA streams, the current device); the router computes in float32
(``moe_router_dtype fp32``) on float64 tokens.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPE = dict(s=8, b=3, h=16, E=8)
CASES = {
    # name -> TransformerConfig fields (omnitron's GPTConfig fields of the same name)
    "aux_loss": dict(moe_router_topk=2, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.3),
    "seq_aux_loss": dict(moe_router_topk=2, moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.3),
    "seq_aux_loss_sigmoid": dict(moe_router_topk=3, moe_router_score_function="sigmoid",
                                 moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.3),
    "z_loss": dict(moe_router_topk=2, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                   moe_z_loss_coeff=0.05),
    "list_and_z": dict(moe_router_topk=2, moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                       moe_aux_loss_coeff=[0.3, 0.2], moe_z_loss_coeff=0.05),
}
SEED = 7


def draw() -> tuple:
    """(router weight [E, h], tokens [s, b, h], output gradient [s, b, E]), float64."""
    s, b, h, E = (SHAPE[x] for x in ("s", "b", "h", "E"))
    g = torch.Generator().manual_seed(SEED)
    return (torch.randn(E, h, generator=g, dtype=torch.float64), torch.randn(s, b, h, generator=g, dtype=torch.float64),
            torch.randn(s, b, E, generator=g, dtype=torch.float64))


def positions(mode: str, rank: int) -> list[int]:
    """The sequence positions rank ``rank`` of 2 routes: tp's contiguous shard, cp's chunks r and 3 - r."""
    s = SHAPE["s"]
    if mode == "tp":
        return list(range(rank * s // 2, (rank + 1) * s // 2))
    c = s // 4
    return list(range(rank * c, (rank + 1) * c)) + list(range((3 - rank) * c, (4 - rank) * c))


def _cpu_stand_ins() -> None:
    import contextlib

    class Stream:
        def __init__(self, *a, **k): pass
        def wait_stream(self, *a): pass
        def record_event(self, *a): return Stream()

    torch.cuda.Stream = torch.cuda.Event = Stream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"


def run_rank(rank: int, mode: str, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    _cpu_stand_ins()
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_logging
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler, TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe_utils.te_general_gemm = None
    tp, cp = (2, 1) if mode == "tp" else (1, 2)
    parallel_state.initialize_model_parallel(tp, 1, context_parallel_size=cp)
    s, b, h, E = (SHAPE[x] for x in ("s", "b", "h", "E"))
    res = {}
    for name, settings in CASES.items():
        cfg = TransformerConfig(num_layers=2, hidden_size=h, num_attention_heads=2, num_moe_experts=E,
                                params_dtype=torch.float64, moe_router_dtype="fp32", add_bias_linear=False,
                                use_cpu_initialization=True, moe_router_fusion=False, sequence_parallel=mode == "tp",
                                tensor_model_parallel_size=tp, context_parallel_size=cp, **settings)
        router = TopKRouter(cfg, pg_collection=moe_utils.get_default_pg_collection())
        router.set_layer_number(1)
        router.train()
        w, x, dy = draw()
        pos = positions(mode, rank)
        with torch.no_grad():
            router.weight.copy_(w)
        xl = x[pos].clone().requires_grad_(True)
        moe_logging.get_moe_metrics_tracker().clear()
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(float(cp)))  # the schedule's loss scale x cp / microbatches
        probs, _ = router(xl)
        (cp * probs * dy[pos].reshape(-1, E)).sum().backward()  # a cp rank's loss is cp x its slice's
        grad = router.weight.grad.clone()
        torch.distributed.all_reduce(grad)
        logged = {}
        for n, entry in moe_logging.get_moe_metrics_tracker().metrics.items():
            v = entry.values[0].clone()
            if v.abs().sum() == 0:
                continue
            torch.distributed.all_reduce(v)
            logged[n] = (v / 2 if n == "z_loss" else v).item()  # the z-loss is averaged, the others summed
        res[name] = {"positions": pos, "dx": (xl.grad / cp).flatten().tolist(), "logged": logged,
                     "weight_grad": (grad / cp).flatten().tolist()}
    out[(mode, rank)] = res
    torch.distributed.destroy_process_group()


def main() -> None:
    out = mp.Manager().dict()
    for i, mode in enumerate(("tp", "cp")):
        port = 20000 + (os.getpid() + i) % 20000
        procs = [mp.Process(target=run_rank, args=(r, mode, port, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        if any(p.exitcode != 0 for p in procs):
            sys.exit(f"{mode}: a rank failed")
    result = {"shape": SHAPE, "seed": SEED, "cases": CASES,
              "runs": {f"{mode}{rank}": out[(mode, rank)] for mode in ("tp", "cp") for rank in range(2)}}
    with open(os.path.join(HERE, "router_sp_cp.json"), "w") as fh:
        json.dump(result, fh, indent=0)


if __name__ == "__main__":
    main()
