"""A sequence-parallel column-parallel GEMM that saves its input SHARD for backward.

Under sequence parallelism a column-parallel linear reads ``[s/tp, b, h]``, all-gathers it to ``[s, b, h]`` and
multiplies. Gathering with :func:`~omnitron.core.parallel.tensor.mappings.gather_from_sp` and then calling
``F.linear`` makes autograd save the GATHERED input for the weight gradient: a whole-sequence copy per linear, layer
and micro-batch in flight (at 462B, tp 8, sequence 4096: ~264 MB a layer and micro-batch). Megatron-LM
(``LinearWithGradAccumulationAndAsyncCommunication``, ``sequence_parallel=True``) saves the shard and all-gathers it
again in backward; :func:`gather_linear` does the same:

- forward: ``x_full = all-gather(x)``, ``y = x_full W^T + b``; saves ``x`` (the shard) and ``W``;
- backward: ``dx_full = dy W`` reduce-scattered into this rank's shard (the GEMM is tensor-parallel, so each rank's
  ``dx_full`` is a partial sum: ``_GatherFromSP``'s ``grad_is_partial``), THEN ``x_full`` gathered again for
  ``dW = dy^T x_full`` (and ``db``). In that order the whole-sequence ``dx_full`` is freed before the re-gathered
  ``x_full`` exists: backward holds one ``[s, b, h]`` transient at a time, as the gathered-input path did (its
  ``dx_full`` beside the saved ``x_full``). Every tp rank issues the same collectives in the same order
  (reduce-scatter, all-gather), both skipped alike where autograd needs no such gradient.

While ``torch.compile`` traces, the same is a checkpointed all-gather and ``F.linear`` (:func:`_compiled`): the
compiled graph saves the shard and recomputes the gather in backward (its order there is the partitioner's).
The FP8 GEMM seam does not come here (its function saves its own FP8 copy of the gathered input), nor tp = 1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from omnitron.core.parallel.split_backward import computes_input, computes_weight
from omnitron.core.parallel.tensor import mappings as M


class _GatherLinear(torch.autograd.Function):
    """forward: all-gather dim 0, linear; saves the shard. backward: dgrad reduce-scattered, wgrad on a re-gather."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        dev = x.device.type
        if torch.is_autocast_enabled(dev):  # cast as autocast's F.linear would, and save what it would
            dt = torch.get_autocast_dtype(dev)
            x, weight, bias = x.to(dt), weight.to(dt), None if bias is None else bias.to(dt)
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(M.gather_first(x, group), weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        # B / W of a split backward compute one side each (split_backward.py)
        need_x, need_w, need_b = need_x and computes_input(ctx), need_w and computes_weight(ctx), \
            need_b and computes_weight(ctx)
        gx = gw = gb = None
        if need_x:
            gx = M.reduce_scatter_first(g.matmul(weight), ctx.group)  # [s, b, out/tp] @ [out/tp, h], then the shard
        g2 = g.reshape(-1, g.shape[-1])
        if need_w:
            full = M.gather_first(x, ctx.group)  # the whole sequence again, for the weight gradient only
            gw = g2.t().matmul(full.reshape(-1, full.shape[-1]))
        if need_b and ctx.has_bias:
            gb = g2.sum(0)
        return gx, gw, gb, None


def gather_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group) -> torch.Tensor:
    """``all-gather(x) W^T + b`` over dim 0 of ``x`` (a sequence shard), saving the shard (module doc)."""
    if group.size == 1:
        return F.linear(x, weight, bias)
    if torch.compiler.is_compiling():  # see _compiled
        return _compiled(x, weight, bias, group)
    return _GatherLinear.apply(x, weight, bias, group)


def _compiled(x, weight, bias, group):
    """While dynamo traces: AOTAutograd's partitioner moves backward work that needs no gradient into the forward
    graph, so :class:`_GatherLinear`'s re-gather would run forward and its output be saved (measured: the gathered
    bytes, as before). A non-reentrant checkpoint of the gather, every op in it MUST_RECOMPUTE, recomputes it in
    backward instead."""
    from torch.utils import checkpoint as torch_checkpoint

    full = torch_checkpoint.checkpoint(M.gather_from_sp, x, group, use_reentrant=False, context_fn=_recompute_all)
    return F.linear(full, weight, bias)


def _recompute_all():
    """Context pair of the traced checkpoint in :func:`_compiled`: every op in it MUST be recomputed. A plain
    checkpoint only prefers recomputation, which torch 2.11's partitioner declined for the gather (the compiled
    forward saved the gathered input, twice the shard's bytes at tp2; torch 2.13 recomputed it)."""
    from torch.utils import checkpoint as torch_checkpoint

    must = torch_checkpoint.CheckpointPolicy.MUST_RECOMPUTE
    return torch_checkpoint.create_selective_checkpoint_contexts(lambda ctx, op, *args, **kwargs: must)
