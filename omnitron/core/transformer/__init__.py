"""Transformer building blocks on ``[s, b, h]`` activations, tensor/sequence parallel aware."""
from omnitron.core.transformer.attention import SelfAttention
from omnitron.core.transformer.layer import TransformerLayer
from omnitron.core.transformer.mlp import MLP
from omnitron.core.transformer.norm import Norm

__all__ = ["SelfAttention", "TransformerLayer", "MLP", "Norm"]
