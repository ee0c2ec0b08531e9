"""Inference on one process: batched generation with a KV cache (GPT, T5, LLaVA), sampling, the HTTP server."""
from omnitron.core.inference.generation import Generation, generate_batch
from omnitron.core.inference.kv_cache import CrossKVCache, KVCache
from omnitron.core.inference.sample import generate, single_process_model
from omnitron.core.inference.sampling import GREEDY, SamplingParams

__all__ = ["CrossKVCache", "GREEDY", "Generation", "KVCache", "SamplingParams", "generate", "generate_batch",
           "single_process_model"]
