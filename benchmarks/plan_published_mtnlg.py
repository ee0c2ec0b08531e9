"""Predicted (``omnitron plan``, the A100 profiles) against Megatron-Turing NLG 530B's published training speed
(Smith et al., "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B", arXiv:2201.11990, sec. 2.4):
the same 530B GPT as SC21's 530B row (105 layers, hidden 20,480, 128 heads, sequence 2,048, vocabulary 51,200
padded) at tp8 pp35 with data parallelism 8, 10 and 12 (2,240, 2,800 and 3,360 A100 80GB GPUs on Selene), global
batch 1,920, 60.1 / 50.2 / 44.4 s an iteration, 126 / 121 / 113 teraFLOP/s per GPU (SC21's FLOP formula: 60.1 s
gives 125.7).

Not Megatron's pipeline: DeepSpeed's pipeline engine (1F1B, micro-batch 1, no interleaving), ZeRO stage 1 (the
distributed optimizer's traffic) and full activation checkpointing, under the 2021 stack. Priced with the
``a100-80gb-sxm-2021`` profile (SC21's stack) and ``a100-80gb-sxm``, no overlap of the data-parallel traffic
(DeepSpeed's pipeline reduces after the step), nothing fitted. The three points are a strong-scaling series (the
same model and batch on more GPUs): their ratio does not depend on the kernel rates' level, only on what changes
with dp (fewer micro-batches per pipeline: the bubble's share; the gradient collectives over more nodes).

    PYTHONPATH=. python benchmarks/plan_published_mtnlg.py [--json F]
"""
from __future__ import annotations

import argparse
import json

# GPUs, seconds an iteration, published teraFLOP/s per GPU
POINTS = [(2240, 60.1, 126), (2800, 50.2, 121), (3360, 44.4, 113)]
PROFILES = ("a100-80gb-sxm-2021", "a100-80gb-sxm")


def row(gpus: int, tflops: float) -> tuple:
    """The point in ``plan_published.ROWS``' format."""
    return ("530B", 128, 20480, 105, 8, 35, gpus, 1920, tflops, 1, None, False)


def predict_point(gpus: int, rates):
    """The speed model's step of the point's layout (ZeRO-1 as the distributed optimizer, nothing overlapped)."""
    from plan_published import model_flags

    from omnitron.plan.settings import settings_of
    from omnitron.plan.speed import predict

    flags = model_flags(row(gpus, 0)) | {"layout": f"tp8,pp35,dp{gpus // 280}", "micro_batch_size": 1,
                                         "global_batch_size": 1920, "use_distributed_optimizer": True}
    return predict(settings_of(flags), rates, "none")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the points to this file")
    args = ap.parse_args()
    from plan_published import GPN, paper_flops

    from omnitron.plan.cluster import device_rates

    out = []
    for name in PROFILES:
        rates = device_rates(name, GPN)
        steps = [predict_point(g, rates) for g, _, _ in POINTS]
        print(f"\n{name}: GPUs, published s / TFLOP/s, predicted s / TFLOP/s, error; per-GPU throughput "
              f"relative to 2,240 GPUs, predicted against published")
        for (g, s, tf), st in zip(POINTS, steps):
            pred = paper_flops(row(g, tf)) / st.total / g / 1e12
            rel, pub_rel = steps[0].total * POINTS[0][0] / (st.total * g), POINTS[0][1] * POINTS[0][0] / (s * g)
            print(f"  {g:>5} {s:5.1f} s {tf:4.0f} | {st.total:5.1f} s {pred:6.1f} {pred / tf - 1:+6.1%} | "
                  f"{rel:.3f} against {pub_rel:.3f}   bubble {st.bubble:.2f} s, dp {st.dp:.2f} s")
            out.append({"profile": name, "gpus": g, "published_s": s, "published_tflops": tf,
                        "predicted_s": st.total, "predicted_tflops": pred, "relative": rel,
                        "published_relative": pub_rel, "breakdown_s": st.breakdown()})
    # two terms on the three published points: step = c (m + pp - 1) + F, m micro-batches per pipeline
    (g0, s0, _), (g2, s2, _) = POINTS[0], POINTS[-1]
    m0, m2 = 1920 // (g0 // 280), 1920 // (g2 // 280)
    c = (s0 - s2) / (m0 - m2)
    fixed = s0 - c * (m0 + 34)
    mid = POINTS[1]
    print(f"\npublished points as c (m + 34) + F (fitted on the ends): c = {c:.4f} s a micro-batch slot, F = "
          f"{fixed:.2f} s a step; the middle point {c * (1920 // (mid[0] // 280) + 34) + fixed:.2f} s against "
          f"{mid[1]} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"points": out, "two_terms": {"c": c, "fixed_s": fixed}}, f, indent=1)


if __name__ == "__main__":
    main()
