"""Optimizer-state memory per parameter per rank: replicated optimizer vs the distributed one (ZeRO-1).

For dp = 1, 2, 4 (gloo processes, tp = pp = 1) and two precisions, each rank builds the GPT-2 tiny
model (~7M parameters), wraps it in DistributedDataParallel, builds the optimizer, runs one real
training step on random tokens, and measures the storage of the tensors it holds: parameters,
the gradient buffers (``main_grad``), and the optimizer's fp32 masters + Adam moments
(``optimizer.state_bytes()``: deduplicated storages, masters that are the fp32 parameters
themselves not counted twice). Bytes are divided by the parameter count of one replica.

Beside it, Megatron's distributed-optimizer formula (docs, "distrib_optimizer"), bytes/param:

    bf16 params, fp32 grads:  replicated 2 + 4 + 12 = 18   distributed 6 + 12/dp  (master 4, m 4, v 4)
    fp32 params, fp32 grads:  replicated 4 + 4 + 8  = 16   distributed 8 + 8/dp   (m 4, v 4; no master)

Measured values sit slightly above the formula where buckets are padded to a multiple of dp.

Two more columns count the transient tensors of the step, by tensor accounting (a dispatch mode that
tracks every tensor with a fresh storage created inside the step until it is freed; views and in-place
results do not count): ``gather B``, the peak of those created while the updated parameters are
written back and all-gathered (``_copy_to_model``), and ``step B``, the peak over the whole step
(fp32 gradient copies, clipping, the fused AdamW's temporaries, the gather). Communication libraries'
internal buffers are not tensors and are not counted. Since the parameters live in flat per-bucket
buffers gathered in place, ``gather B`` is 0 at every dp; the previous implementation (commit 1d84ccc:
a zeroed local shard plus a full temporary per bucket, all in flight together) measured 3.0 / 2.5 B
(bf16, dp 2 / 4) and 6.0 / 5.0 B (fp32), i.e. one full copy of the parameters plus 1/dp.

    python benchmarks/zero_memory.py [--dp 1 2 4] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FORMULA = {  # name: (bytes per param of params + grads, optimizer state bytes per param before sharding)
    "bf16": (2 + 4, 12),
    "fp32": (4 + 4, 8),
}


def _storage_bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


class TransientBytes(TorchDispatchMode):
    """Peak bytes of live tensors created inside the mode (fresh storages only), overall and per ``phase``."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, list] = {}  # storage ptr -> [bytes, phase, weakrefs to the tensors on it]
        self.phase, self.peak, self.peaks = "step", 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr in self.live:
                self.live[ptr][2].append(weakref.ref(t))
            elif ptr not in seen and t.untyped_storage().nbytes():
                self.live[ptr] = [t.untyped_storage().nbytes(), self.phase, [weakref.ref(t)]]
        self._update()
        return out

    def _update(self) -> None:
        for ptr in [p for p, (_, _, refs) in self.live.items() if all(r() is None for r in refs)]:
            del self.live[ptr]
        for entry in self.live.values():  # NOTE: a storage resized in place (FSDP frees its all-gathered
            # parameters by resizing to 0) counts at its current size
            alive = [t for r in entry[2] if (t := r()) is not None]
            entry[0] = alive[0].untyped_storage().nbytes() if alive else 0
        self.peak = max(self.peak, sum(n for n, _, _ in self.live.values()))
        in_phase = sum(n for n, ph, _ in self.live.values() if ph == self.phase)
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), in_phase)


def _accounted_step(opt, lr: float) -> tuple[int, int]:
    """(peak transient bytes of the gather, of the whole step) of one ``opt.step(lr)``."""
    mode, copy = TransientBytes(), opt._copy_to_model

    def gather() -> None:
        mode.phase = "gather"
        copy()
        mode._update()
        mode.phase = "step"

    opt._copy_to_model = gather
    try:
        with mode:
            opt.step(lr)
    finally:
        del opt._copy_to_model
    return mode.peaks.get("gather", 0), mode.peak


def _measure(dtype_name: str, distributed: bool, groups, be) -> dict:
    from omnitron.core.config.training import OptimizerConfig
    from omnitron.core.models.gpt.presets import gpt2_tiny
    from omnitron.core.optim import DistributedOptimizer, MixedPrecisionOptimizer
    from omnitron.core.parallel.data import DataParallelConfig, DistributedDataParallel, finalize_model_grads
    from omnitron.core.training.components import build_model_chunks

    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    cfg = gpt2_tiny(params_dtype=dtype, seq_length=32, max_position_embeddings=32)
    (model,) = build_model_chunks(cfg, groups, 1234, be)
    ddp = DistributedDataParallel(model, groups, DataParallelConfig(accumulate_allreduce_grads_in_fp32=True,
                                                                    use_distributed_optimizer=distributed))
    named = list(model.named_parameters())
    opt_cfg = OptimizerConfig(lr=1e-3)
    if distributed:
        opt = DistributedOptimizer(named, opt_cfg, groups, backend=be, chunks=[ddp])
    else:
        opt = MixedPrecisionOptimizer(named, opt_cfg, groups, backend=be)
    g = torch.Generator().manual_seed(groups.rank)
    tokens = torch.randint(0, cfg.vocab_size, (32, 2), generator=g).t().contiguous()  # [b, s]
    pos = torch.arange(32).expand(2, 32)
    ddp.zero_grad_buffer()
    ddp(tokens=tokens, position_ids=pos, labels=tokens).float().mean().backward()
    finalize_model_grads([ddp], groups)
    gather, step = _accounted_step(opt, 1e-3)
    n = sum(p.numel() for _, p in named)
    return {"gather": gather / n, "step": step / n, "params": _storage_bytes([p for _, p in named]) / n,
            "grads": _storage_bytes([b.data for b in ddp.buffers]) / n,
            "optimizer": opt.state_bytes() / n, "numel": n}


def zero_worker() -> dict:
    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups

    torch.set_num_threads(1)
    be = get_backend()
    groups = ParallelGroups.build(ParallelConfig(), be.collectives)
    return {(d, dist): _measure(d, dist, groups, be) for d in FORMULA for dist in (False, True)}


def main() -> None:
    from omnitron.testing.distributed import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()
    rows = []
    print(f"{'dp':>3} {'params':>6} {'optimizer':>11} | {'param B':>7} {'grad B':>7} {'optim B':>8} {'total':>7} "
          f"| {'formula':>7} | {'gather B':>8} {'step B':>7}   (bytes per parameter per rank, max over ranks)")
    for dp in args.dp:
        results = run_distributed(zero_worker, dp)
        for (d, dist), _ in results[0].items():
            worst = max((r[(d, dist)] for r in results), key=lambda m: m["optimizer"])
            fixed, state = FORMULA[d]
            formula = fixed + (state / dp if dist else state)
            total = worst["params"] + worst["grads"] + worst["optimizer"]
            name = "distributed" if dist else "replicated"
            rows.append({"dp": dp, "dtype": d, "optimizer": name, **worst, "total": total, "formula": formula})
            print(f"{dp:>3} {d:>6} {name:>11} | {worst['params']:7.3f} {worst['grads']:7.3f} {worst['optimizer']:8.4f} "
                  f"{total:7.3f} | {formula:7.3f} | {worst['gather']:8.4f} {worst['step']:7.4f}")
    print(f"parameters per replica: {rows[0]['numel']:,}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
