"""Torch's intra-op thread count for a stretch of a test run in the test's own process."""
from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def kept_torch_threads() -> Iterator[None]:
    """Whatever the block does to ``torch.set_num_threads``, the count in force before it is in force after it.

    The count is process state: a CPU GEMM or reduction splits its sums by it, so a test that sets it and leaves
    it changes the rounding, and hence a chaotic training run's result, of every later test in that pytest process.
    """
    import torch

    before = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(n)``, the previous count restored after it, error or not."""
    import torch

    with kept_torch_threads():
        torch.set_num_threads(n)
        yield
