"""The per-block kernel of ring attention: :class:`BlockKernel` pairs a forward (block output and
log-sum-exp) with the block's backward given the final output and log-sum-exp.

The maths are the kernel ops ``attention_block_forward`` / ``attention_block_backward``
(reference in :mod:`omnitron.kernels.reference.attention_block`); :func:`backend_kernel` takes
them from a backend's kernel table, so a flash implementation registered there is used.
:class:`BlockedAttention` runs a fixed list of blocks on one rank with such a kernel (the all-gather path).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from omnitron.kernels.reference.attention_block import block_backward, block_forward


class BlockKernel(NamedTuple):
    """The two calls ring attention makes per block (see :func:`block_forward`, :func:`block_backward`)."""

    forward: Callable
    backward: Callable


REFERENCE = BlockKernel(block_forward, block_backward)


def backend_kernel(backend) -> BlockKernel:
    """The block kernel of ``backend``'s kernel table (its best implementation, reference fall-back)."""
    return BlockKernel(backend.kernels.attention_block_forward, backend.kernels.attention_block_backward)


Task = tuple[slice, slice, bool]
"""One block of a blocked attention: (query rows, key rows, causal mask on this square block)."""


def merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, l: torch.Tensor) -> None:
    """In place: ``out, lse`` <- the exact softmax combination of two partial results (``o``, ``l``: the
    block's output normalised within the block and its log-sum-exp). A row with ``-inf`` on both sides (no
    key seen yet, none in the block) stays at zero and ``-inf``."""
    new = torch.logaddexp(lse, l)
    shift = new.nan_to_num(neginf=0.0)  # a row with no key at all: exp(-inf - 0) = 0 on both sides, not nan
    out.mul_(torch.exp(lse - shift).unsqueeze(-1)).add_(o * torch.exp(l - shift).unsqueeze(-1))
    lse.copy_(new)


class BlockedAttention(torch.autograd.Function):
    """Attention of ``q`` over ``k, v`` computed block by block with ``kernel`` and merged by log-sum-exp.

    ``tasks`` lists the blocks; every query row must be covered by at least one, and two tasks' row slices are
    equal or disjoint (the first task of a row slice starts it, later ones merge into it). Forward keeps only the
    merged output and log-sum-exp (fp32, fp64 for fp64 inputs); backward runs the kernel's backward per
    block given them, so no ``[sq, sk]`` scores are stored (the all-gather path of context parallelism).
    ``drop``: the hash dropout of all of ``q``'s rows against all of ``k``'s (:class:`omnitron.kernels.hash_dropout.
    HashDropout`), narrowed to each task's block (None: no dropout)."""

    @staticmethod
    def forward(ctx, q, k, v, tasks: list[Task], kernel: BlockKernel, scale: float, drop=None):
        cdt = torch.promote_types(q.dtype, torch.float32)
        out = lse = None
        seen: list[slice] = []  # row slices written so far (a row slice is either one seen before or disjoint)
        for rows, cols, causal in tasks:
            o, l = kernel.forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], causal=causal, scale=scale,
                                  drop=_narrow(drop, rows, cols))
            o, l = o.to(cdt), l.to(cdt)
            if rows == slice(None) and not seen:  # a block over every row: its result is the start
                out, lse = o, l
            elif rows in seen:
                merge(out[:, :, rows], lse[:, :, rows], o, l)
            else:
                if out is None:
                    out = q.new_empty(q.shape[:3] + v.shape[3:], dtype=cdt)  # v's head dim (MLA: not q's)
                    lse = q.new_empty(q.shape[:3], dtype=cdt)
                out[:, :, rows], lse[:, :, rows] = o, l
            seen.append(rows)
        result = out.to(q.dtype)
        ctx.tasks, ctx.kernel, ctx.scale, ctx.drop = tasks, kernel, scale, drop
        ctx.save_for_backward(q, k, v, result, lse)
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cdt, dout = lse.dtype, dout.contiguous()
        if len(ctx.tasks) == 1 and ctx.tasks[0][:2] == (slice(None), slice(None)):  # one block: its gradients
            g = ctx.kernel.backward(dout, q, k, v, out, lse, causal=ctx.tasks[0][2], scale=ctx.scale, drop=ctx.drop)
            return g[0].to(q.dtype), g[1].to(k.dtype), g[2].to(v.dtype), None, None, None, None
        dq, dk, dv = (torch.zeros(t.shape, dtype=cdt, device=t.device) for t in (q, k, v))
        for rows, cols, causal in ctx.tasks:
            g = ctx.kernel.backward(dout[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols], out[:, :, rows],
                                    lse[:, :, rows], causal=causal, scale=ctx.scale,
                                    drop=_narrow(ctx.drop, rows, cols))
            for acc, part in zip((dq[:, :, rows], dk[:, :, cols], dv[:, :, cols]), g):
                acc += part
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _narrow(drop, rows: slice, cols: slice):
    """``drop`` narrowed to one block (None stays None)."""
    return None if drop is None else drop.narrow(rows, cols)
