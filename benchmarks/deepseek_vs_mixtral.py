"""A DeepSeek-V3-shaped tiny model against a Mixtral-shaped one of equal active parameters, at ep2 on CPU.

DeepSeek-V3 shape: MLA (query and key/value latents), the first layer dense, then MoE layers of many narrow
experts (16 of width F/4, top-2 of 4 groups, sigmoid scores with the expert bias, x 2.5) plus a shared expert,
and one MTP depth. Mixtral shape: grouped-query attention and every layer MoE with 8 wide experts, top-2 softmax.
The Mixtral expert width is chosen so that both models have the same active parameters per token (every
non-expert parameter plus top-k experts per MoE layer, the MTP depth included), within one expert column.

Each model trains ``--iters`` steps through ``omnitron train`` on 2 gloo processes (``--expert-model-parallel-size
2``, data parallel 2), mock data; reported: the median ``step_time_s`` after the first step, tokens/s, and
``peak_memory_bytes`` (the largest rank's peak of the backend's allocator: process RSS growth on CPU).
``--profile`` instead splits the time: each model in this one process (no expert parallelism, one thread), the
median forward + backward of one micro-batch, then torch.profiler's operators by self CPU time over two of them.

    python benchmarks/deepseek_vs_mixtral.py [--iters 8] [--json FILE] [--profile]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

H, LAYERS, SEQ, VOCAB = 256, 4, 256, 1024
COMMON = ["--num-layers", str(LAYERS), "--hidden-size", str(H), "--seq-length", str(SEQ), "--max-position-embeddings",
          str(SEQ), "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data", "--tokenizer-type",
          "NullTokenizer", "--vocab-size", str(VOCAB), "--normalization", "RMSNorm", "--swiglu",
          "--disable-bias-linear",
          "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--hidden-dropout", "0",
          "--attention-dropout", "0", "--lr", "1e-4", "--log-interval", "1", "--eval-interval", "0",
          "--expert-model-parallel-size", "2", "--moe-grouped-gemm", "--moe-aux-loss-coeff", "1e-3"]
DEEPSEEK = ["--num-attention-heads", "8", "--ffn-hidden-size", "1024", "--multi-latent-attention",
            "--q-lora-rank", "128",
            "--kv-lora-rank", "64", "--qk-head-dim", "32", "--qk-pos-emb-head-dim", "16", "--v-head-dim", "32",
            "--qk-layernorm", "--num-experts", "16", "--moe-ffn-hidden-size", "128",
            "--moe-shared-expert-intermediate-size",
            "128", "--moe-layer-freq", "[0]+[1]*3", "--moe-router-topk", "2", "--moe-router-score-function", "sigmoid",
            "--moe-router-enable-expert-bias", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
            "--moe-router-topk-scaling-factor", "2.5", "--moe-router-load-balancing-type", "seq_aux_loss",
            "--mtp-num-layers", "1"]


def mixtral(width: int) -> list[str]:
    return ["--num-attention-heads", "8", "--num-query-groups", "2", "--ffn-hidden-size", str(width),
            "--num-experts", "8", "--moe-ffn-hidden-size", str(width), "--moe-router-topk", "2"]


def active_parameters(args: list[str]) -> int:
    """Every parameter except the experts a token does not visit (E - k per MoE layer, MTP's layer included)."""
    from omnitron.core.models.gpt.config import num_parameters
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.transformer.moe.pattern import moe_layer_pattern

    from dataclasses import replace

    c = replace(parse_settings(args, 2).model, vocab_size=VOCAB)  # NullTokenizer's vocabulary (no tokenizer here)
    moe_layers = sum(moe_layer_pattern(c.moe_layer_freq, c.num_layers))
    moe_layers += (c.mtp_num_layers or 0) if moe_layer_pattern(c.moe_layer_freq, c.num_layers)[-1] else 0
    expert = 3 * c.hidden_size * c.moe_ffn_hidden_size  # SwiGLU, no biases
    return num_parameters(c) - moe_layers * (c.num_experts - c.moe_router_topk) * expert


def run(name: str, args: list[str], iters: int) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as d:
        full = args + ["--train-iters", str(iters), "--log-dir", d, "--nproc-per-node", "2"]
        proc = subprocess.run([sys.executable, "-m", "omnitron", "train", *full], capture_output=True, text=True,
                              cwd=d, env=env)
        if proc.returncode:
            raise SystemExit(f"{name}: omnitron train failed:\n{proc.stderr[-3000:]}")
        recs = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl")) if '"lm_loss"' in line]
    steps = [r["step_time_s"] for r in recs[1:]]
    return {"model": name, "active_parameters": active_parameters(args), "step_s": statistics.median(steps),
            "tokens_per_s": 4 * SEQ / statistics.median(steps),
            "peak_memory_MiB": max(r.get("peak_memory_bytes") or 0 for r in recs) / 2**20,
            "final_loss": recs[-1]["lm_loss"]}


def profile(args: list[str], rows: int = 12) -> None:
    """One micro-batch's forward + backward of the model ``args`` builds, timed and profiled in this process."""
    import time
    from dataclasses import replace

    import torch

    from omnitron.core.models.gpt import GPTModel
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.training.arguments import parse_settings

    i = args.index("--expert-model-parallel-size")
    c = replace(parse_settings(args[:i] + args[i + 2:], 1).model, vocab_size=VOCAB)
    torch.set_num_threads(1)
    model, tokens = GPTModel(c, ParallelGroups.single(), seed=1), torch.randint(0, VOCAB, (2, SEQ))
    positions, labels = torch.arange(SEQ).expand(2, -1), torch.randint(0, VOCAB, (2, SEQ))

    def step() -> float:
        t = time.perf_counter()
        model(tokens, positions, labels=labels).mean().backward()
        return time.perf_counter() - t

    times = [step() for _ in range(7)][2:]
    with torch.profiler.profile() as prof:
        step(), step()
    print(f"forward + backward of one micro-batch [2, {SEQ}]: median {statistics.median(times) * 1e3:.1f} ms")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=40))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--json")
    ap.add_argument("--profile", action="store_true", help="split one process's time by operator instead")
    a = ap.parse_args()
    want = active_parameters(COMMON + DEEPSEEK)
    width = min(range(64, 1025, 8), key=lambda w: abs(active_parameters(COMMON + mixtral(w)) - want))
    if a.profile:
        for name, extra in (("DeepSeek-V3 shape", DEEPSEEK), (f"Mixtral shape (F={width})", mixtral(width))):
            print(f"== {name}")
            profile(COMMON + extra)
        return
    rows = [run("DeepSeek-V3 shape", COMMON + DEEPSEEK, a.iters), run(f"Mixtral shape (F={width})",
                                                                       COMMON + mixtral(width), a.iters)]
    for r in rows:
        print(" | ".join(f"{k} {v:,.3f}" if isinstance(v, float) else f"{k} {v:,}" if isinstance(v, int) else str(v)
                         for k, v in r.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
