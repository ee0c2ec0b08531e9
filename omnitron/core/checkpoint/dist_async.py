"""``--async-save`` for ``--ckpt-format torch_dist``: the step waits only for a host snapshot of the state.

A save (:meth:`AsyncSaver.save`, collective over the world) first finishes the previous one
(:meth:`AsyncSaver.wait`), then copies every piece this rank writes into host staging buffers
(:class:`~omnitron.core.checkpoint.dist_staging.Staging`: allocated once, before the first step, and
reused by every save; their size, logged then, is the bytes this rank writes -- at most one copy of its
own state) and returns; a thread makes ``iter_N.tmp`` (rank 0; the threads meet in a barrier after it,
so the step never waits for another rank) and writes the staged copy through DCP
(:func:`omnitron.core.checkpoint.dist.write`) while training goes on. :meth:`AsyncSaver.wait` -- called
by the next save and at the end of training, on every rank at the same point -- joins the thread, agrees
over the ranks that every write succeeded (one small all-reduce on the main thread), and only then
commits (checksums into metadata.json, rename, ``latest``). A process killed before that leaves
``iter_N.tmp`` uncommitted and ``latest`` on the previous checkpoint; the next save's ``_begin`` removes
the stale directory.

Collectives: the thread's DCP save (its planning and result exchange) runs over a host (gloo) process
group of its own, made once over the world (every rank makes it at the same point: :meth:`AsyncSaver.prepare`,
which training calls before its first step so that no save pays for it or for the staging buffers;
else the first save). Being a host group it never reaches the device's communicator, so it cannot
interleave with the training's collectives there (on NCCL two threads' collectives on one device
deadlock when ranks issue them in different orders; the sim device reports it): safe by construction,
as torch's ``dcp.async_save`` asks for a CPU group. The staged pieces are host memory, so DCP needs
no device for them.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import torch

from omnitron.core.checkpoint import dist, io
from omnitron.core.checkpoint.dist_planner import Pieces
from omnitron.core.checkpoint.dist_staging import Staging
from omnitron.core.checkpoint.io import CheckpointError

log = logging.getLogger("omnitron.train")


def saved_pieces(c) -> Pieces:
    """The live pieces this rank writes (weights and optimizer state)."""
    return {**dist.model_pieces(c, save=True), **dist.optimizer_pieces(c, save=True)}


@dataclass
class _Pending:
    thread: threading.Thread
    iteration: int
    save_dir: str
    meta: dict
    keep_last_n: int | None
    error: list
    retain_interval: int | None = None


class AsyncSaver:
    """One run's background torch_dist saves (at most one in flight; see the module docstring)."""

    def __init__(self, collectives) -> None:
        self.coll, self.group, self.pending, self.staging = collectives, None, None, None

    def prepare(self, c) -> None:
        """Collective (once): make the background writes' process group over the world, and the host
        staging buffers (:meth:`_staging`)."""
        self._writer_group(c)
        self._staging(c, saved_pieces(c))

    def _writer_group(self, c) -> None:
        """Collective the first time: the background writes' own process group (none without one)."""
        if self.group is None and self.coll.is_initialized():
            self.group = self.coll.new_host_group(range(c.groups.world_size), "checkpoint writer")

    def _staging(self, c, pieces: Pieces) -> Staging:
        """The staging buffers for ``pieces``: the cached ones, or (first use, or the pieces moved: a
        reloaded optimizer state) new ones, logged with their size."""
        if self.staging is None or not self.staging.matches(pieces):
            again = self.staging is not None
            self.staging = None  # the old buffers go before the new ones are allocated
            self.staging = Staging(pieces, pin=c.backend.current_device().type != "cpu")
            if c.groups.rank == 0:
                log.info("--async-save: %s host staging buffers of %.1f MiB on rank 0 (one copy of the state it "
                         "writes), reused by every save", "new" if again else "allocated", self.staging.nbytes / 2**20)
        return self.staging

    def save(self, c, save_dir: str, iteration: int, meta: dict, local: dict, *, barrier, keep_last_n=None,
             retain_interval=None) -> str:
        """Collective: finish the previous save, snapshot this rank's pieces and start writing them;
        returns the directory ``iter_N`` becomes once :meth:`wait` commits it."""
        self.wait(c, barrier)
        final, rank = os.path.join(save_dir, io.iter_dir_name(iteration)), c.groups.rank
        pieces = self._staging(c, saved_pieces(c)).stage(c.backend.synchronize)
        self._writer_group(c)  # made here only when not prepared before the first step
        error: list = []
        device = c.backend.current_device()

        def run():
            try:
                if device.index is not None:  # a new thread starts on device 0; DCP's object collectives use it
                    c.backend.set_device(device.index)
                if rank == 0:
                    io._begin(save_dir, final)
            except BaseException as err:  # noqa: BLE001 - reported on the main thread by wait()
                error.append(err)
            try:  # even after a failed begin: the other ranks' collectives need this rank's (nothing commits)
                self.coll.barrier(self.group)  # every rank writes into the iter_N.tmp rank 0 made
                dist.write(final + ".tmp", rank, pieces, local, self.group)
            except BaseException as err:  # noqa: BLE001
                error.append(err)

        thread = threading.Thread(target=run, name=f"omnitron-async-save-{iteration}", daemon=True)
        self.pending = _Pending(thread, iteration, save_dir, meta, keep_last_n, error, retain_interval)
        thread.start()
        return final

    def wait(self, c, barrier) -> str | None:
        """Collective: join the write in flight (if any) and commit it; returns the committed directory.
        A write that failed on any rank raises CheckpointError on every rank and commits nothing."""
        p, self.pending = self.pending, None
        if p is None:
            return None
        p.thread.join()
        failed = self._failed_ranks(c, bool(p.error))
        if p.error and io.disk_full(p.error[0], p.save_dir):  # the partial directory removed, one line
            with io.removed_if_write_fails(p.save_dir, os.path.join(p.save_dir, io.iter_dir_name(p.iteration))):
                raise p.error[0]
        if failed:
            why = f" ({type(p.error[0]).__name__}: {' '.join(str(p.error[0]).split())[:300]}" \
                  f"{io.size_limit_hint(p.error[0])})" if p.error else ""
            raise CheckpointError(f"{p.save_dir}: the background save of iteration {p.iteration} failed on rank "
                                  f"{failed[0]}{why}; nothing was committed, 'latest' names the previous checkpoint")
        dist.commit(c, p.save_dir, p.iteration, p.meta, barrier=barrier, keep_last_n=p.keep_last_n,
                    retain_interval=p.retain_interval)
        path = os.path.join(p.save_dir, io.iter_dir_name(p.iteration))
        if c.groups.rank == 0:
            log.info("saved checkpoint %s (torch_dist, written in the background)", path)
        return path

    def _failed_ranks(self, c, failed: bool) -> list[int]:
        """World ranks whose write failed (one all-reduce of a flag per rank, on the device)."""
        if not self.coll.is_initialized():
            return [0] if failed else []
        flags = torch.zeros(c.groups.world_size, device=c.backend.current_device())
        flags[c.groups.rank] = float(failed)
        self.coll.all_reduce(flags)
        return [r for r, f in enumerate(flags.tolist()) if f]
