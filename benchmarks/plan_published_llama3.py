"""Predicted (``omnitron plan --device h100-sxm``) against Llama 3 405B's pre-training throughput (Grattafiori et
al., "The Llama 3 Herd of Models", arXiv:2407.21783, sec. 3.3.2 and Table 4): 8,192 and 16,384 H100s, tensor /
context / pipeline / data-parallel sizes, 16M tokens a step, and 430, 400, 380 teraFLOP/s per GPU (BF16 MFU 43%,
41%, 38%).

A third published table beside SC21 (``plan_published.py``) and Megatron-Core's H100 table
(``plan_published_h100.py``), and the largest: a different team, code and network (RoCE, 400 Gb/s a GPU), 2.7x the
GPUs of the H100 table's largest row, context parallelism at 131,072 tokens. Nothing here is fitted to it.

What the paper states: the model (``llama3_405b``: 126 layers, hidden 16,384, 128 heads / 8 KV groups, SwiGLU
53,248, vocabulary 128,256, untied, no dropout), bf16, the layouts, sequence lengths and sequences per data-parallel
replica; the pipeline with one layer fewer on its first and last stage (the embedding and the loss counted as
layers: Megatron's ``--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split``, 128 slots,
which interleaving up to 8 chunks a rank divides); FSDP sharding the optimizer state and gradients, not the weights
(the distributed optimizer's traffic); MFU as Chowdhery et al. (PaLM, App. B) define it.

Not stated, so left to the plan: the micro-batch size, the chunks per rank (vpp), activation recomputation (none,
selective, full, or block: the first k layers of each chunk; each row at the plan's fastest variant that fits
80 GB, as ``plan_published_h100.py`` does), sequence parallelism (on:
tp 8 without it holds the whole sequence's activations eight times), and how much communication hides: priced three
ways, ``--assume-overlap megatron`` (the tensor-parallel collectives and the pipeline sends beside compute, as
Megatron-Core's table ran them with ``--tp-comm-overlap``, and the reading ``h100-sxm-at-scale`` was fitted under),
``all`` (as omnitron's engine runs them: tp collectives waited where issued) and ``dp`` (only the data-parallel
traffic hidden). Under every reading the context-parallel all-gather is waited for where it is issued, as the paper
says of it ("exposed in the critical path", sec. 3.3.2).

FLOPs (PaLM's MFU): ``6 N + 12 L h s`` a token, N = 405,853,388,800 (every parameter; the input embedding's 2.1B do
no multiply: 0.5%), the attention term not halved for the causal mask. ``--causal`` halves it (Megatron-Core's
current formula does): 4% fewer FLOPs at 8,192 tokens, 29% at 131,072, so the third row's published figure implies a
step 1.4x shorter under that reading; both are printed.

Differences priced as the engine has them: the rank order (Megatron's tp-cp-ep-dp-pp; Llama 3's was tp-cp-pp-dp:
both put each data-parallel and pipeline neighbour on another node), no oversubscription between pods (the paper's
RoCE fabric has some; only data-parallel traffic crosses pods there). Context parallelism as the paper describes it
and the engine runs it, ``--cp-comm-type allgather``: keys and values all-gathered, each rank's two chunks of
queries against them (``omnitron.plan.cp_comm``); the search (``--rank``) tries the ring, the all-gather and the
all-to-all at every cp > 1.

Kernel rates: ``h100-sxm`` (one GPU's measured curves) and ``h100-sxm-at-scale`` (those x 0.709, the one constant
``plan_published_h100.py --fit`` fitted on the odd rows of Megatron-Core's H100 table): this table is held out
from that fit entirely.

``--rank``: the search's best layout (``h100-sxm-at-scale``, overlap megatron, 1F1B / interleaved) against each
published layout's best variant.

    PYTHONPATH=. python benchmarks/plan_published_llama3.py [--causal] [--rank] [--comm-types] [--json F]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

# GPUs, tp, cp, pp, dp, sequence length, sequences per data-parallel replica a step, published TFLOP/s per GPU
ROWS = [
    (8192, 8, 1, 16, 64, 8192, 32, 430.0),
    (16384, 8, 1, 16, 128, 8192, 16, 400.0),
    (16384, 8, 16, 16, 8, 131072, 16, 380.0),
]
DEVICES, GPN = ("h100-sxm", "h100-sxm-at-scale"), 8
OVERLAPS = ("megatron", "all", "dp")
FITTED = "megatron"
"""The overlap ``h100-sxm-at-scale`` was fitted under (``plan_published_h100.py``): the held-out reading, and the
one ``--rank`` and ``--comm-types`` use."""


def flops_per_token(seq: int, causal: bool) -> float:
    """PaLM's model FLOPs a token, ``6 N + 12 L h s`` (``causal``: the attention term halved), N counted on the
    ``llama3_405b`` preset (405,853,388,800, the released checkpoint's total)."""
    from omnitron.core.models.gpt.config import num_parameters
    from omnitron.core.models.gpt.presets import llama3_405b

    cfg = llama3_405b()
    return 6.0 * num_parameters(cfg) + 12.0 * cfg.num_layers * cfg.hidden_size * seq / (2 if causal else 1)


def row_flags(row, comm: str = "allgather") -> dict:
    """The row's model and layout as plan flags (``comm``: the ``--cp-comm-type`` where cp > 1, the paper's)."""
    gpus, tp, cp, pp, dp, seq, per_dp, _ = row
    return {"model": "llama3_405b", "seq_length": seq, "max_position_embeddings": seq, "bf16": True,
            "tokenizer_type": "NullTokenizer", "vocab_size": 128255, "nproc_per_node": gpus,
            "tensor_model_parallel_size": tp, "context_parallel_size": cp, "pipeline_model_parallel_size": pp,
            "global_batch_size": per_dp * dp, "sequence_parallel": True, "use_distributed_optimizer": True,
            "account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True} | (
                {"cp_comm_type": comm} if cp > 1 else {})


def variants(row, comm: str = "allgather") -> list:
    """Every (micro-batch, chunks per rank, recomputation) of the row's layout the engine accepts."""
    from omnitron.core.config.parallel import ConfigError
    from omnitron.plan.layouts import Choice
    from omnitron.plan.settings import settings_of

    per_dp, slots = row[6], (126 + 2) // row[3]  # the embedding and the loss counted as layers
    out = []
    for mbs in (m for m in (1, 2, 4) if per_dp % m == 0):
        # interleaving needs the micro-batches a multiple of pp (the engine's schedule, as Megatron's)
        for vpp in (v for v in (1, 2, 4, 8) if slots % v == 0 and (v == 1 or (per_dp // mbs) % row[3] == 0)):
            per_chunk = slots // vpp
            # none, selective, full (every layer), and block: the first k layers of each chunk (k < its layers)
            for rec in (None, "selective", "full", *range(1, per_chunk)):
                f = row_flags(row, comm) | {"micro_batch_size": mbs}
                if vpp > 1:
                    f["num_virtual_stages_per_pipeline_rank"] = vpp
                if rec == "full":
                    f.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
                elif isinstance(rec, int):
                    f.update(recompute_granularity="full", recompute_method="block", recompute_num_layers=rec)
                elif rec:
                    f["recompute_granularity"] = rec
                try:
                    out.append(Choice(f, settings_of(f)))
                except ConfigError:
                    continue
    return out


def best(row, rates, overlap: str, comm: str = "allgather"):
    """The fastest variant of the row's layout (``comm``: its ``--cp-comm-type``) that fits the profile's memory."""
    from omnitron.plan.memory import estimate
    from omnitron.plan.speed import predict

    cands = variants(row, comm)
    for c in cands:
        c.step = predict(c.settings, rates, overlap)
    for c in sorted(cands, key=lambda c: -c.step.tokens_per_s):
        c.stages = estimate(c.settings, transients=False, device=rates.profile)
        if c.peak <= rates.profile.memory_bytes:
            return c
    return None


LAYOUT_KEYS = ("tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size",
               "sequence_parallel", "use_distributed_optimizer", "account_for_embedding_in_pipeline_split",
               "account_for_loss_in_pipeline_split")


def best_layout(row, rates):
    """The plan's fastest layout that fits for the row's model, GPUs and batch, in the 1F1B / interleaved space
    (the search of ``omnitron plan --devices``: its recomputation is all or none, no block)."""
    from omnitron.plan.recommend import _bounded, candidates

    given = {k: v for k, v in row_flags(row).items() if k not in LAYOUT_KEYS}
    cands = [c for c in candidates(given, row[0], cluster=GPN) if not c.flags.get("pipeline_schedule")]
    fit = _bounded(cands, rates.profile.memory_bytes, rates, FITTED, 1)
    return fit[0] if fit else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--causal", action="store_true", help="halve the attention FLOPs for the causal mask")
    ap.add_argument("--rank", action="store_true", help="also search every layout (h100-sxm-at-scale, overlap "
                    "megatron; minutes a row)")
    ap.add_argument("--comm-types", action="store_true", help="also price the cp rows' layout with each "
                    "--cp-comm-type (h100-sxm-at-scale, overlap megatron)")
    ap.add_argument("--json", help="write the rows to this file")
    args = ap.parse_args()
    from omnitron.plan.cluster import device_rates

    scales = [(name, device_rates(name, GPN)) for name in DEVICES]
    print(f"device profiles: {', '.join(DEVICES)}, {GPN} per node; FLOPs: 6N + 12 L h s a token"
          f"{' (attention halved: causal)' if args.causal else ' (PaLM)'}")
    print(f"{'GPUs':>6} {'tp':>2} {'cp':>2} {'pp':>2} {'dp':>3} {'seq':>6} {'pub.':>5} {'profile':>17} {'overlap':>8} "
          f"{'pred.':>6} {'error':>7}  {'step s':>6} {'pub. s':>6}  variant (the plan picks mbs, vpp, recompute)")
    out, errs = [], {}
    for row in ROWS:
        gpus, tp, cp, pp, dp, seq, per_dp, pub = row
        tokens = per_dp * dp * seq
        work = tokens * flops_per_token(seq, args.causal)
        pub_step = work / gpus / (pub * 1e12)
        for label, rates in scales:
            for overlap in OVERLAPS:
                t0 = time.time()
                c = best(row, rates, overlap)
                if c is None:
                    print(f"{gpus:>6} {tp:>2} {cp:>2} {pp:>2} {dp:>3} {seq:>6}: no variant fits")
                    continue
                pred = work / c.step.total / gpus / 1e12
                err = pred / pub - 1
                errs.setdefault((label, overlap), []).append(err)
                print(f"{gpus:>6} {tp:>2} {cp:>2} {pp:>2} {dp:>3} {seq:>6} {pub:5.0f} {label:>17} {overlap:>8} "
                      f"{pred:6.1f} {err:+7.1%}  {c.step.total:6.2f} {pub_step:6.2f}  {c.name()} "
                      f"({time.time() - t0:.0f} s)")
                out.append({"gpus": gpus, "tp": tp, "cp": cp, "pp": pp, "dp": dp, "seq": seq, "published_tflops": pub,
                            "profile": label, "overlap": overlap, "predicted_tflops": pred, "error": err,
                            "variant": c.name(), "peak_gib": c.peak / 2**30, "step_s": c.step.total,
                            "breakdown_s": c.step.breakdown()})
    ranked = rank_rows(scales[-1][1], out) if args.rank else None
    if args.comm_types:
        comm_rows(scales[-1][1], args.causal)
    print()
    for (label, overlap), e in errs.items():
        print(f"{label}, overlap {overlap}: errors " + ", ".join(f"{x:+.1%}" for x in e) +
              f"; |error| median {statistics.median(map(abs, e)):.1%}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"devices": DEVICES, "gpus_per_node": GPN, "causal": args.causal, "rows": out, "rank": ranked},
                      fh, indent=1)


def comm_rows(rates, causal: bool) -> None:
    """Each cp > 1 row's layout priced with the ring, the all-gather (the paper's) and the all-to-all."""
    print(f"\nthe cp rows under each --cp-comm-type ({rates.profile.name}, overlap {FITTED})")
    for row in (r for r in ROWS if r[2] > 1):
        work = row[6] * row[4] * row[5] * flops_per_token(row[5], causal)
        for comm in ("p2p", "allgather", "a2a"):
            c = best(row, rates, FITTED, comm)
            pred = work / c.step.total / row[0] / 1e12
            print(f"{row[0]:>6} GPUs seq {row[5]:>6} {comm:>9}: {c.name()} {c.step.total:.2f} s, {pred:.1f} TFLOP/s "
                  f"({pred / row[7] - 1:+.1%}), {c.peak / 2**30:.1f} GiB")


def rank_rows(rates, out: list) -> list[dict]:
    """Each row's published layout (its best variant, overlap megatron) against the search's best on ``rates``."""
    print(f"\nthe search's best ({rates.profile.name}, overlap {FITTED}) against the published layout's best variant")
    ranked = []
    for row in ROWS:
        t0 = time.time()
        own = next(r for r in out if (r["gpus"], r["seq"], r["cp"]) == (row[0], row[5], row[2])
                   and r["profile"] == rates.profile.name and r["overlap"] == FITTED)
        b = best_layout(row, rates)
        if b is None:
            print(f"{row[0]:>6} GPUs seq {row[5]:>6}: no layout of the search fits")
            continue
        step = b.step.total
        ratio = own["step_s"] / step
        print(f"{row[0]:>6} GPUs seq {row[5]:>6}: best {b.name()} {step:.2f} s, published layout {own['variant']} "
              f"{own['step_s']:.2f} s: best / published {ratio:.3f} ({time.time() - t0:.0f} s)")
        ranked.append({"gpus": row[0], "seq": row[5], "best": b.name(), "best_step_s": step,
                       "published_variant": own["variant"], "best_over_published": ratio, "peak_gib": b.peak / 2**30})
    return ranked


if __name__ == "__main__":
    main()
