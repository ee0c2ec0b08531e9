"""The base of the data-parallel wrappers: one model chunk inside, ``forward`` is the chunk's, unknown
attributes fall through to it."""
from __future__ import annotations

from torch import nn


class ChunkWrapper(nn.Module):
    """Holds ``module`` (one model chunk); subclasses add the gradient synchronisation."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("module"), name)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def unwrap_model(chunk):
    """The plain module inside a data-parallel wrapper (or ``chunk`` itself)."""
    return chunk.module if isinstance(chunk, ChunkWrapper) else chunk
