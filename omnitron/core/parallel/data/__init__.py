"""Data parallelism: bucketed gradient buffers, overlapped reduction, and the end-of-step gradient sync.

Training-loop use, per step::

    for c in chunks: c.zero_grad_buffer()
    out = forward_backward(...)                 # omnitron.core.parallel.pipeline
    finalize_model_grads(chunks, groups)        # dp (+cp) mean, sequence-parallel and tied-embedding sums
    optimizer.step()                            # reads param.main_grad when present

``--use-torch-fsdp2`` wraps each chunk in :class:`FullyShardedDataParallel` instead (PyTorch's FSDP2: the
reduce-scatter happens in backward; :mod:`omnitron.core.parallel.data.fsdp`).
"""
from omnitron.core.parallel.data.buffers import Bucket, GradBuffer
from omnitron.core.parallel.data.config import DataParallelConfig, num_microbatches
from omnitron.core.parallel.data.ddp import DistributedDataParallel
from omnitron.core.parallel.data.finalize import finalize_model_grads, scale_gradients, sequence_parallel_params
from omnitron.core.parallel.data.fsdp import FullyShardedDataParallel
from omnitron.core.parallel.data.wrapper import ChunkWrapper, unwrap_model

__all__ = ["Bucket", "ChunkWrapper", "GradBuffer", "DataParallelConfig", "num_microbatches", "DistributedDataParallel",
           "FullyShardedDataParallel", "unwrap_model", "finalize_model_grads", "scale_gradients",
           "sequence_parallel_params"]
