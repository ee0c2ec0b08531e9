"""The per-block kernel of ring attention: :class:`BlockKernel` pairs a forward (block output and
log-sum-exp) with the block's backward given the final output and log-sum-exp.

The maths are the kernel ops ``attention_block_forward`` / ``attention_block_backward``
(reference in :mod:`omnitron.kernels.reference.attention_block`); :func:`backend_kernel` takes
them from a backend's kernel table, so a flash implementation registered there is used.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from omnitron.kernels.reference.attention_block import block_backward, block_forward


class BlockKernel(NamedTuple):
    """The two calls ring attention makes per block (see :func:`block_forward`, :func:`block_backward`)."""

    forward: Callable
    backward: Callable


REFERENCE = BlockKernel(block_forward, block_backward)


def backend_kernel(backend) -> BlockKernel:
    """The block kernel of ``backend``'s kernel table (its best implementation, reference fall-back)."""
    return BlockKernel(backend.kernels.attention_block_forward, backend.kernels.attention_block_backward)
