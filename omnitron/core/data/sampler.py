"""Per-rank micro-batch sampling with a resumable position, and batch collation.

``PretrainingSampler`` walks global sample indices ``consumed_samples, consumed_samples + 1, ...``
in steps of ``micro_batch_size * dp_size`` and gives each data-parallel rank its contiguous
slice, so the order of samples seen by the whole job does not depend on ``dp_size`` and a
restart from a saved ``consumed_samples`` continues exactly where training stopped.
"""
from __future__ import annotations

import functools
import sys
import os
from typing import Iterator

import torch

from omnitron.core.lifetime import stop_signals_blocked, tie_worker


class PretrainingSampler:
    """Batch sampler: yields lists of ``micro_batch_size`` dataset indices for rank ``dp_rank``.

    ``consumed_samples`` counts samples handed out to all dp ranks so far. NOTE: a DataLoader
    with workers reads ahead of training, so the trainer should checkpoint its own count of
    samples trained on (``iteration * global_batch_size``) and pass it back here on resume;
    ``state_dict()`` is exact when the sampler is iterated in step with training.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, drop_last: bool = True):
        if total_samples <= 0:
            raise ValueError(f"total_samples must be positive, got {total_samples}")
        if micro_batch_size <= 0:
            raise ValueError(f"--micro-batch-size must be positive, got {micro_batch_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside [0, {dp_size})")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} outside [0, total_samples={total_samples}]")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.drop_last = drop_last

    @property
    def step(self) -> int:
        """Samples per micro-batch step across all data-parallel ranks."""
        return self.micro_batch_size * self.dp_size

    def __len__(self) -> int:
        """Micro-batches this rank's iteration yields: the whole steps left, and without ``drop_last`` the last
        partial step where this rank's slice of it is not empty."""
        whole, rest = divmod(self.total_samples - self.consumed_samples, self.step)
        return whole + int(not self.drop_last and rest > self.dp_rank * self.micro_batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        lo = self.dp_rank * self.micro_batch_size
        while self.consumed_samples < self.total_samples:
            start = self.consumed_samples
            end = min(start + self.step, self.total_samples)
            if end - start < self.step and self.drop_last:
                return
            mine = list(range(start, end))[lo: lo + self.micro_batch_size]
            self.consumed_samples = end
            if mine:
                yield mine

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict) -> None:
        consumed = int(state["consumed_samples"])
        if not 0 <= consumed <= self.total_samples:
            raise ValueError(f"saved consumed_samples {consumed} outside [0, {self.total_samples}]")
        self.consumed_samples = consumed


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """List of per-sample dicts of ``[s]`` tensors -> dict of ``[b, s]`` tensors (same keys)."""
    if not samples:
        raise ValueError("collate got an empty batch")
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


def build_data_loader(dataset, sampler: PretrainingSampler, num_workers: int = 0) -> torch.utils.data.DataLoader:
    """DataLoader over ``dataset`` with ``sampler`` as batch sampler and ``collate``. Its worker processes die
    with this process (:func:`omnitron.core.lifetime.tie_worker`): a killed rank leaves none reading on, and
    are forked where the platform forks (:func:`worker_start_method`)."""
    return _Loader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=num_workers,
                   persistent_workers=num_workers > 0,
                   multiprocessing_context=worker_start_method() if num_workers else None,
                   worker_init_fn=functools.partial(tie_worker, os.getpid()))


class _Loader(torch.utils.data.DataLoader):
    """A DataLoader whose workers start with the stop signals blocked in every thread (see
    :func:`omnitron.core.lifetime.stop_signals_blocked`)."""

    def _get_iterator(self):
        with stop_signals_blocked():
            return super()._get_iterator()


def worker_start_method() -> str | None:
    """``"fork"`` on Linux, else the platform's default (None). NOTE: a rank started by ``omnitron train``'s
    launcher is a ``spawn`` child, and multiprocessing hands a spawn child its parent's method as the
    default, so its loader workers were spawned too: each imported torch afresh (about 2 s of CPU, twice a
    rank at Megatron's ``--num-workers 2``; a 2-iteration tp2 x pp2 job on 2 cores spent half its CPU
    time there). A forked worker shares the rank's imports. It only reads the dataset and collates host
    tensors (never the device, never a process group), as under torchrun, whose ranks fork theirs. Under a
    forkserver default (Python 3.14's on Linux) a worker's parent would be the server, and ``tie_worker``
    would end it at once."""
    return "fork" if sys.platform.startswith("linux") else None
