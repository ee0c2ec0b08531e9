"""GPT-2 / Llama style decoder-only models."""
from omnitron.core.models.gpt.config import (GPTConfig, flops_per_iteration, num_parameters, padded_vocab_size,
                                             validate_model)
from omnitron.core.models.gpt.model import GPTModel
from omnitron.core.models.gpt.presets import gpt2_tiny, gpt_1p3b, llama_tiny
from omnitron.core.models.gpt.state import allreduce_sequence_parallel_grads, gather_full_state, shard_full_state

__all__ = ["GPTConfig", "GPTModel", "gpt2_tiny", "llama_tiny", "gpt_1p3b", "validate_model", "padded_vocab_size",
           "num_parameters", "flops_per_iteration", "gather_full_state", "shard_full_state",
           "allreduce_sequence_parallel_grads"]
