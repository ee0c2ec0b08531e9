"""Generation throughput of a ~100M GPT at tp1 / tp2 / pp2 on this CPU, side by side in one run.

One spawned world of 2 gloo ranks. A random GPT-3-125M-shaped model (``gpt3_125m``: 12 layers, hidden 768,
GPT-2's 50257 tokens; ``--layers`` scales it down) is written once as a checkpoint; rank 0 alone loads it in one
process (tp1, 2 threads) while rank 1 sleeps (polling a file: a gloo barrier
would spin a core), then both ranks load their tp2 and their pp2 stage
(:mod:`omnitron.core.inference.sharded`, 1 thread each). Every round runs the three variants once,
interleaved, on the same batch of prompts (greedy, KV cache); the median over rounds is reported.

Columns: ``ms`` median wall time of one ``generate_batch`` call (prefill + ``--new`` decoding steps), ``tok/s``
generated tokens per second (batch x new tokens / time), ``vs tp1`` the throughput ratio. NOTE: pp without
micro-batching keeps one stage busy at a time (decoding is a chain): it buys memory, not speed; tp splits
every GEMM but adds two all-reduces per layer and one all-gather of the logits per step.

    python benchmarks/sharded_generate.py [--layers 12] [--batch 4] [--new 32] [--rounds 3] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPT_LENGTHS = (24, 17, 30, 9)


def _write_checkpoint(root: str, layers: int) -> None:
    from omnitron.core.checkpoint.hf import write_weights_checkpoint
    from omnitron.core.checkpoint.reshard import Layout
    from omnitron.core.models.gpt.presets import gpt3
    from omnitron.core.models.gpt.model import GPTModel
    from omnitron.core.models.gpt.state import gather_full_state
    from omnitron.core.parallel.groups import ParallelGroups

    cfg = gpt3("125m", num_layers=layers, seq_length=256, max_position_embeddings=256, hidden_dropout=0.0,
               attention_dropout=0.0)
    model = GPTModel(cfg, ParallelGroups.single(), seed=1)
    write_weights_checkpoint(gather_full_state(model, model.groups), cfg, root, Layout(),
                             config={"tokenizer_type": "GPT2BPETokenizer"})


def _prompts(batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 50257, (PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)],), generator=g).tolist()
            for i in range(batch)]


def _timed(loaded, prompts, new: int) -> float:
    from omnitron.core.inference.generation import generate_batch

    kw = loaded.sharded.generate_kwargs() if loaded.sharded is not None else {}
    t0 = time.perf_counter()
    out = generate_batch(loaded.model, prompts, new, eod=None, **kw)
    dt = time.perf_counter() - t0
    assert all(len(t) == new for t in out.tokens)
    return dt


def _worker(root: str, batch: int, new: int, rounds: int) -> dict:
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.inference.loader import load_for_inference, load_sharded
    from omnitron.core.parallel.groups import ParallelGroups

    be, rank = get_backend(), dist.get_rank()
    prompts = _prompts(batch)
    one = load_for_inference(root, be) if rank == 0 else None
    stages = {name: load_sharded(root, ParallelGroups.build(ParallelConfig(**cfg), backend=be), be)
              for name, cfg in (("tp2", {"tensor_model_parallel_size": 2}),
                                ("pp2", {"pipeline_model_parallel_size": 2}))}
    times: dict[str, list[float]] = {"tp1": [], "tp2": [], "pp2": []}
    for i in range(rounds + 1):  # the first round warms up
        dist.barrier()
        flag = os.path.join(root, f"tp1-done-{i}")
        if rank == 0:
            torch.set_num_threads(2)
            times["tp1"].append(_timed(one, prompts, new))
            open(flag, "w").close()
        else:  # NOTE: not a barrier: gloo's wait spins a core, which would halve tp1's second thread
            while not os.path.exists(flag):
                time.sleep(0.05)
        torch.set_num_threads(1)
        for name, loaded in stages.items():
            dist.barrier()
            times[name].append(_timed(loaded, prompts, new))
    return {k: v[1:] for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from omnitron.testing.distributed import run_distributed

    with tempfile.TemporaryDirectory() as root:
        _write_checkpoint(root, args.layers)
        ranks = run_distributed(_worker, 2, root, args.batch, args.new, args.rounds, timeout_s=3600)
    med = {k: statistics.median(max(r[k][i] for r in ranks if r[k]) for i in range(args.rounds))
           for k in ("tp1", "tp2", "pp2")}
    tokens = args.batch * args.new
    rows = [{"layout": k, "ms": med[k] * 1e3, "tok_per_s": tokens / med[k], "vs_tp1": med["tp1"] / med[k]}
            for k in med]
    print(f"gpt3_125m shape, {args.layers} layers, batch {args.batch}, {args.new} new tokens, greedy, "
          f"median of {args.rounds} rounds")
    print(f"{'layout':8s} {'ms':>9s} {'tok/s':>8s} {'vs tp1':>7s}")
    for r in rows:
        print(f"{r['layout']:8s} {r['ms']:9.0f} {r['tok_per_s']:8.1f} {r['vs_tp1']:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
