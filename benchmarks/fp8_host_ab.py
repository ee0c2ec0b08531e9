"""Host time of one FP8 linear call, this tree against another revision, side by side in one process.

On a shared machine two runs minutes apart differ by 2x (other jobs), so the two implementations are timed
in one process, alternating blocks of calls on the same inputs; each gets its fastest and its median block.
The other revision is a checkout (``git worktree add /tmp/base <rev>``, or ``git archive <rev> | tar -x``
with the built ``omnitron/*.so`` copied in); its package is copied under the name ``omnitron_against``
with its imports renamed, so both load side by side.

    python benchmarks/fp8_host_ab.py --against /tmp/base [--shape 64] [--blocks 30] [--calls 40] [--step-layers 96]

``--step-layers N`` also times delayed scaling's end-of-step update (``AmaxReducer.step``) over N layers' roles
(3 each; 96 FP8 linears in the 1.3B model), history length ``--history`` (Megatron's default 1024).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_against(tree: str):
    """The ``omnitron`` package of ``tree`` imported as ``omnitron_against`` (sources copied, imports renamed)."""
    dst = os.path.join(tempfile.mkdtemp(prefix="fp8ab"), "omnitron_against")
    shutil.copytree(os.path.join(tree, "omnitron"), dst, ignore=shutil.ignore_patterns("__pycache__"))
    pattern = re.compile(r"\bomnitron(?=[. ])")
    for root, _, files in os.walk(dst):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                with open(path) as fh:
                    src = fh.read()
                with open(path, "w") as fh:
                    fh.write(pattern.sub("omnitron_against", src))
    sys.path.insert(0, os.path.dirname(dst))
    import omnitron_against  # noqa: F401

    return sys.modules["omnitron_against"]


def call_of(pkg: str, recipe: str, x, w, gy, micro_batches: int = 4):
    """A forward + backward closure of ``pkg``'s FP8Linear under ``recipe`` ('bf16': ``F.linear``; 'delayed-step':
    delayed scaling as training runs it, updated once per step, a step every ``micro_batches`` calls)."""
    if recipe == "bf16":
        return lambda: torch.nn.functional.linear(x, w).backward(gy)
    backends = __import__(f"{pkg}.backends", fromlist=["get_backend"])
    fp8 = __import__(f"{pkg}.core.precision.fp8", fromlist=["FP8Config", "FP8Linear"])
    scaling = __import__(f"{pkg}.core.precision.fp8.scaling", fromlist=["AmaxReducer"])
    reducer = scaling.AmaxReducer((), None, per_step=True) if recipe == "delayed-step" else None
    ex = fp8.FP8Linear(fp8.FP8Config(fp8_recipe=recipe.split("-")[0], fp8_format="hybrid"), backends.get_backend().fp8,
                       reducer=reducer)
    count = [0]

    def call():
        ex(x, w, None).backward(gy)
        count[0] += 1
        if reducer is not None and count[0] % micro_batches == 0:
            reducer.step()

    return call


def step_of(pkg: str, layers: int, history: int):
    """``AmaxReducer.step`` of ``pkg`` over ``layers`` delayed-scaling layers (hybrid: two formats)."""
    backends = __import__(f"{pkg}.backends", fromlist=["get_backend"])
    fp8 = __import__(f"{pkg}.core.precision.fp8", fromlist=["FP8Config", "FP8Linear"])
    scaling = __import__(f"{pkg}.core.precision.fp8.scaling", fromlist=["AmaxReducer"])
    reducer = scaling.AmaxReducer((), None, per_step=True)
    cfg = fp8.FP8Config(fp8_recipe="delayed", fp8_format="hybrid", fp8_amax_history_len=history)
    for _ in range(layers):
        fp8.FP8Linear(cfg, backends.get_backend().fp8, reducer=reducer)
    return reducer.step


def ab(fns: dict, blocks: int, calls: int) -> dict:
    """(fastest, median) ms per call of each closure over ``blocks`` alternating blocks of ``calls`` calls: the
    fastest block is the least disturbed by other jobs, the median says how disturbed the run was."""
    times = {k: [] for k in fns}
    for fn in fns.values():
        block_ms(fn, 5)  # warm-up: first-use paths, probes
    for b in range(blocks):
        for k in (list(fns) if b % 2 == 0 else list(fns)[::-1]):
            times[k].append(block_ms(fns[k], calls))
    return {k: (min(v), statistics.median(v)) for k, v in times.items()}


def block_ms(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e3


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="a checkout of the other revision")
    ap.add_argument("--recipes", default="bf16,tensorwise,delayed,delayed-step,blockwise")
    ap.add_argument("--shape", type=int, default=64, help="tokens = in = out (64: the overhead-only shape)")
    ap.add_argument("--blocks", type=int, default=30)
    ap.add_argument("--calls", type=int, default=40, help="calls per block")
    ap.add_argument("--step-layers", type=int, default=0, help="also time AmaxReducer.step over this many layers")
    ap.add_argument("--history", type=int, default=1024, help="amax history length for --step-layers")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    load_against(args.against)
    g = torch.Generator().manual_seed(0)
    n = args.shape
    x = torch.randn(n, n, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(n, n, generator=g) * 0.02).bfloat16().requires_grad_()
    gy = torch.randn(n, n, generator=g).bfloat16()
    out = {}
    print(f"# host ms per forward + backward call, {n}x{n}x{n} bf16, {args.blocks} alternating blocks of "
          f"{args.calls} calls; 'against' = {args.against}")
    for recipe in args.recipes.split(","):
        fns = {"against": call_of("omnitron_against", recipe, x, w, gy), "this": call_of("omnitron", recipe, x, w, gy)}
        out[recipe] = report(recipe, ab(fns, args.blocks, args.calls))
    if args.step_layers:
        fns = {k: step_of(pkg, args.step_layers, args.history)
               for k, pkg in (("against", "omnitron_against"), ("this", "omnitron"))}
        out["step"] = report(f"delayed AmaxReducer.step, {args.step_layers} layers, history {args.history}",
                             ab(fns, args.blocks, max(1, args.calls // 10)))
    return out


def report(what: str, ms: dict) -> dict:
    (a, am), (t, tm) = ms["against"], ms["this"]
    print(f"{what:12s} fastest block: against {a:.4f} this {t:.4f} ratio {t / a:.3f} | median: against {am:.4f} "
          f"this {tm:.4f} ratio {tm / am:.3f}")
    return ms


if __name__ == "__main__":
    main()
