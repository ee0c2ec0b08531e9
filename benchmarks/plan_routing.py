"""What routing imbalance, capacity drops and NVLink SHARP change in ``omnitron plan``'s predictions at cluster scale
(nothing measured on a cluster: the plan's own figures, and the routing histogram it is given measured here).

1. A routing histogram measured on this machine: one forward of a tiny Mixtral (benchmarks/plan_memory.py's
   ``MIXTRAL`` shapes: 4 layers, 8 experts, top-2) at initialisation, 4 x 1024 mock tokens, each layer's router
   picks per expert counted by the engine's ``--moe-expert-load-out`` counter (``--moe-expert-load``'s format),
   written to ``--histogram``.
2. Mixtral 8x7B on the H100 SXM profile (8 a node, seq 4096, global batch 256, SP, distributed optimizer, dp
   reduction overlapped) at three ep layouts, dropless and at capacity factor 1.0: balanced routing against
   that histogram (step, expert compute, ep all-to-alls, the busiest ep rank's rows and the drops), and each
   stage's memory on its busiest ep rank against balanced routing (backward's transient probes off).
3. NVLS: a tp8 all-reduce of 1 GiB, and Llama-3 70B layouts with and without sequence parallelism, on the H100
   profile against the same profile with ``nvls_efficiency = 0`` (rings only, as NCCL_NVLS_ENABLE=0).

    PYTHONPATH=. python benchmarks/plan_routing.py [--histogram FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile


def measure_histogram(path: str) -> list[list[int]]:
    """The routers' picks of one training-mode forward, counted by the engine's ``--moe-expert-load-out`` counter
    (:mod:`omnitron.core.transformer.moe.expert_load`; no dropout in the tiny Mixtral: the picks are those of an
    evaluation forward)."""
    import torch

    from benchmarks.plan_memory import MIXTRAL
    from omnitron.core.models.gpt import GPTModel
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.transformer.moe import expert_load
    from omnitron.plan.memory import model_config

    torch.manual_seed(0)
    b, sl = 4, 1024
    s = parse_settings(MIXTRAL + ["--seq-length", str(sl), "--max-position-embeddings", str(sl)], 1)
    cfg = model_config(s)
    groups = ParallelGroups.single()
    model = GPTModel(cfg, groups).train()
    expert_load.start([model], cfg)
    tokens = torch.randint(0, cfg.vocab_size, (b, sl))
    model(tokens=tokens, position_ids=torch.arange(sl).expand(b, sl), labels=tokens)
    picks = expert_load.histogram([model], cfg, groups, sequence_parallel=False).tolist()
    with open(path, "w") as f:
        json.dump({"tokens_per_expert": picks, "source": f"tiny Mixtral at init, one forward, {b} x {sl} tokens, "
                   "seed 0 (benchmarks/plan_routing.py)"}, f, indent=1)
    return picks


def moe_rows(path: str) -> None:
    from omnitron.plan.cluster import device_rates
    from omnitron.plan.routing import read_expert_load
    from omnitron.plan.settings import settings_of
    from omnitron.plan.speed import predict

    load = read_expert_load(path)
    base = dict(model="mixtral_8x7b", tokenizer_type="NullTokenizer", vocab_size=32000, bf16=True, seq_length=4096,
                global_batch_size=256, micro_batch_size=1, sequence_parallel=True, use_distributed_optimizer=True)
    print("layout            capacity | balanced: step  compute  ep (s) | histogram: step  compute  ep (s)  ratio | "
          "busiest ep rank / mean, dropped")
    for lay in ("tp4,pp4,dp4,ep4", "tp2,pp4,dp8,ep8", "tp8,pp4,dp2,ep2"):
        for cap in (None, 1.0):
            s = settings_of(dict(base, layout=lay, **({"moe_expert_capacity_factor": cap} if cap else {})))
            steps = []
            for hist in (None, load):
                rates = device_rates("h100-sxm", 8)
                rates.expert_load = hist
                steps.append(predict(s, rates, "dp"))
            a, b = steps
            said = next(x for x in b.assumptions if "routing from" in x).split("experts take ")[1].split(" (means")[0]
            print(f"{lay:17s} {str(cap):8s} | {a.total:8.3f} {a.compute:8.3f} {a.ep:6.3f} | {b.total:8.3f} "
                  f"{b.compute:8.3f} {b.ep:6.3f} {b.total / a.total:6.3f} | {said}")


def memory_rows(path: str) -> None:
    """Each stage's busiest ep rank against balanced routing (the activations move; transient probes off)."""
    from omnitron.plan.memory import estimate
    from omnitron.plan.routing import read_expert_load
    from omnitron.plan.settings import settings_of

    load = read_expert_load(path)
    base = dict(model="mixtral_8x7b", tokenizer_type="NullTokenizer", vocab_size=32000, bf16=True, seq_length=4096,
                global_batch_size=256, micro_batch_size=1, sequence_parallel=True, use_distributed_optimizer=True)
    print("layout            capacity | GiB per stage: balanced -> busiest ep rank (its index)")
    for lay in ("tp4,pp4,dp4,ep4", "tp2,pp4,dp8,ep8"):
        for cap in (None, 1.0):
            s = settings_of(dict(base, layout=lay, **({"moe_expert_capacity_factor": cap} if cap else {})))
            stages = estimate(s, transients=False, load=load)
            print(f"{lay:17s} {str(cap):8s} | " + "  ".join(f"{m.balanced / 2**30:.2f} -> {m.total / 2**30:.2f} "
                                                            f"({m.ep_rank})" for m in stages))


def nvls_rows() -> None:
    from omnitron.plan.cluster import device_rates, step_flops
    from omnitron.plan.machine import span
    from omnitron.plan.memory import model_config
    from omnitron.plan.settings import settings_of
    from omnitron.plan.speed import predict

    with tempfile.TemporaryDirectory() as tmp:
        rings = os.path.join(tmp, "h100-rings.toml")
        with open(rings, "w") as f:
            f.write('based_on = "h100-sxm"\nname = "h100-rings"\ntitle = "H100 SXM, rings only"\n[links]\n'
                    "# NVLS off\nnvls_efficiency = 0.0\n")
        S = 2**30
        for prof in ("h100-sxm", rings):
            t, algo = device_rates(prof, 8).machine.collective("all_reduce", S, span(8, 1, 8))
            print(f"{os.path.basename(prof):17s} tp8 all-reduce 1 GiB: {t * 1e3:.2f} ms ({algo}), busbw "
                  f"{S * 2 * 7 / 8 / t / 1e9:.0f} GB/s")
        base = dict(model="llama3_70b", tokenizer_type="NullTokenizer", vocab_size=128256, bf16=True, seq_length=8192,
                    global_batch_size=1024, micro_batch_size=1, recompute_granularity="full",
                    recompute_method="uniform", use_distributed_optimizer=True)
        for lay, sp in (("tp8,pp8,dp16", False), ("tp8,pp8,dp16", True), ("tp4,pp8,dp32", False)):
            s = settings_of(dict(base, layout=lay, **({"sequence_parallel": True} if sp else {})))
            for prof in ("h100-sxm", rings):
                st = predict(s, device_rates(prof, 8), "dp")
                tf = step_flops(s, model_config(s)) / st.total / s.world_size / 1e12
                print(f"llama3_70b {lay} {'SP' if sp else 'no SP':5s} {os.path.basename(prof):17s} step "
                      f"{st.total:7.3f} s, tp {st.tp:6.3f} s, {tf:5.0f} TFLOP/s a GPU")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--histogram", default="benchmarks/results/plan_routing/tiny-mixtral-init.json")
    args = ap.parse_args()
    print("histogram:", measure_histogram(args.histogram))
    moe_rows(args.histogram)
    memory_rows(args.histogram)
    nvls_rows()


if __name__ == "__main__":
    main()
