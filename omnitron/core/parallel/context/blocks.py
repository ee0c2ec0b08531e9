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

from omnitron.kernels.function_output import cast_output
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

    ``tasks`` lists the blocks as ``(query rows, key rows, causal)`` or the ring's tiles
    (:class:`.tiles.Tile`, whose keep ``mask`` runs the reference kernel); every query row must be covered by at
    least one. Blocks merge from an empty start (``lse = -inf``), so their row slices may overlap. ``sinks [hq]``
    (optional): one sink logit per query head, entering each row's denominator once after the merge, as in the
    ring (:func:`add_sinks`). Forward keeps only the merged output and log-sum-exp (fp32, fp64 for fp64 inputs);
    backward runs the kernel's backward per block given them, so no ``[sq, sk]`` scores are stored (the
    all-gather and all-to-all paths of context parallelism, sliding windows and sinks included).
    ``drop``: the hash dropout of all of ``q``'s rows against all of ``k``'s (:class:`omnitron.kernels.hash_dropout.
    HashDropout`), narrowed to each task's block (None: no dropout)."""

    @staticmethod
    def forward(ctx, q, k, v, tasks: list, kernel: BlockKernel, scale: float, drop=None, sinks=None):
        cdt = torch.promote_types(q.dtype, torch.float32)
        out = q.new_zeros(q.shape[:3] + v.shape[3:], dtype=cdt)  # v's head dim (MLA: not q's)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=cdt, device=q.device)
        for rows, cols, call, kw in _calls(tasks, kernel, scale, drop):
            o, l = call.forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], **kw)
            merge(out[:, :, rows], lse[:, :, rows], o.to(cdt), l.to(cdt))
        if sinks is not None:
            out, lse = add_sinks(out, lse, sinks)
        result = cast_output(out, q.dtype)
        ctx.tasks, ctx.kernel, ctx.scale, ctx.drop = tasks, kernel, scale, drop
        ctx.save_for_backward(q, k, v, result, lse, sinks)
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        cdt, dout = lse.dtype, dout.contiguous()
        dsinks = None if sinks is None or not ctx.needs_input_grad[7] else sink_grad(dout, out, lse, sinks)
        dq, dk, dv = (torch.zeros(t.shape, dtype=cdt, device=t.device) for t in (q, k, v))
        for rows, cols, call, kw in _calls(ctx.tasks, ctx.kernel, ctx.scale, ctx.drop):
            g = call.backward(dout[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols], out[:, :, rows],
                              lse[:, :, rows], **kw)
            for acc, part in zip((dq[:, :, rows], dk[:, :, cols], dv[:, :, cols]), g):
                acc += part
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, dsinks


def _calls(tasks: list, kernel: BlockKernel, scale: float, drop):
    """``(rows, cols, kernel, keyword arguments)`` per task: a task with a keep mask runs the reference (only it
    takes a mask), the others ``kernel``; each with its block's dropout."""
    for rows, cols, causal, *mask in tasks:
        mask = mask[0] if mask else None
        kw = dict(causal=causal, scale=scale, drop=_narrow(drop, rows, cols))
        yield rows, cols, (kernel if mask is None else REFERENCE), kw if mask is None else {**kw, "mask": mask}


def add_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o', L')``: the merged output and log-sum-exp with each head's sink logit in the denominator once."""
    a = sinks.to(lse.dtype).view(1, -1, 1).expand_as(lse)
    new = torch.logaddexp(lse, a)
    return out * torch.exp(lse - new).unsqueeze(-1), new


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``d sinks [hq]`` given the final output and log-sum-exp (sink included) of these query rows."""
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # [b, hq, s]
    return -(torch.exp(sinks.to(lse.dtype).view(1, -1, 1) - lse) * delta).sum((0, 2)).to(sinks.dtype)


def _narrow(drop, rows: slice, cols: slice):
    """``drop`` narrowed to one block (None stays None)."""
    return None if drop is None else drop.narrow(rows, cols)
