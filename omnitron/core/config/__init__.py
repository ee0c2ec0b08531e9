"""Dataclass configs, one per concern, validated up front."""
from omnitron.core.config.parallel import ConfigError, ParallelConfig, data_parallel_size

__all__ = ["ConfigError", "ParallelConfig", "data_parallel_size"]
