"""Predicted (omnitron.plan) vs measured memory, every stage, of tp1 layouts of the tiny GPT/Llama shapes and
gpt2_tiny's layer at 100M-model width (hidden 768, 12 heads): first the peak of a whole training step (one
process per pipeline rank, gloo), then one micro-batch's activations against the distinct storages autograd
saves in a real forward of each stage (omnitron.plan.measure).

    PYTHONPATH=. python benchmarks/plan_memory.py
    PYTHONPATH=. python benchmarks/plan_memory.py --moe   # MoE layouts (deepseek_v3_tiny, a tiny Mixtral), whole steps
    PYTHONPATH=. python benchmarks/plan_memory.py --fp8   # FP8 recipes on the tiny GPT, Llama and Mixtral in bf16,
                                                          # whole steps (the prediction with the fp8 and boundary
                                                          # terms, less the delayed state made before the step)
"""
from __future__ import annotations

import time

from omnitron.core.training.arguments import parse_settings
from omnitron.plan.measure import stage_microbatch_bytes
from omnitron.plan.memory import chunk_layers, microbatch_bytes, model_config

TINY = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
        "--max-position-embeddings", "256", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200"]
LLAMA = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--num-query-groups", "2",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--ffn-hidden-size", "352"]
WIDE = ["--num-layers", "4", "--hidden-size", "768", "--num-attention-heads", "12", "--seq-length", "256",
        "--max-position-embeddings", "256", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]
PP2 = ["--pipeline-model-parallel-size", "2"]
LAYOUTS = {
    "tiny pp1": (1, TINY),
    "tiny pp1 mbs2 s256": (1, TINY + ["--micro-batch-size", "2", "--seq-length", "256"]),
    "tiny pp1 selective": (1, TINY + ["--recompute-granularity", "selective"]),
    "tiny pp2 full uniform2": (2, TINY + PP2 + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                                "--recompute-num-layers", "2"]),
    "tiny pp2 full block1 s256": (2, TINY + PP2 + ["--recompute-granularity", "full", "--recompute-method", "block",
                                                   "--recompute-num-layers", "1", "--seq-length", "256"]),
    "tiny pp2 vp2": (2, TINY + PP2 + ["--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "4"]),
    "llama-tiny pp1 bf16": (1, TINY + LLAMA + ["--bf16"]),
    "llama-tiny pp2 mbs2": (2, TINY + LLAMA + PP2 + ["--micro-batch-size", "2"]),
    "h768 pp1": (1, WIDE),
    "h768 pp2 selective": (2, WIDE + PP2 + ["--recompute-granularity", "selective"]),
    "h768 pp2 bf16 mbs2": (2, WIDE + PP2 + ["--bf16", "--micro-batch-size", "2"]),
    "h768 pp1 full uniform1": (1, WIDE + ["--recompute-granularity", "full", "--recompute-method", "uniform"]),
}


TP2 = ["--tensor-model-parallel-size", "2"]
WHOLE_STEP_ONLY = {  # tensor parallel: the per-micro-batch comparison below runs tp 1 only
    "tiny tp2": (2, TINY + TP2),
    "tiny tp2 sp": (2, TINY + TP2 + ["--sequence-parallel"]),
    "h768 tp2 sp mbs2": (2, WIDE + TP2 + ["--sequence-parallel", "--micro-batch-size", "2"]),
    "llama-tiny tp2 pp2 sp": (4, TINY + LLAMA + TP2 + PP2 + ["--sequence-parallel", "--global-batch-size", "4"]),
}


DSV3 = ["--model", "deepseek_v3_tiny", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000"]
MIXTRAL = TINY + LLAMA + ["--num-experts", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
EP2 = ["--expert-model-parallel-size", "2"]
PAD_K4 = ["--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity", "--seq-length", "1024",
          "--max-position-embeddings", "1024", "--moe-router-topk", "4"]
MOE = {  # whole step only: routing decides each rank's rows (the plan assumes balanced routing)
    "dsv3-tiny pp1": (1, DSV3),
    "dsv3-tiny v200 pp1": (1, DSV3 + ["--vocab-size", "200"]),
    "dsv3-tiny ep2": (2, DSV3 + EP2),
    "dsv3-tiny v200 ep2": (2, DSV3 + EP2 + ["--vocab-size", "200"]),
    "mixtral-tiny pp1": (1, MIXTRAL),
    "mixtral-tiny ep2": (2, MIXTRAL + EP2),
    "mixtral-tiny ep2 capacity1": (2, MIXTRAL + EP2 + ["--moe-expert-capacity-factor", "1.0"]),
    "mixtral-tiny ep2 capacity1 pad": (2, MIXTRAL + EP2 + ["--moe-expert-capacity-factor", "1.0",
                                                           "--moe-pad-expert-input-to-capacity"]),
    "mixtral-tiny tp2 etp2": (2, MIXTRAL + TP2),
    "mixtral-tiny tp2 sp etp2": (2, MIXTRAL + TP2 + ["--sequence-parallel"]),
    "mixtral-tiny tp2 ep2 etp1": (2, MIXTRAL + TP2 + EP2 + ["--expert-tensor-parallel-size", "1"]),
    "mixtral-tiny pp2 ep2": (4, MIXTRAL + PP2 + EP2 + ["--global-batch-size", "4"]),
    "mixtral-tiny cp2 ep2": (2, MIXTRAL + EP2 + ["--context-parallel-size", "2"]),
    "llama-tiny cp2 (dense)": (2, TINY + LLAMA + ["--context-parallel-size", "2"]),
    "mixtral-tiny full uniform1": (1, MIXTRAL + ["--recompute-granularity", "full", "--recompute-method", "uniform"]),
    # the ep exchange's buffers (2 MiB each: 4096 rows x 128 x 4 B) against the same layer without ep; padded so
    # both ranks hold the same rows
    "mixtral-tiny pad k4 s1024": (1, MIXTRAL + PAD_K4),
    "mixtral-tiny pad k4 s1024 ep2": (2, MIXTRAL + EP2 + PAD_K4),
}


BF16 = TINY + ["--bf16"]
TENSORWISE, BLOCKWISE = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"], ["--fp8-format", "e4m3",
                                                                                   "--fp8-recipe", "blockwise"]
DELAYED = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"]
ENDS = ["--first-last-layers-bf16"]
FP8 = {  # whole step only (one process each)
    "tiny bf16": (1, BF16),
    "tiny bf16 tensorwise": (1, BF16 + TENSORWISE),
    "tiny bf16 tensorwise ends wide": (1, BF16 + TENSORWISE + ENDS),
    "tiny bf16 delayed": (1, BF16 + DELAYED),
    "tiny bf16 blockwise": (1, BF16 + BLOCKWISE),
    "tiny bf16 blockwise ends wide": (1, BF16 + BLOCKWISE + ENDS),
    "tiny bf16 tensorwise selective": (1, BF16 + TENSORWISE + ["--recompute-granularity", "selective"]),
    "tiny bf16 tensorwise full block1": (1, BF16 + TENSORWISE + ["--recompute-granularity", "full",
                                                                 "--recompute-method", "block",
                                                                 "--recompute-num-layers", "1"]),
    "llama-tiny bf16 tensorwise": (1, TINY + LLAMA + ["--bf16"] + TENSORWISE),
    "mixtral-tiny bf16": (1, MIXTRAL + ["--bf16"]),
    "mixtral-tiny bf16 tensorwise": (1, MIXTRAL + ["--bf16"] + TENSORWISE),
    "mixtral-tiny bf16 delayed": (1, MIXTRAL + ["--bf16"] + DELAYED),
    "mixtral-tiny ep2 bf16": (2, MIXTRAL + EP2 + ["--bf16"]),
    "mixtral-tiny ep2 bf16 tensorwise": (2, MIXTRAL + EP2 + ["--bf16"] + TENSORWISE),
    "mixtral shared64 bf16 tensorwise": (1, MIXTRAL + ["--bf16", "--moe-shared-expert-intermediate-size", "64"]
                                         + TENSORWISE),
    "mixtral-tiny bf16 grouped": (1, MIXTRAL + ["--bf16", "--moe-grouped-gemm"]),  # wide: the grouped GEMM
    "mixtral-tiny bf16 tensorwise grouped": (1, MIXTRAL + ["--bf16", "--moe-grouped-gemm"] + TENSORWISE),
    "mixtral-tiny ep2 bf16 tensorwise grouped": (2, MIXTRAL + EP2 + ["--bf16", "--moe-grouped-gemm"] + TENSORWISE),
}


def rank_step_peak(argv: list[str], root: str, world: int) -> tuple[int, int]:
    """This rank's (measured step peak, predicted activations + logits + recompute + transient of its stage, and
    under FP8 its fp8 and boundary terms, the fp8 term less the delayed recipe's scaling state, which exists before
    the step and counts 0 there); the measurement is omnitron.plan.measure.train_step_peak."""
    import torch

    from omnitron.plan.fp8_memory import fp8_state_bytes
    from omnitron.plan.measure import train_step_peak
    from omnitron.plan.memory import estimate

    torch.set_num_threads(1)
    stage, peak = train_step_peak(argv, world, root)
    s = parse_settings(argv, world)
    e = estimate(s)[stage]
    fp8 = e.fp8 + e.boundary - fp8_state_bytes(s, model_config(s), stage) if s.fp8 else 0
    return peak, e.activations + e.logits + e.recompute + e.transient + fp8


def step_peaks(name: str, root: str) -> list[tuple[int, int]]:
    """(measured, predicted) per rank of one whole training step of layout ``name``."""
    from omnitron.testing.distributed import run_distributed

    world, argv = {**LAYOUTS, **WHOLE_STEP_ONLY, **MOE, **FP8}[name]
    if world == 1:
        return [rank_step_peak(argv, root, 1)]
    return run_distributed(rank_step_peak, world, argv, root, world)


def main() -> None:
    import sys
    import tempfile

    moe, fp8 = "--moe" in sys.argv[1:], "--fp8" in sys.argv[1:]
    with tempfile.TemporaryDirectory() as root:
        print(f"{'layout (whole step)':42s} {'rank':>5s} {'predicted MiB':>14s} {'step peak MiB':>14s} {'error':>8s}")
        worst, start = 0.0, time.perf_counter()
        names = list(MOE) if moe else list(FP8) if fp8 else [*LAYOUTS, *WHOLE_STEP_ONLY]
        for name in names:
            for rank, (peak, pred) in enumerate(step_peaks(name, root)):
                worst = max(worst, abs(pred / peak - 1))
                print(f"{name:42s} {rank:5d} {pred / 2**20:14.3f} {peak / 2**20:14.3f} "
                      f"{100 * (pred / peak - 1):+7.2f}%")
        print(f"worst |error| {100 * worst:.2f}% over {len(names)} layouts, {time.perf_counter() - start:.0f} s")
    if not moe and not fp8:
        micro()


def micro() -> None:
    print(f"{'layout':28s} {'stage':>8s} {'predicted MiB':>14s} {'measured MiB':>13s} {'error':>8s}")
    worst, start = 0.0, time.perf_counter()
    for name, (world, argv) in LAYOUTS.items():
        s = parse_settings(argv, world)
        cfg = model_config(s)
        layers = chunk_layers(s, cfg)
        pp, vp = s.parallel.pipeline_model_parallel_size, s.parallel.virtual_pipeline_model_parallel_size or 1
        for key, real in stage_microbatch_bytes(s, cfg).items():
            acts, logits = microbatch_bytes(s, cfg, layers[key], last=key == (pp - 1, vp - 1), first=key == (0, 0))
            err = (acts + logits) / real - 1
            worst = max(worst, abs(err))
            print(f"{name:28s} {str(key):>8s} {(acts + logits) / 2**20:14.3f} {real / 2**20:13.3f} {100 * err:+7.3f}%")
    print(f"worst |error| {100 * worst:.3f}% over {len(LAYOUTS)} layouts, {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
