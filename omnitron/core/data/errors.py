"""The data package's error type, in a module of its own so the lowest modules (the index caches) can raise it."""
from __future__ import annotations


class DataError(ValueError):
    """The data does not fit the configuration (tokenizer, split, sizes); the message names the fix."""
