"""Predicted (``omnitron plan --device h100-sxm``) against Megatron-Core's published weak scaling on H100 (Megatron-LM
README, "New scaling figures on H100 GPUs", commit f2e5db4 of 2024-07-15, ``images/model_table.png``; Megatron-Core
r0.8.0): GPT models of 1.7B to 462B parameters on 48 to 6,144 H100s, each row's tensor / pipeline / data-parallel
sizes, global batch and achieved teraFLOP/s per GPU.

What the README states: vocabulary 131,072, sequence 4,096, "fine-grained overlapping of data-parallel
(``--overlap-grad-reduce --overlap-param-gather``), tensor-parallel (``--tp-comm-overlap``) and pipeline-parallel
communication", end-to-end throughput. What follows from it: bf16 (the MFU column is the teraFLOP/s over the 989
dense bf16 peak), sequence parallelism (``--tp-comm-overlap`` requires it), the distributed optimizer
(``--overlap-param-gather`` requires it), untied embeddings and a 4h GeLU MLP (the parameter counts: 1.7B =
12 l h^2 + 2 V h at h 2048, l 24). FLOPs: Megatron's ``num_floating_point_operations`` of that commit,
``12 B s l h^2 ((1 + g/n + s/h) + f/h + V / (2 l h))`` (no recomputation counted, the attention core not halved for
causality as later versions do).

Not stated, so left to the plan: the micro-batch size, virtual pipeline stages, activation recomputation (each
row is priced at the plan's fastest variant of its layout that fits 80 GB: :func:`best_variant`); dropout is
Megatron's default 0.1 (``--dropout 0`` prices the other reading). Communication is priced hidden where compute
runs beside it, the tensor-parallel collectives included (``--assume-overlap megatron``: Megatron-LM's
``--tp-comm-overlap``, which the README names; omnitron's engine accepts that flag and does not run it).
``--overlap all`` prices the same rows as omnitron's engine would run them (tp collectives waited where issued).

Then the search (``--rank``): the published layout's best variant against the plan's best layout in Megatron-Core
r0.8's space (tp within a node, 1F1B or interleaved; no V-shaped schedules).

``--fit``: one constant on the profile's kernel rates fitted on the odd rows, the even rows held out (as
``plan_published.py --fit`` for SC21).

``--strong``: the README's strong scaling of the 177B model ("from 96 H100 GPUs to 4608 GPUs, using the same batch
size of 1,152 sequences throughout ... a reduction in MFU from 47% to 42%"; at 2,304 GPUs it is the table's 177B
row, tp8 pp6). The ratio of the two ends' throughput per GPU does not depend on the kernel rates' level, only on
what changes with data parallelism (fewer micro-batches per pipeline: the bubble; the gradient and parameter
collectives over more nodes), so it checks the machine model at scale apart from the profile's efficiency curves.

    PYTHONPATH=. python benchmarks/plan_published_h100.py [--rows 1.7B,70B] [--dropout 0.1] [--rank] [--strong]
        [--fit] [--overlap megatron|all] [--device h100-sxm] [--json F]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

# name, heads, hidden, layers, tp, pp, dp, GPUs, global batch, published teraFLOP/s per GPU (MFU)
ROWS = [
    ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1),
    ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6),
    ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7),
    ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5),
    ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8),
    ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4),
    ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9),
]
DEVICE, GPN, SEQ, VOCAB, OVERLAP = "h100-sxm", 8, 4096, 131072, "megatron"


def model_flags(row, dropout: float) -> dict:
    """The row's model as plan flags (NullTokenizer's ids + end of document = 131,072)."""
    _, heads, hidden, layers, *_ = row
    return {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads, "seq_length": SEQ,
            "max_position_embeddings": SEQ, "tokenizer_type": "NullTokenizer", "vocab_size": VOCAB - 1,
            "untie_embeddings_and_output_weights": True, "bf16": True, "attention_dropout": dropout,
            "hidden_dropout": dropout, "global_batch_size": row[8], "nproc_per_node": row[7]}


def flops_2024(row) -> float:
    """Megatron-Core r0.8's model FLOPs per step (module docstring; multi-head attention, g = n)."""
    _, _, h, L, *_, B, _ = row
    return 12.0 * B * SEQ * L * h * h * ((1 + 1 + SEQ / h) + 4 + VOCAB / (2 * L * h))


def in_mcore_space(c) -> bool:
    """Whether Megatron-Core r0.8 runs candidate ``c``: no V-shaped schedule (ZB-V / DualPipeV came later), the
    layers split evenly (``--account-for-*-in-pipeline-split`` came in 2025), context parallelism as the ring
    (``--cp-comm-type`` came with core_r0.10.0)."""
    return (not c.flags.get("pipeline_schedule") and not c.settings.parallel.uneven_pipeline
            and c.settings.parallel.cp_comm_type == "p2p")


def fastest_fitting(cands, rates, memory: int):
    """The fastest of ``cands`` whose every stage fits ``memory`` (memory estimated fastest first)."""
    from omnitron.plan.memory import estimate
    from omnitron.plan.speed import predict

    for c in cands:
        c.step = predict(c.settings, rates, OVERLAP)
    for c in sorted(cands, key=lambda c: -c.step.tokens_per_s):
        c.stages = estimate(c.settings, transients=False, device=rates.profile)
        if c.peak <= memory:
            return c
    return None


def best_variant(row, rates, dropout: float):
    """The plan's fastest variant (micro-batch, vpp, recomputation: none, full or block, as the search tries them)
    of the row's published tp / pp / dp that fits."""
    from omnitron.plan.recommend import _blocks, candidates

    tp, pp, dp, n = row[4], row[5], row[6], row[7]
    cands = [c for c in candidates(model_flags(row, dropout), n, cluster=GPN) if in_mcore_space(c) and
             (c.settings.parallel.tensor_model_parallel_size, c.settings.parallel.pipeline_model_parallel_size,
              c.settings.parallel.context_parallel_size, c.settings.dp) == (tp, pp, 1, dp)]
    return fastest_fitting(cands + [b for c in cands for b in _blocks(c)], rates, rates.profile.memory_bytes)


def best_layout(row, rates, dropout: float):
    """The plan's fastest layout in Megatron-Core r0.8's space that fits (the bounded walk of the cluster search)."""
    from omnitron.plan.recommend import _bounded, candidates

    cands = [c for c in candidates(model_flags(row, dropout), row[7], cluster=GPN) if in_mcore_space(c)]
    fit = _bounded(cands, rates.profile.memory_bytes, rates, OVERLAP, 1)
    return fit[0] if fit else None


STRONG = (("96", 2, 0.47), ("2304", 48, 0.44), ("4608", 96, 0.42))
"""GPUs, dp and the published MFU of the 177B strong-scaling points the README gives in numbers (the table's row
for 2,304)."""


def strong_scaling(rates, dropout: float) -> list[dict]:
    """TFLOP/s per GPU of tp8 pp6 (micro-batch 1, no recomputation) at each :data:`STRONG` point (global batch
    1,152), relative to the 96-GPU point at the same vpp, for each vpp the README does not rule out, against the
    published MFUs' ratio (each MFU rounded to 1%: +-0.5 points)."""
    from omnitron.plan.settings import settings_of
    from omnitron.plan.speed import predict

    base = next(r for r in ROWS if r[0] == "177B")
    print("\nstrong scaling, 177B tp8 pp6 mbs1, global batch 1152 (README: MFU 47% at 96 GPUs, 42% at 4,608; the "
          "table: 44% at 2,304); throughput per GPU relative to 96 GPUs at the same vpp")
    out = []
    for vpp in (1, 2, 4, 8, 16):
        got = []
        for gpus, dp, mfu in STRONG:
            row = base[:6] + (dp, int(gpus), 1152, mfu * 989.0)
            flags = model_flags(row, dropout) | {"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 6,
                                                 "micro_batch_size": 1, "sequence_parallel": True,
                                                 "use_distributed_optimizer": True}
            if vpp > 1:
                flags["num_layers_per_virtual_pipeline_stage"] = 96 // (6 * vpp)
            got.append(flops_2024(row) / predict(settings_of(flags), rates, OVERLAP).total / row[7] / 1e12)
        ratios = [g / got[0] for g in got]
        out.append({"vpp": vpp, "tflops": got, "ratio_to_96": ratios})
        cells = (f"{p[0]:>4} GPUs {g:6.1f} ({r:.3f})" for p, g, r in zip(STRONG, got, ratios))
        print(f"  vpp {vpp:>2}: " + "  ".join(cells))
    pub = [m / STRONG[0][2] for _, _, m in STRONG]
    rng = [((m - 0.005) / (STRONG[0][2] + 0.005), (m + 0.005) / (STRONG[0][2] - 0.005)) for _, _, m in STRONG]
    print("  published: " + "  ".join(f"{p[0]:>4} GPUs {r:.3f} ({lo:.3f}-{hi:.3f})" for p, r, (lo, hi) in
                                      zip(STRONG, pub, rng)))
    return out


def held_out_fit(dropout: float) -> dict:
    """One constant ``f`` on the profile's kernel rates (peaks, memory bandwidth; links unchanged), fitted on the odd
    rows (1.7B, 16B, 70B, 177B, 462B: mean log error 0), then every row's error at ``f``: how much of the gap a
    single rate explains (:func:`plan_published.fit_odd_rows`)."""
    import math

    from plan_published import _scaled, fit_odd_rows

    from omnitron.plan.profile import load

    def errors(f, rows):
        rates = _scaled(load(DEVICE), f)
        return [math.log(flops_2024(r) / best_variant(r, rates, dropout).step.total / r[7] / 1e12 / r[9])
                for r in rows]

    return fit_odd_rows(errors, ROWS, 0.75, "kernel rates at")


def _use(device: str, overlap: str) -> None:
    """Price every row on ``device`` under ``overlap`` (this module's constants, which its functions read)."""
    global DEVICE, OVERLAP
    DEVICE, OVERLAP = device, overlap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", help="comma-separated row names (default: all)")
    ap.add_argument("--dropout", type=float, default=0.1, help="attention and hidden dropout (Megatron's default)")
    ap.add_argument("--rank", action="store_true", help="also search every layout (Megatron-Core r0.8's space)")
    ap.add_argument("--strong", action="store_true", help="the 177B strong-scaling ends (96 -> 4,608 GPUs)")
    ap.add_argument("--fit", action="store_true", help="fit one kernel-rate constant on the odd rows, report the even")
    ap.add_argument("--overlap", choices=("megatron", "all"), default=OVERLAP, help="--assume-overlap: megatron "
                    "(the published runs' --tp-comm-overlap, default) or all (omnitron's engine)")
    ap.add_argument("--device", default=DEVICE, help="device profile (default h100-sxm)")
    ap.add_argument("--json", help="write the rows to this file")
    args = ap.parse_args()
    _use(args.device, args.overlap)
    from omnitron.plan.cluster import device_rates

    rates = device_rates(DEVICE, GPN)
    prof = rates.profile
    print(f"device profile: {prof.name} ({prof.title}), {GPN} per node; overlap assumed: {OVERLAP}; dropout "
          f"{args.dropout}; FLOPs: Megatron-Core r0.8's formula (module docstring)")
    print(f"{'model':>6} {'tp':>3} {'pp':>3} {'dp':>3} {'GPUs':>5} {'published':>9} {'predicted':>9} {'error':>7}  "
          f"{'variant (the plan picks mbs, vpp, recompute)':44s}" + (f" {'best/':>6} best layout" if args.rank else ""))
    wanted = set(args.rows.split(",")) if args.rows else None
    out, errors = [], []
    for row in ROWS:
        if wanted and row[0] not in wanted:
            continue
        t0 = time.time()
        c = best_variant(row, rates, args.dropout)
        if c is None:
            print(f"{row[0]:>6}: no variant of the published layout fits {prof.memory_bytes / 2**30:.0f} GiB")
            continue
        pred = flops_2024(row) / c.step.total / row[7] / 1e12
        err = pred / row[9] - 1
        errors.append(err)
        rec = {"model": row[0], "tp": row[4], "pp": row[5], "dp": row[6], "gpus": row[7], "published_tflops": row[9],
               "predicted_tflops": pred, "error": err, "variant": c.name(), "peak_gib": c.peak / 2**30,
               "breakdown_s": c.step.breakdown()}
        line = f"{row[0]:>6} {row[4]:>3} {row[5]:>3} {row[6]:>3} {row[7]:>5} {row[9]:9.1f} {pred:9.1f} {err:+7.1%}  " \
               f"{c.name():44s}"
        if args.rank:
            best = best_layout(row, rates, args.dropout)
            ratio = best.step.tokens_per_s / c.step.tokens_per_s
            rec.update(best=best.name(), best_over_published=ratio)
            line += f" {ratio:6.3f} {best.name()}"
        print(line + f"  ({time.time() - t0:.0f} s)")
        out.append(rec)
    if errors:
        a = [abs(e) for e in errors]
        print(f"\n|error|: median {statistics.median(a):.1%}, max {max(a):.1%}; within 15%: "
              f"{sum(e <= 0.15 for e in a)}/{len(a)}")
    strong = strong_scaling(rates, args.dropout) if args.strong else None
    fitted = held_out_fit(args.dropout) if args.fit else None
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": DEVICE, "gpus_per_node": GPN, "overlap": OVERLAP, "dropout": args.dropout, "rows": out,
                       "strong": strong, "fit": fitted}, f, indent=1)


if __name__ == "__main__":
    main()
