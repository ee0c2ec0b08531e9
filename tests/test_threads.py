"""omnitron.testing.threads.torch_threads: a test's thread count does not outlive the test."""
from __future__ import annotations

import pytest
import torch

from omnitron.testing.threads import torch_threads


def test_the_count_in_force_before_comes_back_after_the_block_and_after_an_error():
    before = torch.get_num_threads()
    other = 2 if before == 1 else 1
    with torch_threads(other):
        assert torch.get_num_threads() == other
    assert torch.get_num_threads() == before
    with pytest.raises(KeyError), torch_threads(other):
        raise KeyError("a failing test body")
    assert torch.get_num_threads() == before
