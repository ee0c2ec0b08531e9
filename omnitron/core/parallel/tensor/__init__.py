"""Tensor and sequence parallelism: region maps, parallel layers, vocab-parallel loss, RNG tracker."""
from omnitron.core.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from omnitron.core.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from omnitron.core.parallel.tensor.mappings import (copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp,
                                                    reduce_scatter_to_sp, scatter_to_sp, scatter_to_tp)
from omnitron.core.parallel.tensor.random import RNGTracker, checkpoint
from omnitron.core.parallel.tensor.sharding import gather_param, init_full, shard_param

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "copy_to_tp", "reduce_from_tp", "scatter_to_tp", "gather_from_tp", "scatter_to_sp", "gather_from_sp",
           "reduce_scatter_to_sp", "RNGTracker", "checkpoint", "gather_param", "shard_param", "init_full"]
