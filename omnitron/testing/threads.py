"""Torch's intra-op thread count for a stretch of a test run in the test's own process."""
from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``torch.set_num_threads(n)`` and put the previous count back after it, error or not.

    The count is process state: a CPU GEMM or reduction splits its sums by it, so a test that sets it and leaves
    it changes the rounding, and hence a chaotic training run's result, of every later test in that pytest process.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
