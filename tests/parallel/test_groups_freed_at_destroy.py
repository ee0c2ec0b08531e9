"""A rank that destroys its process groups frees them then, with their gloo worker threads, before the interpreter
finalizes. A group kept alive (by the data-parallel wrapper, whose gradient hooks on the parameters made a cycle the
garbage collector does not free, and by the flight recorder's and the group agreement's records) kept its threads
into finalization, where one still dropping a finished all-reduce's tensors takes the GIL, ends in ``pthread_exit``
inside a C++ destructor and aborts the process (SIGABRT after a successful run: seen once in 34 runs of
tests/training/test_node_local_cache.py, core dump of rank 0: ``ProcessGroupGloo::runLoop`` ->
``~AsyncAllreduceWork`` -> ``decref_pyobject`` -> ``take_gil`` -> ``pthread_exit`` -> ``std::terminate``)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from omnitron.core.config import ParallelConfig
from omnitron.core.parallel.data import DataParallelConfig
from omnitron.testing.distributed import run_distributed


def _threads() -> dict[int, str]:
    """This process's threads: id -> name."""
    return {int(t): open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")}


def _named_gloo(threads: dict[int, str]) -> int:
    """How many of ``threads`` are named as torch names a gloo group's workers and its transport loop (torch 2.13
    does; torch 2.9 leaves them unnamed, as ``python``)."""
    return sum(n in ("pt_gloo_runloop", "gloo_tcp_loop") for n in threads.values())


def _train_then_destroy() -> tuple[int, int, int, int]:
    """Threads the groups built here started (alive after one overlapped data-parallel step, strict mode recording
    its collectives), how many of them live on after the rank drops its own references and destroys the groups,
    and the named gloo threads at those two points. The first two need no thread names (torch 2.9 has none)."""
    from omnitron.backends import get_backend
    from omnitron.core.parallel.data import DistributedDataParallel
    from omnitron.core.parallel.groups import ParallelGroups

    be = get_backend()
    before = _threads()  # the default group's threads (run_distributed made it) among them
    groups = ParallelGroups.build(ParallelConfig(), backend=be)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ddp = DistributedDataParallel(model, groups, DataParallelConfig(overlap_grad_reduce=True, bucket_size=100))
    ddp.zero_grad_buffer()
    ddp(torch.randn(4, 8)).square().mean().backward()
    ddp.finish_grad_sync()
    during = _threads()
    del ddp, model, groups
    be.collectives.destroy()
    after = _threads()
    started = during.keys() - before.keys()
    return len(started), len(started & after.keys()), _named_gloo(during), _named_gloo(after)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads under /proc/self/task")
def test_destroy_frees_the_gloo_groups_and_their_threads():
    for rank, (started, kept, named, named_after) in enumerate(
            run_distributed(_train_then_destroy, 2, backend="cpu", timeout_s=120)):
        assert started > 0, rank  # the groups' threads are seen
        assert kept == 0, (rank, started, kept)
        assert named_after == 0, (rank, named, named_after)  # the default group's too (where torch names them)
