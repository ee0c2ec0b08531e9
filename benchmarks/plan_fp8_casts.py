"""Per-step milliseconds of the FP8 casts the plan prices for a model on a device profile: the amax and the
cast-transpose kernels of every FP8 linear (the speed model's own lists, :func:`omnitron.plan.fp8.casts`), over
the layers and micro-batches of a step, at micro-batch 4 and 8 (global batch 4 micro-batches).

    python benchmarks/plan_fp8_casts.py [--config examples/gpt_1p3b_bench.yaml] [--device h200] [--bench REPORT...]
"""
from __future__ import annotations

import argparse

import yaml

from omnitron.commands.plan import settings_of
from omnitron.plan import fp8, work
from omnitron.plan.cluster import device_rates
from omnitron.plan.memory import model_config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/gpt_1p3b_bench.yaml")
    ap.add_argument("--device", default="h200")
    ap.add_argument("--bench", nargs="+", help="omnitron bench reports of the device (files or a bench all folder)")
    args = ap.parse_args()
    with open(args.config) as f:
        given = {k.replace("-", "_"): v for k, v in yaml.safe_load(f).items()}
    for mbs in (4, 8):
        s = settings_of(given | {"fp8_format": "hybrid", "fp8_recipe": "tensorwise", "micro_batch_size": mbs,
                                 "global_batch_size": 4 * mbs})
        cfg, r = model_config(s), device_rates(args.device, None, args.bench)
        r.bind(s)
        fwd, bwd = fp8.casts(s, work.layer_gemms(work.local_shapes(cfg, 1, 1, mbs)))
        per: dict[str, float] = {}
        for op, n in fwd + bwd:
            per[op] = per.get(op, 0.0) + r.elementwise_s(op, "fwd", n)
        steps = cfg.num_layers * s.num_microbatches * 1e3
        print(f"mbs {mbs}: " + ", ".join(f"{k} {v * steps:.1f} ms" for k, v in per.items()) +
              f", casts {sum(per.values()) * steps:.1f} ms a step" + "".join(f"\n  note: {n}" for n in r.notes))


if __name__ == "__main__":
    main()
