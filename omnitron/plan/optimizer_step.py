"""The optimizer step's own temporaries (bytes, one rank of a pipeline stage): what the precision-aware Adam step
(:meth:`omnitron.core.optim.optimizer.MixedPrecisionOptimizer._adamw_low`) allocates beyond the state.

It runs when a moment is stored below fp32 (--exp-avg-dtype / --exp-avg-sq-dtype) or a bf16 parameter's master
is kept as a remainder (``store_param_remainders``): each master goes through fp32 copies of at most
``MOMENT_CHUNK`` elements, ``c`` of them for the largest piece the rank steps (a parameter, or with the
distributed optimizer the largest owned slice of any rank). Per chunk, counted from the code:

- the second pass (the real step): the joined fp32 master (remainders), one fp32 copy per moment below fp32, and
  the step kernel's workspace -- one fp32 chunk, the reference kernel's denominator (what sim runs; the fused
  kernels need none), and another for its fp32 copy of a bf16 gradient (--main-grads-dtype bf16: the step reads
  the gradient buffers as they are) -- or, after the kernel, the split's sign mask and increment (1 + 2 bytes an
  element);
- the first pass (an fp16 moment: its new scale is the whole moment's absmax): fp32 copies of the master and of
  both moments, and the kernel's workspace;
- one-element tensors: at most :data:`SCALARS` at once (the fresh scales 2, the running absmax 2, and an absmax
  under way: aminmax's pair, a negation and a maximum).

Each tensor is counted in the allocator's 512-byte blocks. The step runs after backward has freed the
activations, so the stage's peak is the larger of the two (:class:`omnitron.plan.memory.StageMemory`). Not
counted: the gradient norm's and the fp32 path's kernel workspaces (fused kernels need none).
"""
from __future__ import annotations

import torch

BLOCK = 512
"""The allocators' granule (sim's; the CUDA caching allocator's smallest block)."""
SCALARS = 8
"""One-element tensors alive at once inside a chunk's step (module docstring)."""


def _blocks(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def chunk_bytes(c: int, *, remainder: bool, low: int, fp16: bool, grads32: bool = True) -> int:
    """Peak temporaries of stepping a chunk of ``c`` elements: ``remainder``: the master is joined from its
    remainder; ``low``: moments stored below fp32 (0-2); ``fp16``: one of them is fp16 (a first pass);
    ``grads32``: the gradients are fp32 (else the kernel makes an fp32 copy)."""
    if c <= 0:
        return 0
    f32 = _blocks(4 * c)
    work = f32 * (1 + (not grads32))  # the kernel's denominator (and its copy of a bf16 gradient)
    split = _blocks(c) + _blocks(2 * c)  # the sign mask and its int16 increment (join's are fewer tensors alive)
    second = remainder * f32 + low * f32 + max(work, remainder * split)
    first = 3 * f32 + work if fp16 else 0  # master, both moments, the kernel's workspace
    return max(first, second) + SCALARS * BLOCK


def largest_piece(buf, size: int, dist: bool) -> int:
    """Most elements of one parameter any rank steps in ``buf``: the whole parameter, or with the distributed
    optimizer the largest overlap of a parameter with one rank's slice of its bucket (``size`` slices)."""
    most = 0
    for b in buf.buckets:
        n = b.data.numel() // size
        for p in b.params:
            s0, c = buf.param_range(p)
            if not dist or c >= 2 * n:  # a parameter of 2n elements covers some slice whole
                most = max(most, min(c, n) if dist else c)
                continue
            first, last = (s0 - b.offset) // n, (s0 + c - 1 - b.offset) // n
            for r in range(first, last + 1):
                lo, hi = max(s0, b.offset + r * n), min(s0 + c, b.offset + (r + 1) * n)
                most = max(most, hi - lo)
    return most


def step_bytes(settings, buffers, dist: bool) -> int:
    """The step's peak temporaries over ``buffers`` ((GradBuffer, replica-group size) pairs, :func:`.state._buffers`);
    0 when Adam steps in fp32 directly (no moment below fp32, no remainders)."""
    from omnitron.core.optim import optimizer as opt_module
    from omnitron.core.optim.moments import MOMENT_DTYPES

    optim = settings.optim
    if optim.optimizer not in ("adam", "adamw"):
        return 0
    dtypes = [MOMENT_DTYPES[optim.exp_avg_dtype], MOMENT_DTYPES[optim.exp_avg_sq_dtype]]
    low = sum(d != torch.float32 for d in dtypes)
    most = 0
    for buf, size in buffers:
        remainder = optim.store_param_remainders and any(p.dtype == torch.bfloat16 for p in buf.params)
        if not (low or remainder):
            continue
        c = min(largest_piece(buf, size, dist), opt_module.MOMENT_CHUNK)
        most = max(most, chunk_bytes(c, remainder=remainder, low=low, fp16=torch.float16 in dtypes,
                                     grads32=buf.data.dtype == torch.float32))
    return most
