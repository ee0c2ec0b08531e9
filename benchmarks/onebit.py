"""1-bit Adam against AdamW at dp4 on the bundled corpus: bytes on the wire, final loss, step time.

Both runs train the same small GPT (``--model gpt2_tiny`` with the settings of
``examples/moby_dick_tp2_pp2.yaml`` at tp1 x pp1 x dp4: 4 CPU processes, one thread each) for ``--iters``
iterations, same data, same seed; 1-bit Adam freezes after ``--freeze`` steps (default: its 15%) and
compresses with one scale per ``--block`` elements (default: the optimizer's ``SCALE_BLOCK``). The settings
the runs trained with (model, tokenizer, batch, schedule) are recorded in each JSON and in the report, as
the example config changes over time.

Bytes: every collective each rank issues over the data-parallel group is counted, per training step, as the
bytes of the tensors it hands the collective (an all-reduce: its buffer; an all-to-all: its input; an
all-gather: its output). The ring-equivalent count is what a ring algorithm sends per rank:
``2 (dp-1)/dp`` x an all-reduce's buffer, ``(dp-1)/dp`` x an all-to-all's input or an all-gather's output.
Step time: wall time of each ``train_step`` (rank 0), median over the steps of each stage.

    python benchmarks/onebit.py [--iters 300 --freeze 45 --block 256 --out benchmarks/results/onebit/NAME]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RING = {"all_reduce": lambda b, dp: 2 * (dp - 1) / dp * b, "all_to_all": lambda b, dp: (dp - 1) / dp * b,
        "all_gather": lambda b, dp: (dp - 1) / dp * b}


def _args(optimizer: str, iters: int, freeze: int, root: str) -> list[str]:
    args = ["--config", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                                     "moby_dick_tp2_pp2.yaml"),
            "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--train-iters", str(iters),
            "--eval-interval", str(iters), "--save-interval", str(10 * iters), "--save", os.path.join(root, optimizer),
            "--log-interval", "50", "--no-tensorboard", "--optimizer", optimizer]
    return args + (["--onebit-freeze-step", str(freeze)] if optimizer == "onebit_adam" else [])


SETTINGS = ("model", "tokenizer_model", "seq_length", "micro_batch_size", "global_batch_size", "lr", "min_lr",
            "lr_warmup_iters", "lr_decay_style", "weight_decay", "clip_grad", "seed", "tensor_model_parallel_size",
            "pipeline_model_parallel_size")
"""The flags each result records (``Settings.flat``), as the runs read them from the example config."""


def worker(optimizer: str, iters: int, freeze: int, root: str, block: int | None = None) -> dict:
    import torch.distributed as dist

    import omnitron.core.optim.onebit as onebit

    from omnitron.backends import get_backend
    from omnitron.core.training import loop
    from omnitron.core.training.arguments import parse_settings

    be = get_backend()
    settings = parse_settings(_args(optimizer, iters, freeze, root), dist.get_world_size())
    if block is not None:  # the benchmark's knob: the optimizer reads SCALE_BLOCK when it builds its buffers
        onebit.SCALE_BLOCK = block
    steps: list[dict] = []  # per train_step: {op: bytes handed} over the dp group, and its wall time
    coll, dp_group = be.collectives, {}

    def counting(op: str, fn, arg: int):
        def call(*a, **kw):
            group = kw.get("group")
            if steps and group is not None and group is dp_group.get("handle"):
                t = a[arg] if len(a) > arg else kw["output" if arg == 0 else "input"]
                steps[-1][op] = steps[-1].get(op, 0) + t.numel() * t.element_size()
            return fn(*a, **kw)
        return call

    coll.all_reduce = counting("all_reduce", coll.all_reduce, 0)
    coll.all_to_all = counting("all_to_all", coll.all_to_all, 1)  # (output, input): the input
    coll.all_gather = counting("all_gather", coll.all_gather, 0)  # (output, input): the output
    inner = loop.train_step

    def timed_step(c, *a, **kw):
        dp_group["handle"] = c.groups.dp_cp.handle
        steps.append({})
        t0 = time.perf_counter()
        out = inner(c, *a, **kw)
        steps[-1]["seconds"] = time.perf_counter() - t0
        return out

    loop.train_step = timed_step
    res = loop.train(settings, be)
    return {"losses": res["losses"], "validation": res.get("validation"), "steps": steps, "dp": settings.dp,
            "settings": {k: settings.flat.get(k) for k in SETTINGS}, "block": onebit.SCALE_BLOCK}


def _stage(steps: list[dict], lo: int, hi: int, dp: int) -> dict:
    """Means of bytes and the median step time over steps ``lo..hi-1`` (0-based)."""
    sel = steps[lo:hi]
    handed = statistics.mean(sum(v for k, v in s.items() if k != "seconds") for s in sel)
    ring = statistics.mean(sum(RING[k](v, dp) for k, v in s.items() if k != "seconds") for s in sel)
    return {"steps": f"{lo + 1}..{hi}", "bytes_handed": handed, "bytes_ring": ring,
            "ops": {k: statistics.mean(s.get(k, 0) for s in sel) for k in RING},
            "median_step_s": statistics.median(s["seconds"] for s in sel)}


def run(opt: str, iters: int, freeze: int, block: int | None = None) -> dict:
    """One training at dp4 with ``opt``; its losses, bytes and step times by stage."""
    from omnitron.testing.distributed import run_distributed

    with tempfile.TemporaryDirectory() as root:
        t0 = time.time()
        r = run_distributed(worker, 4, opt, iters, freeze, root, block, timeout_s=7200)[0]
    dp, steps = r["dp"], r["steps"]
    losses = [r["losses"][k] for k in sorted(r["losses"])]
    last = losses[-20:]
    return {"optimizer": opt, "iters": iters, "freeze": freeze, "block": r["block"], "settings": r["settings"],
            "wall_s": time.time() - t0,
            "final_loss_mean_last20": sum(last) / len(last), "final_loss": losses[-1], "validation": r["validation"],
            "losses": losses,
            # step 1 warms up; the last step also runs the final evaluation
            "warmup": _stage(steps, 1, freeze, dp), "after": _stage(steps, freeze + 1, len(steps) - 1, dp)}


def report(entries: dict) -> str:
    lines = []
    for opt, e in entries.items():
        if "settings" in e:
            lines.append(f"{opt} settings: {e['settings']}" + (f", freeze {e['freeze']}, block {e['block']}"
                                                                if opt == "onebit_adam" else ""))
        lines.append(f"{opt}: final loss (mean of last 20) {e['final_loss_mean_last20']:.4f}, "
                     f"validation {e['validation'][-1]['val_loss']:.4f}, wall {e['wall_s']:.0f} s")
        for stage in ("warmup", "after"):
            s = e[stage]
            lines.append(f"  steps {s['steps']}: handed {s['bytes_handed']:.0f} B/step, ring-equivalent "
                         f"{s['bytes_ring']:.0f} B/step, ops {s['ops']}, median step {s['median_step_s']*1e3:.0f} ms")
    if "adam" in entries and "onebit_adam" in entries:
        ad, ob = entries["adam"], entries["onebit_adam"]
        h = ob["after"]["bytes_handed"] / ad["after"]["bytes_handed"]
        r = ob["after"]["bytes_ring"] / ad["after"]["bytes_ring"]
        lines.append(f"after the freeze (steps {ob['after']['steps']}), 1-bit Adam / AdamW: bytes handed {h:.4f} "
                     f"(1/{1/h:.1f}), ring-equivalent {r:.4f} (1/{1/r:.1f}); final loss (mean of last 20) "
                     f"{ob['final_loss_mean_last20'] / ad['final_loss_mean_last20'] - 1:+.2%}, validation "
                     f"{ob['validation'][-1]['val_loss'] / ad['validation'][-1]['val_loss'] - 1:+.2%}; median step "
                     f"time x{ob['after']['median_step_s'] / ad['after']['median_step_s']:.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--freeze", type=int, default=None, help="default: 15%% of --iters")
    ap.add_argument("--block", type=int, default=None, help="elements per compression scale (default: "
                    "omnitron.core.optim.onebit.SCALE_BLOCK)")
    ap.add_argument("--runs", nargs="+", default=["adam", "onebit_adam"], help="optimizers to run (others are "
                    "read from earlier results in --out)")
    ap.add_argument("--out", default="benchmarks/results/onebit")
    a = ap.parse_args()
    freeze = a.freeze or max(1, round(0.15 * a.iters))
    os.makedirs(a.out, exist_ok=True)
    date = time.strftime("%Y-%m-%d")
    entries = {}
    for opt in ("adam", "onebit_adam"):
        path = os.path.join(a.out, f"onebit-cpu-{date}-{opt}.json")
        if opt in a.runs:
            result = run(opt, a.iters, freeze, a.block)
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
        if os.path.exists(path):
            with open(path) as f:
                entries[opt] = json.load(f)
    text = report(entries)
    print(text)
    with open(os.path.join(a.out, f"onebit-cpu-{date}.txt"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
