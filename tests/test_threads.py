"""omnitron.testing.threads: a test's thread count does not outlive the test (the conftest's autouse fixture is
``kept_torch_threads`` around every test)."""
from __future__ import annotations

import pytest
import torch

from omnitron.testing.threads import kept_torch_threads, torch_threads


def _other(n: int) -> int:
    return 2 if n == 1 else 1


def test_a_count_set_inside_the_block_is_undone_after_it_and_after_an_error():
    before = torch.get_num_threads()
    with kept_torch_threads():
        torch.set_num_threads(_other(before))  # as a test body (or omnitron train's launcher) does
    assert torch.get_num_threads() == before
    with pytest.raises(KeyError), kept_torch_threads():
        torch.set_num_threads(_other(before))
        raise KeyError("a failing test body")
    assert torch.get_num_threads() == before


def test_torch_threads_runs_the_block_at_its_count_and_restores_the_previous_one():
    before = torch.get_num_threads()
    with torch_threads(_other(before)):
        assert torch.get_num_threads() == _other(before)
    assert torch.get_num_threads() == before
    with pytest.raises(KeyError), torch_threads(_other(before)):
        raise KeyError("a failing test body")
    assert torch.get_num_threads() == before
