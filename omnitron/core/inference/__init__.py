"""Simple generation: greedy / top-k sampling with a KV cache on one process (see ``sample``)."""
from omnitron.core.inference.sample import KVCache, generate, single_process_model

__all__ = ["KVCache", "generate", "single_process_model"]
