"""Run a function on N local gloo processes and collect each rank's return value.

Used by the multi-process tests and the backend conformance suite. Each worker gets one
thread (processes x threads must not exceed the cores), a fresh port, and the rank's
exceptions are re-raised in the parent with the worker's traceback. The parent hosts the rendezvous store
on a port the OS gave it, so two runs side by side (pytest-xdist) never race for a port. Workers inherit
``OMNITRON_STRICT_COLLECTIVES`` (tests/conftest.py turns it on for the whole suite), and every
rank ends with a (checked) barrier so a rank that skipped a collective is named.
"""
from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from omnitron.core.training.workers import client_store, host_store


REFERENCE_KERNELS = {"OMNITRON_KERNELS": "reference"}
"""``env`` for :func:`run_distributed`: every fused op on its plain-PyTorch reference, so a float64
layout-parity run is a statement about the parallel maths alone (no CPU-specific rounding)."""




def _to_host(value):
    """``value`` with every tensor in it (through dicts, lists, tuples) on the host: the parent may not have
    the workers' device (a GPU, or the sim device it never loaded), and tests compare with host references."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return type(value)((k, _to_host(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_to_host(v) for v in value)
    return value


_WEDGED = False


def device_wedged() -> None:
    """Called by a worker whose device holds a collective that will never complete (a planted deadlock, as a
    stuck NCCL communicator): its closing barrier waits on the rendezvous store instead, since under NCCL's
    semantics (which sim follows: one communicator kernel a device at a time) a collective barrier would queue
    behind the stuck collective. Every rank of such a case must call it (each waits for all); the worker then
    ends its process as soon as its result is written (tearing the stuck group down could wait for gloo's own
    timeout)."""
    global _WEDGED
    _WEDGED = True


def _store_barrier(world: int, timeout_s: float = 60.0) -> None:
    """Wait on the rendezvous store (host TCP, no communicator) until every rank has arrived: a wedged rank
    keeps its process, and so its side of the stuck communicator, until its peers have reported theirs."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    store.add("omnitron_closing", 1)
    deadline = time.monotonic() + timeout_s
    while store.add("omnitron_closing", 0) < world and time.monotonic() < deadline:
        time.sleep(0.05)


def _report(outdir: str, rank: int, result: dict) -> None:
    """Write this rank's result for the parent (complete or absent: written aside, then renamed)."""
    path = os.path.join(outdir, f"rank{rank}.pkl")
    with open(path + ".part", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".part", path)


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, outdir: str, backend: str,
            threads: int, env: dict[str, str]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.clear()  # the parent's environment now, not the fork server's from when it started
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMNITRON_BACKEND=backend)
    result: dict[str, Any]
    try:
        from omnitron.backends import get_backend

        be = get_backend(backend)
        be.collectives.init_process_group(rank=rank, world_size=world, timeout_s=180,
                                          store=client_store(port, world, 180.0))
        value = _to_host(fn(*args))
        result = {"ok": True, "value": value, "device_peak": be.memory_stats().get("peak_allocated")}
        if _WEDGED:  # reported before waiting for the peers: a test's exit timer may end this process meanwhile
            _report(outdir, rank, result)
            _store_barrier(world)
            os._exit(0)  # every rank has reported: tearing the stuck group down would wait on it
        be.collectives.barrier()  # checked in strict mode: a rank that skipped a collective fails here, named
    except BaseException as err:  # noqa: BLE001 - report everything to the parent
        result = {"ok": False, "error": f"rank {rank}: {type(err).__name__}: {err}\n{traceback.format_exc()}"}
    _report(outdir, rank, result)
    if _WEDGED:  # every rank has reported (the store barrier): tearing the stuck group down would wait on it
        os._exit(0)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def _context():
    """Workers fork from a server that has imported torch once (2 s of CPU a process otherwise, about a
    third of the suite's time on 2 cores), and the distributed checkpoint and FSDP2 modules (DTensor, 0.8 s
    more) that the checkpoint tests' workers use; the server forks before any thread pool exists. Only
    torch's own modules: omnitron's read the environment a worker sets after the fork."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp"])
    return ctx


def _forked(fn: Callable, args: tuple, env: dict[str, str], threads: int, outdir: str) -> None:
    import torch

    torch.set_num_threads(threads)
    os.environ.clear()  # the caller's environment, not the fork server's from when it started
    os.environ.update(env)
    try:
        fn(*args)
    except BaseException:  # noqa: BLE001 - the caller raises it, with this traceback
        with open(os.path.join(outdir, "error.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def run_forked(fn: Callable, *args, env: dict[str, str] | None = None, timeout_s: float = 300.0) -> int:
    """Call ``fn(*args)`` in one process forked from the fork server (torch already imported: a fresh interpreter
    spends ~3 s of CPU importing the training stack) and return its exit code, negative for the signal that
    ended it: for a test whose child must die (a planted SIGKILL). ``fn`` must be importable (module level); the
    child has this process's environment with ``env`` over it, and its torch threads. An exception in ``fn``
    is raised here with the child's traceback; a child still running after ``timeout_s`` is killed and reported."""
    import torch

    with tempfile.TemporaryDirectory() as outdir:
        proc = _context().Process(target=_forked, args=(fn, args, {**os.environ, **(env or {})},
                                                         torch.get_num_threads(), outdir))
        proc.start()
        proc.join(timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise RuntimeError(f"{getattr(fn, '__name__', fn)}: still running after {timeout_s:g} s (killed)")
        error = os.path.join(outdir, "error.txt")
        if os.path.exists(error):
            with open(error) as f:
                raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed in its process:\n{f.read()}")
        return proc.exitcode


def _staged_if_ranks_share_a_device(backend: str, world_size: int, env: dict[str, str] | None):
    """``env`` with ``OMNITRON_COLLECTIVES=host-staged`` when ``world_size`` ranks would share fewer devices of
    a backend whose collective library refuses that (NCCL: "duplicate GPU"), as on a one-GPU machine: the
    engine's collectives then run over gloo on host copies of the device tensors (omnitron/backends/staged.py),
    everything else on the device. gloo backends and sim (its communicators model several ranks per
    device) are left alone, as is an explicit choice in ``env`` or the environment."""
    from omnitron.backends.staged import ENV_VAR

    if world_size < 2 or backend in ("cpu", "sim") or ENV_VAR in (env or {}) or ENV_VAR in os.environ:
        return env
    from omnitron.backends import BackendUnavailableError, get_backend

    try:
        be = get_backend(backend)
    except BackendUnavailableError:  # e.g. a plug-in only the workers register: they report it themselves
        return env
    if be.dist_backend == "gloo" or not 0 < be.device_count() < world_size:
        return env
    return {**(env or {}), ENV_VAR: "host-staged"}


def run_distributed(fn: Callable, world_size: int, *args, backend: str | None = None, threads: int = 1,
                    timeout_s: float = 300.0, env: dict[str, str] | None = None) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` processes with the default process group initialised.

    ``fn`` must be importable (module level). ``env`` is set in each worker before anything is
    imported there (e.g. ``REFERENCE_KERNELS``). Returns the per-rank results, ordered by rank. ``timeout_s``
    bounds the whole run: ranks still running then are killed and reported hung.
    """
    backend = backend or os.environ.get("OMNITRON_BACKEND", "cpu")
    env = _staged_if_ranks_share_a_device(backend, world_size, env)
    store = host_store(world_size, timeout_s)
    port = store.port
    with tempfile.TemporaryDirectory() as outdir:
        ctx = _context()
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, outdir, backend, threads,
                                                   {**os.environ, **(env or {})}))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s  # one for the run: a hung rank is not waited for once per rank
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        results, errors = [], []
        for r in range(world_size):
            path = os.path.join(outdir, f"rank{r}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode}{', hung' if r in hung else ''})")
                results.append(None)
                continue
            with open(path, "rb") as f:
                res = pickle.load(f)
            if res["ok"]:
                results.append(res["value"])
                if backend == "sim" and not res.get("device_peak"):
                    import warnings
                    warnings.warn(f"{getattr(fn, '__name__', fn)}: rank {r} ran on sim but allocated nothing there")
            else:
                errors.append(res["error"])
                results.append(None)
        if errors:
            raise RuntimeError("distributed run failed:\n" + "\n".join(errors))
        return results
