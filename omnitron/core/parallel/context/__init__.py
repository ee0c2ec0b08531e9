"""Context parallelism: the sequence split over ``groups.cp``, attention as a ring.

``layout`` (which positions a cp rank holds; batch slicing and the loss share), ``blocks`` (the
per-block attention kernel with its log-sum-exp), ``ring`` (the autograd Function), and
:func:`apply_context_parallel`, which points a model's attention modules at the cp group.
"""
from omnitron.core.parallel.context.blocks import REFERENCE, BlockKernel, backend_kernel, block_backward, block_forward
from omnitron.core.parallel.context.layout import (chunk_positions, context_parallel_batch, context_parallel_loss,
                                                   local_positions, split_sequence)
from omnitron.core.parallel.context.ring import ring_attention


def apply_context_parallel(model, group, comm_type: str = "p2p"):
    """Make every self-attention module of ``model`` attend over the sequence split across ``group``
    (a no-op at size 1) by ``comm_type`` (``--cp-comm-type``: p2p ring, a2a, allgather); returns ``model``.
    Inputs must then be this rank's load-balanced slice."""
    from omnitron.core.transformer.attention import SelfAttention

    if group.size > 1:
        for m in model.modules():
            if isinstance(m, SelfAttention):
                m.cp_group, m.cp_comm_type = group, comm_type
    return model


__all__ = ["apply_context_parallel", "ring_attention", "chunk_positions", "local_positions", "split_sequence",
           "context_parallel_batch", "context_parallel_loss", "block_forward", "block_backward", "BlockKernel",
           "REFERENCE", "backend_kernel"]
