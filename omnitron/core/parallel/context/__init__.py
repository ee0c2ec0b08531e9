"""Context parallelism: the sequence split over ``groups.cp``, attention as a ring.

``layout`` (which positions a cp rank holds; batch slicing and the loss share), ``blocks`` (the
per-block attention kernel with its log-sum-exp), ``ring`` (the autograd Function), ``ulysses``
(``a2a`` and ``allgather``), ``hierarchical`` (``a2a+p2p``: all-to-all, then the ring), and
:func:`apply_context_parallel`, which points a model's attention modules (grouped-query and multi-latent) at
the cp group. Every path takes a value head dim unlike the query's, causal sliding windows and attention
sinks (:mod:`omnitron.core.transformer.cp_attention` picks the path per module).
"""
from omnitron.core.parallel.context.blocks import REFERENCE, BlockKernel, backend_kernel, block_backward, block_forward
from omnitron.core.parallel.context.layout import (chunk_positions, context_parallel_batch, context_parallel_loss,
                                                   local_positions, split_sequence)
from omnitron.core.parallel.context.ring import ring_attention


def apply_context_parallel(model, group, comm_type: str = "p2p", subgroups=None):
    """Make every self-attention module of ``model`` attend over the sequence split across ``group``
    (a no-op at size 1) by ``comm_type`` (``--cp-comm-type``: p2p ring, a2a, allgather, a2a+p2p); returns
    ``model``. ``a2a+p2p`` needs ``subgroups``: this rank's ``(a2a group, p2p group)`` (``groups.cp_a2a``,
    ``groups.cp_p2p``). Inputs must then be this rank's load-balanced slice."""
    from omnitron.core.transformer.attention import SelfAttention
    from omnitron.core.transformer.mla import MLASelfAttention

    if comm_type == "a2a+p2p" and group.size > 1:
        if subgroups is None:
            raise ValueError("--cp-comm-type a2a+p2p needs the a2a and p2p sub-groups of the cp group "
                             "(--hierarchical-context-parallel-sizes)")
        a2a, p2p = subgroups
        if a2a.size * p2p.size != group.size or not set(a2a.ranks) <= set(group.ranks):
            raise ValueError(f"a2a+p2p sub-groups {a2a.ranks} x {p2p.ranks} do not split the cp group {group.ranks}")
    if group.size > 1:
        for m in model.modules():
            if isinstance(m, (SelfAttention, MLASelfAttention)):
                m.cp_group, m.cp_comm_type = group, comm_type
                m.cp_subgroups = tuple(subgroups) if comm_type == "a2a+p2p" else None
    return model


__all__ = ["apply_context_parallel", "ring_attention", "chunk_positions", "local_positions", "split_sequence",
           "context_parallel_batch", "context_parallel_loss", "block_forward", "block_backward", "BlockKernel",
           "REFERENCE", "backend_kernel"]
