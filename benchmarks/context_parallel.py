"""Context parallelism on CPU: a long sequence at cp=1 (1 process x 2 threads) vs cp=2 (2 processes x 1 thread).

One spawned world of 2 gloo ranks. Every round runs each variant once, interleaved (cp=2 on both
ranks; then cp=1 on rank 0 with 2 threads while rank 1 waits in a barrier), so machine noise hits
all alike; the median over rounds is reported. Per-rank time is the slowest rank's. Variants, all
forward + backward on ``[b=1, s=--seq]`` with ``--heads`` heads of 64, fp32:

- ``core attention``: q, k, v -> out. ``sdpa``: the engine's attention kernel at cp=1 (PyTorch SDPA,
  a flash-style kernel on CPU that never holds the s x s scores); ``block``: the ring's own per-block
  kernel (plain maths: the scores are materialised, recomputed in backward) on the whole sequence,
  i.e. the reference maths of the ring's blocks; ``ring``: ring attention at cp=2 with the backend's
  block kernel (on CPU ATen's flash kernel with log-sum-exp, ``cpu_flash``; the reference elsewhere);
  ``a2a`` (``--cp-comm-type a2a``: all-to-all of heads and sequence, then the engine's attention kernel on
  the whole sequence for half the heads) and ``allgather`` (K/V all-gathered, masked SDPA for the local queries).
- ``attention layer``: the engine's SelfAttention (QKV and output projections + core attention);
  ``block`` swaps the module's attention kernel for the ring's block kernel.
- ``GPT step``: a small GPT-2 style model (``--layers`` layers, hidden 64 x heads, vocab 1024),
  forward + backward of the mean token loss (no optimizer, no gradient all-reduce over cp).

Columns: ``ms`` median wall ms per fwd+bwd (slowest rank); ``vs cp=1`` that time over the first
row of the same group (cp=1, sdpa); ``CPU ms`` the process CPU time, summed over the ranks that ran
it (2 threads of one process at cp=1, counting any spinning; both processes at cp=2), and its ratio;
``peak MiB/rank``: the peak bytes of tensors created during
one fwd+bwd and alive together (tensor accounting, as ``zero_memory.py``; inputs and parameters
excluded, library scratch not counted), i.e. activations, saved tensors, scores and gradients.

Ring overlap (cp=2, core attention): ``overlapped`` is the ring as written (the next K/V block's
send/recv posted before the current block is computed, waited for after it); ``sequential`` the
same ring with every exchange waited for as soon as it is posted; ``comm only`` the same ring with
a block kernel that computes nothing (transfers and bookkeeping). A collectives wrapper records the
time each rank spends waiting for its transfers: in ``sequential`` that is the whole transfer as
the rank sees it, in ``overlapped`` only the part compute did not cover. Hidden fraction =
``1 - overlapped wait / sequential wait`` (also ``(sequential - overlapped) / comm only`` from the
totals, which is the difference of two noisy numbers). NOTE: on CPU gloo moves the bytes with the
same cores that compute, so hiding is bounded by spare cycles, not by the schedule.

``--cp 4``: a world of 4 ranks x 1 thread (oversubscribing a 2-core machine 2x: the cp=4 times include
the scheduler's share), core attention and GPT step for the ring, ``a2a`` and ``a2a+p2p`` (2x2: all-to-all
in pairs of consecutive ranks, the ring over the two pairs) against cp=1; no overlap study.

``--kernels``: core attention at cp=2 on each path before and after the fused block kernel (the ring on the float32
reference blocks vs the backend's, a2a / allgather on SDPA / masked SDPA vs the backend's block kernel), against cp=1.

    python benchmarks/context_parallel.py [--seq 4096] [--heads 4] [--layers 2] [--rounds 5] [--cp 2|4] [--kernels]
        [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from zero_memory import TransientBytes  # noqa: E402

HEAD_DIM, VOCAB = 64, 1024
_WARM = torch.ones(256, 256)


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """``columns``: (header, row key, format spec); a missing key prints ``-``."""
    cells = [[h for h, _, _ in columns]] + [[("-" if r.get(k) is None else format(r[k], f)) for _, k, f in columns]
                                            for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    for c in cells:
        print("  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(c, widths))))


def dump_json(path: str | None, obj) -> None:
    """Write ``obj`` to ``path`` (indented JSON) when a path was given (``--json``)."""
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1)


def timed(fn) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of ``fn()``. CPU time is reported beside wall time
    because the machine is shared: contention inflates wall time far more than CPU time."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def on_ranks(distributed: bool, rank: int, barrier, fn):
    """Between barriers: ``fn()`` on every rank (``distributed``, 1 thread each) or on rank 0 alone with
    2 threads (the single-process variant owns both cores; the other rank waits in the barrier)."""
    barrier()
    out = None
    if distributed or rank == 0:
        torch.set_num_threads(1 if distributed else 2)
        torch.mm(_WARM, _WARM)  # start the resized thread pool outside the measurement
        out = fn()
        torch.set_num_threads(1)
    barrier()
    return out


def interleaved(variants: dict, rank: int, rounds: int, barrier, sync=lambda: None, on_warm=lambda: None) -> dict:
    """``{name: [(wall s, CPU s) per round]}`` for ``variants`` (``name -> (distributed, fn)``, see
    :func:`on_ranks`): every round runs each variant once, in order; a first round warms up (then
    ``on_warm()``). ``sync`` waits for the device before each clock read. Empty on ranks that did not run it."""
    def run(fn):
        sync()
        return timed(lambda: (fn(), sync()))

    times: dict[str, list] = {n: [] for n in variants}
    for i in range(rounds + 1):
        for name, (distributed, fn) in variants.items():
            t = on_ranks(distributed, rank, barrier, lambda: run(fn))
            if i and t is not None:
                times[name].append(t)
        if i == 0:
            on_warm()
    return times


def peak_bytes(fn) -> int:
    """Peak bytes of tensors created by ``fn()`` and alive together (see ``zero_memory.TransientBytes``)."""
    mode = TransientBytes()
    with mode:
        fn()
    return mode.peak


class _Proxy:
    """``obj`` with some attributes replaced (``overrides``); everything else delegates."""

    def __init__(self, obj, **overrides) -> None:
        self._obj, self._overrides = obj, overrides

    def __getattr__(self, name):
        return self._overrides[name] if name in self._overrides else getattr(self._obj, name)


class _TimedWait:
    def __init__(self, handle, owner) -> None:
        self.handle, self.owner = handle, owner

    def wait(self) -> None:
        t = time.perf_counter()
        self.handle.wait()
        self.owner.waited += time.perf_counter() - t


class _RingCollectives(_Proxy):
    """Collectives whose ``batch_p2p`` records the time spent waiting for its transfers in ``waited``;
    ``sequential=True`` waits before returning (no overlap with the caller's compute)."""

    def __init__(self, inner, sequential: bool) -> None:
        super().__init__(inner)
        self.sequential, self.waited = sequential, 0.0

    def batch_p2p(self, ops, group=None) -> list:
        handles = [_TimedWait(h, self) for h in self._obj.batch_p2p(ops, group=group)]
        if not self.sequential:
            return handles
        for h in handles:
            h.wait()
        return []


def _null_forward(q, k, v, *, causal, scale, drop=None):
    return q.new_zeros(q.shape), q.new_zeros(q.shape[:3])


def _null_backward(dout, q, k, v, out, lse, *, causal, scale, drop=None):
    return q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape)


class _OneBlock(torch.autograd.Function):
    """forward: the ring's block kernel on the whole sequence; backward: its block backward (cp=1)."""

    @staticmethod
    def forward(ctx, q, k, v):
        from omnitron.core.parallel.context import block_forward

        ctx.scale = q.shape[-1] ** -0.5
        out, lse = block_forward(q, k, v, causal=True, scale=ctx.scale)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        from omnitron.core.parallel.context import block_backward

        return block_backward(dout, *ctx.saved_tensors, causal=True, scale=ctx.scale)


def _block_attention(q, k, v, causal=True, dropout_p=0.0, scale=None):
    """The engine's attention-kernel signature over :class:`_OneBlock` (causal, no dropout)."""
    return _OneBlock.apply(q, k, v)


def _gpt_config(seq: int, heads: int, layers: int):
    from omnitron.core.models.gpt import gpt2_tiny

    return gpt2_tiny(num_layers=layers, hidden_size=HEAD_DIM * heads, num_attention_heads=heads,
                     ffn_hidden_size=4 * HEAD_DIM * heads, seq_length=seq, max_position_embeddings=seq,
                     vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0)


def _backward_of(fn, *inputs):
    """A closure running ``fn(*leaves)`` forward and ``.sum().backward()`` on fresh leaf copies of ``inputs``."""
    def run():
        leaves = [t.detach().requires_grad_(True) for t in inputs]
        fn(*leaves).float().sum().backward()
    return run


def _variants(groups, single, seq: int, heads: int, layers: int, waits: dict) -> dict:
    """name -> (runs on the cp=2 world?, closure) for this rank; ``waits`` gets the ring variants' collectives."""
    from omnitron.backends import get_backend
    from omnitron.core.models.gpt import GPTModel
    from omnitron.core.parallel.context import BlockKernel, backend_kernel, ring_attention, split_sequence
    from omnitron.core.transformer.attention import SelfAttention

    be, cp, rank = get_backend(), groups.cp, groups.cp.rank
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, HEAD_DIM, generator=g) for _ in range(3))
    mine = [split_sequence(t, 2, cp.size, rank) for t in (q, k, v)]
    cfg = _gpt_config(seq, heads, layers)
    gpt1, gpt1b, gpt2 = GPTModel(cfg, single, seed=0), GPTModel(cfg, single, seed=0), GPTModel(cfg, groups, seed=0)
    block_backend = _Proxy(be, kernels=_Proxy(be.kernels, attention=_block_attention))
    attn1, attn1b, attn2 = ([m for m in model.modules() if isinstance(m, SelfAttention)]
                            for model in (gpt1, gpt1b, gpt2))
    for m in attn1b:  # cp=1 with the ring's block kernel: the same attention maths as cp=2
        m.backend = block_backend
    x = torch.randn(seq, 1, cfg.hidden_size, generator=g)
    tokens = torch.randint(0, VOCAB, (1, seq + 1), generator=g)
    tok, lab = tokens[:, :-1], tokens[:, 1:]
    tok2, lab2 = (split_sequence(t, 1, cp.size, rank) for t in (tok, lab))
    waits.update(overlapped=_RingCollectives(be.collectives, False), sequential=_RingCollectives(be.collectives, True),
                 comm_only=_RingCollectives(be.collectives, False))
    null = BlockKernel(_null_forward, _null_backward)

    def ring(coll, kernel=None):  # the engine's path: the backend's block kernel (flash on CPU)
        kw = {"kernel": kernel or backend_kernel(be)}
        return lambda a, b, c: ring_attention(a, b, c, group=cp, collectives=coll, causal=True, **kw)

    def gpt_step(model, t, lab_):
        return lambda: model(tokens=t, labels=lab_).mean().backward()

    from omnitron.core.parallel.context import apply_context_parallel
    from omnitron.core.parallel.context.ulysses import a2a_attention, allgather_attention

    gpt_a2a = apply_context_parallel(GPTModel(cfg, groups, seed=0), cp, "a2a")
    gpt_ag = apply_context_parallel(GPTModel(cfg, groups, seed=0), cp, "allgather")
    sdpa = lambda a, b, c: be.kernels.attention(a, b, c, causal=True)  # noqa: E731
    masked = lambda a, b, c, keep: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        a, b, c, attn_mask=keep)

    x2 = split_sequence(x, 0, cp.size, rank)
    return {
        "core attention, cp=1 sdpa": (False, _backward_of(lambda a, b, c: be.kernels.attention(a, b, c, causal=True),
                                                          q, k, v)),
        "core attention, cp=1 block": (False, _backward_of(_OneBlock.apply, q, k, v)),
        "core attention, cp=2 ring": (True, _backward_of(ring(waits["overlapped"]), *mine)),
        "core attention, cp=2 a2a": (True, _backward_of(lambda a, b, c: a2a_attention(a, b, c, group=cp, attend=sdpa),
                                                        *mine)),
        "core attention, cp=2 allgather": (True, _backward_of(
            lambda a, b, c: allgather_attention(a, b, c, group=cp, attend_masked=masked), *mine)),
        "attention layer, cp=1 sdpa": (False, _backward_of(lambda t: attn1[0](t, None)[0], x)),
        "attention layer, cp=1 block": (False, _backward_of(lambda t: attn1b[0](t, None)[0], x)),
        "attention layer, cp=2 ring": (True, _backward_of(lambda t: attn2[0](t, None)[0], x2)),
        "GPT step, cp=1 sdpa": (False, gpt_step(gpt1, tok, lab)),
        "GPT step, cp=1 block": (False, gpt_step(gpt1b, tok, lab)),
        "GPT step, cp=2 ring": (True, gpt_step(gpt2, tok2, lab2)),
        "GPT step, cp=2 a2a": (True, gpt_step(gpt_a2a, tok2, lab2)),
        "GPT step, cp=2 allgather": (True, gpt_step(gpt_ag, tok2, lab2)),
        "ring sequential": (True, _backward_of(ring(waits["sequential"]), *mine)),
        "ring comm only": (True, _backward_of(ring(waits["comm_only"], null), *mine)),
    }


def cp_worker(seq: int, heads: int, layers: int, rounds: int) -> dict:
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups

    groups = ParallelGroups.build(ParallelConfig(context_parallel_size=2), get_backend().collectives)
    waits: dict = {}
    variants = _variants(groups, ParallelGroups.single(), seq, heads, layers, waits)
    rank = groups.cp.rank
    times = interleaved(variants, rank, rounds, dist.barrier, on_warm=lambda: [setattr(c, "waited", 0.0)
                                                                              for c in waits.values()])
    waited = {n: c.waited / rounds for n, c in waits.items()}  # per fwd+bwd
    peaks: dict[str, int] = {}
    for name, (distributed, fn) in variants.items():
        if not name.startswith("ring "):
            on_ranks(distributed, rank, dist.barrier, lambda: peaks.__setitem__(name, peak_bytes(fn)))
    return {"times": times, "peaks": peaks, "waited": waited}


def _variants_cp4(groups, single, seq: int, heads: int, layers: int) -> dict:
    """``--cp 4``: name -> (runs on the cp=4 world?, closure): cp=1 against the ring, a2a and a2a+p2p (2x2) at cp=4."""
    from omnitron.backends import get_backend
    from omnitron.core.models.gpt import GPTModel
    from omnitron.core.parallel.context import apply_context_parallel, backend_kernel, ring_attention, split_sequence
    from omnitron.core.parallel.context.hierarchical import a2a_p2p_attention
    from omnitron.core.parallel.context.ulysses import a2a_attention

    be, cp, rank = get_backend(), groups.cp, groups.cp.rank
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, HEAD_DIM, generator=g) for _ in range(3))
    mine = [split_sequence(t, 2, cp.size, rank) for t in (q, k, v)]
    cfg = _gpt_config(seq, heads, layers)
    tokens = torch.randint(0, VOCAB, (1, seq + 1), generator=g)
    tok, lab = tokens[:, :-1], tokens[:, 1:]
    tok4, lab4 = (split_sequence(t, 1, cp.size, rank) for t in (tok, lab))
    sdpa = lambda a, b, c: be.kernels.attention(a, b, c, causal=True)  # noqa: E731
    kern = backend_kernel(be)
    gpt1 = GPTModel(cfg, single, seed=0)
    gpt_ring = apply_context_parallel(GPTModel(cfg, groups, seed=0), cp, "p2p")
    gpt_a2a = apply_context_parallel(GPTModel(cfg, groups, seed=0), cp, "a2a")
    gpt_hier = GPTModel(cfg, groups, seed=0)  # the groups' config: a2a+p2p 2x2

    def gpt_step(model, t, lab_):
        return lambda: model(tokens=t, labels=lab_).mean().backward()

    return {
        "core attention, cp=1 sdpa": (False, _backward_of(sdpa, q, k, v)),
        "core attention, cp=4 ring": (True, _backward_of(
            lambda a, b, c: ring_attention(a, b, c, group=cp, collectives=be.collectives, kernel=kern), *mine)),
        "core attention, cp=4 a2a": (True, _backward_of(lambda a, b, c: a2a_attention(a, b, c, group=cp, attend=sdpa),
                                                        *mine)),
        "core attention, cp=4 a2a+p2p 2x2": (True, _backward_of(
            lambda a, b, c: a2a_p2p_attention(a, b, c, a2a_group=groups.cp_a2a, p2p_group=groups.cp_p2p,
                                              collectives=be.collectives, attend=sdpa, kernel=kern), *mine)),
        "GPT step, cp=1 sdpa": (False, gpt_step(gpt1, tok, lab)),
        "GPT step, cp=4 ring": (True, gpt_step(gpt_ring, tok4, lab4)),
        "GPT step, cp=4 a2a": (True, gpt_step(gpt_a2a, tok4, lab4)),
        "GPT step, cp=4 a2a+p2p 2x2": (True, gpt_step(gpt_hier, tok4, lab4)),
    }


def cp4_worker(seq: int, heads: int, layers: int, rounds: int) -> dict:
    """``--cp 4``: a world of 4 gloo ranks x 1 thread (on 2 cores: oversubscribed 2x); cp=1 is rank 0 with 2
    threads while the others wait in a barrier."""
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups

    pc = ParallelConfig(context_parallel_size=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2])
    groups = ParallelGroups.build(pc, get_backend().collectives)
    variants = _variants_cp4(groups, ParallelGroups.single(), seq, heads, layers)
    rank = groups.cp.rank
    times = interleaved(variants, rank, rounds, dist.barrier)
    peaks: dict[str, int] = {}
    for name, (distributed, fn) in variants.items():
        on_ranks(distributed, rank, dist.barrier, lambda: peaks.__setitem__(name, peak_bytes(fn)))
    return {"times": times, "peaks": peaks, "waited": {}}


def _variants_kernels(groups, seq: int, heads: int) -> dict:
    """``--kernels``: core attention (fwd+bwd) at cp=2 on each path before (the float32 reference block kernel for
    the ring; SDPA / masked SDPA for a2a / allgather) and after (the backend's fused block kernel everywhere)."""
    from omnitron.backends import get_backend
    from omnitron.core.parallel.context import REFERENCE, backend_kernel, ring_attention, split_sequence
    from omnitron.core.parallel.context.blocks import BlockedAttention
    from omnitron.core.parallel.context.ulysses import a2a_attention, allgather_attention

    be, cp, rank = get_backend(), groups.cp, groups.cp.rank
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, HEAD_DIM, generator=g) for _ in range(3))
    mine = [split_sequence(t, 2, cp.size, rank) for t in (q, k, v)]
    fused, scale = backend_kernel(be), HEAD_DIM ** -0.5
    sdpa = lambda a, b, c: be.kernels.attention(a, b, c, causal=True)  # noqa: E731
    masked = lambda a, b, c, keep: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        a, b, c, attn_mask=keep)
    block = lambda a, b, c: BlockedAttention.apply(a, b, c, [(slice(None), slice(None), True)], fused,
                                                   scale)  # noqa: E731

    def ring(kernel):
        return lambda a, b, c: ring_attention(a, b, c, group=cp, collectives=be.collectives, kernel=kernel)

    return {
        "core attention, cp=1 sdpa": (False, _backward_of(sdpa, q, k, v)),
        "ring, before (reference blocks)": (True, _backward_of(ring(REFERENCE), *mine)),
        "ring, after (fused blocks)": (True, _backward_of(ring(fused), *mine)),
        "a2a, before (sdpa)": (True,
                               _backward_of(lambda a, b, c: a2a_attention(a, b, c, group=cp, attend=sdpa), *mine)),
        "a2a, after (fused block)": (True, _backward_of(lambda a, b, c: a2a_attention(a, b, c, group=cp, attend=block),
                                                        *mine)),
        "allgather, before (masked sdpa)": (True, _backward_of(
            lambda a, b, c: allgather_attention(a, b, c, group=cp, attend_masked=masked), *mine)),
        "allgather, after (fused blocks)": (True, _backward_of(
            lambda a, b, c: allgather_attention(a, b, c, group=cp, kernel=fused), *mine)),
    }


def kernels_worker(seq: int, heads: int, layers: int, rounds: int) -> dict:
    """``--kernels``: the before/after table of :func:`_variants_kernels` on a cp=2 world (``layers`` unused)."""
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups

    groups = ParallelGroups.build(ParallelConfig(context_parallel_size=2), get_backend().collectives)
    variants = _variants_kernels(groups, seq, heads)
    times = interleaved(variants, groups.cp.rank, rounds, dist.barrier)
    peaks: dict[str, int] = {}
    for name, (distributed, fn) in variants.items():
        on_ranks(distributed, groups.cp.rank, dist.barrier, lambda: peaks.__setitem__(name, peak_bytes(fn)))
    return {"times": times, "peaks": peaks, "waited": {}}


def summarize(ranks: list[dict]) -> dict:
    times, cpu = {}, {}
    for name in ranks[0]["times"]:
        runs = [r["times"][name] for r in ranks if r["times"][name]]  # the ranks that ran it
        times[name] = statistics.median(max(x[i][0] for x in runs) for i in range(len(runs[0]))) * 1e3
        cpu[name] = statistics.median(sum(x[i][1] for x in runs) for i in range(len(runs[0]))) * 1e3
    peaks = {n: max(r["peaks"].get(n, 0) for r in ranks) / 2**20 for n in ranks[0]["peaks"]}
    rows = []
    for group in ("core attention", "attention layer", "GPT step", "ring", "a2a", "allgather"):
        names = [n for n in times if n.startswith(group + ",")]
        base = "core attention, cp=1 sdpa" if group in ("ring", "a2a", "allgather") else names[0] if names else None
        for n in names:
            rows.append({"variant": n, "ms": times[n], "ratio": times[n] / times[base], "cpu_ms": cpu[n],
                         "cpu_ratio": cpu[n] / cpu[base], "peak": peaks.get(n),
                         "peak_ratio": peaks.get(n, 0) / peaks[base] if peaks.get(base) else None})
    if "ring sequential" not in times:  # --cp 4: no overlap study
        return {"rows": rows}
    o, s, c = times["core attention, cp=2 ring"], times["ring sequential"], times["ring comm only"]
    w = {n: statistics.mean(r["waited"][n] for r in ranks) * 1e3 for n in ranks[0]["waited"]}
    overlap = {"overlapped_ms": o, "sequential_ms": s, "comm_only_ms": c, "wait_overlapped_ms": w["overlapped"],
               "wait_sequential_ms": w["sequential"], "wait_comm_only_ms": w["comm_only"],
               "hidden_fraction": 1 - w["overlapped"] / w["sequential"] if w["sequential"] > 0 else float("nan"),
               "time_hidden_fraction": (s - o) / c if c > 0 else float("nan")}
    return {"rows": rows, "overlap": overlap}


def main() -> None:
    from omnitron.testing.distributed import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cp", type=int, default=2, choices=(2, 4),
                    help="2: ring / a2a / allgather and the ring's overlap; 4: ring, a2a and a2a+p2p (2x2) on 4 ranks")
    ap.add_argument("--kernels", action="store_true",
                    help="cp=2 core attention before/after: reference vs fused ring blocks, SDPA vs fused "
                         "a2a/allgather")
    args = ap.parse_args()
    worker = kernels_worker if args.kernels else cp_worker if args.cp == 2 else cp4_worker
    ranks = run_distributed(worker, args.cp, args.seq, args.heads, args.layers, args.rounds, timeout_s=900)
    res = summarize(ranks)
    res["args"] = vars(args)
    print(f"seq {args.seq}, batch 1, {args.heads} heads x {HEAD_DIM}, fp32; GPT: {args.layers} layers, "
          f"hidden {args.heads * HEAD_DIM}, vocab {VOCAB}; median of {args.rounds} interleaved rounds; "
          f"cp={args.cp}: {args.cp} processes x 1 thread, cp=1: 1 process x 2 threads")
    print_table(res["rows"], [("variant", "variant", ""), ("ms", "ms", ".1f"), ("vs cp=1", "ratio", ".2f"),
                              ("CPU ms", "cpu_ms", ".1f"), ("CPU vs cp=1", "cpu_ratio", ".2f"),
                              ("peak MiB/rank", "peak", ".1f"), ("peak vs cp=1", "peak_ratio", ".2f")])
    if "overlap" not in res:
        dump_json(args.json, res)
        return
    o = res["overlap"]
    print("ring attention, cp=2, core attention fwd+bwd (ms: slowest rank; wait: time blocked on K/V transfers)")
    print_table([{"mode": m, "ms": o[f"{k}_ms"], "wait": o[f"wait_{k}_ms"]} for m, k in
                 (("overlapped (as written)", "overlapped"), ("sequential (wait at post)", "sequential"),
                  ("comm only (null kernel)", "comm_only"))],
                [("mode", "mode", ""), ("ms", "ms", ".1f"), ("wait ms", "wait", ".1f")])
    print(f"K/V transfer hidden behind compute: {o['hidden_fraction']:.0%} by wait time (1 - overlapped wait / "
          f"sequential wait); {o['time_hidden_fraction']:.0%} by totals ((sequential - overlapped) / comm only)")
    dump_json(args.json, res)


if __name__ == "__main__":
    main()
