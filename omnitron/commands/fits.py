"""Refuse a model that cannot fit before anything is allocated: the parameters, gradients and optimizer state of the
ranks that share one device's memory (one rank a GPU; every rank of a host on cpu / sim) against its whole memory.

An absurd size (``--hidden-size 1000000``) used to die in the allocator during the model build, a raw traceback
from every rank. The bytes come from the planner's exact count on a meta-device skeleton
(:func:`omnitron.plan.state.state_bytes`: the run's own chunks, gradient buffers and optimizer state, no storage).
They are a lower bound of what the rank holds (activations, communication buffers and the allocator's slack come
on top), and the device's total memory an upper bound of what it can hold, so only a run that cannot fit is
refused; a run near the limit is left to train (and to the memory planner, ``omnitron plan``).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import time

from omnitron.core.config.parallel import ConfigError

log = logging.getLogger(__name__)

SAID_WAIT_S = 10.0
"""How long a quiet local rank waits for its local rank 0 to print the refusal before it exits (its exit makes
torchrun SIGTERM the host's other ranks; a local rank 0 still importing then died before it said anything)."""


def stage_needs(settings) -> list[int]:
    """Parameter + gradient + optimizer-state bytes of one rank of each pipeline stage (tp / dp / cp ranks of a
    stage hold the same up to the distributed optimizer's slices; the largest slice is counted)."""
    from omnitron.plan.memory import model_config
    from omnitron.plan.state import state_bytes

    cfg = model_config(settings)
    needs = []
    for r in range(settings.parallel.pipeline_model_parallel_size):
        st = state_bytes(settings, cfg, r)
        needs.append(st.params + st.grads + st.optimizer)
    return needs


def state_peak(settings) -> tuple[int, int]:
    """``(bytes, pipeline stage)``: the largest of :func:`stage_needs`, over the stages."""
    return max((n, r) for r, n in enumerate(stage_needs(settings)))


class DoesNotFit(ConfigError):
    """The run's state cannot fit: the same verdict on every rank of the job (its local rank 0 says it)."""


def local_world(settings) -> int:
    """Ranks on one host: torchrun's ``LOCAL_WORLD_SIZE`` for a torchrun rank, else ``--nproc-per-node``."""
    if "RANK" in os.environ:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return settings.nproc_per_node


def shared_peak(settings, needs: list[int], local: int, devices: int) -> tuple[int, int]:
    """``(bytes, ranks)``: the most one device must hold, and how many ranks hold it, over the job's hosts.

    Ranks are placed as torchrun places them: ``local`` consecutive world ranks a host (every host alike), local
    rank ``l`` on device ``l % devices`` of its host (``devices`` 1: the host's RAM, shared by all); world rank
    ``r`` is on pipeline stage ``r // (world / pp)`` (pp is the grid's slowest dimension,
    :mod:`omnitron.core.parallel.grid`)."""
    world, pp = settings.world_size, len(needs)
    per_stage = max(1, world // pp)
    best = (0, 0)
    for first in range(0, world, local):
        held = {}
        for rank in range(first, min(world, first + local)):
            d = (rank - first) % devices
            n, k = held.get(d, (0, 0))
            held[d] = (n + needs[min(pp - 1, rank // per_stage)], k + 1)
        best = max(best, *held.values())
    return best


def check_fits(settings, backend) -> None:
    """DoesNotFit (a ConfigError) when the parameters, gradients and optimizer state of the ranks that share one
    device's memory exceed its total (``capabilities().memory_total``, the fact the launcher already asked for: no
    device memory is touched; no check where the device cannot say, nor for a model family the count cannot
    build on the meta device: the run then meets its limits as before, and the reason is logged as a warning).

    Who shares: on a device whose memory is the host's (``capabilities().host_memory``: cpu, sim) every rank of
    the host, :func:`local_world` of them (four torchrun ranks of 6 GiB each on a 16 GiB host used to pass, each
    rank weighing its own 6 GiB against the host's 16); on an accelerator, the ranks placed on one device (one
    each where there are devices enough, or where each process may see only its own: :func:`_devices_shared`).

    Every rank counts (under torchrun too: a rank that skipped it would wait in the process group's start for
    a refused local rank 0, and ignore torchrun's first SIGTERM there: 30 s, then SIGKILL); the count takes well
    under a second for a 70B model (the meta build skips weight initialisation), and every rank reaches the same
    verdict (the job's worst device)."""
    caps = backend.capabilities()
    total = caps.memory_total
    if not total:
        return
    try:
        needs = stage_needs(settings)
    except Exception as err:  # noqa: BLE001  a family's own build, off the meta device: no count, no refusal
        log.warning("the model's state bytes could not be counted before the build (%s: %s); not checked against "
                    "the device's memory", type(err).__name__, err)
        return
    devices = _devices_shared(settings, backend, caps)
    # NOTE: the distributed optimizer's slices of one stage differ by a bucket's padding at most; counting the
    # largest for every rank of a host may overstate its sum by that many bytes (a run within them of the host's
    # whole memory would not train anyway: activations come on top)
    need, ranks = shared_peak(settings, needs, local_world(settings), devices)
    if need <= total:
        return
    raise DoesNotFit(f"the model does not fit: {_holders(settings, needs, need, ranks, caps)} {_size(need)} of "
                     f"parameters, gradients and optimizer state before any activation, more than the "
                     f"{backend.name} device's {_size(total)}; shrink the model (--hidden-size, --num-layers, "
                     f"--ffn-hidden-size) or spread it over more ranks (--tensor-model-parallel-size, "
                     f"--pipeline-model-parallel-size, --use-distributed-optimizer){_fewer(ranks, caps)}; "
                     f"omnitron plan prices layouts")


def _devices_shared(settings, backend, caps) -> int:
    """How many devices a host's ranks are spread over (``shared_peak``'s ``devices``): 1 where the memory is the
    host's; on an accelerator the visible devices where every local rank sees them all (enough for one each, or no
    per-process visibility mask), else one device a rank (under ``srun --gpus-per-task=1`` each of 8 local ranks
    sees one device, its own: counting the 8 on it refused a healthy start)."""
    if getattr(caps, "host_memory", False):
        return 1
    local = local_world(settings)
    devices = max(1, getattr(backend, "device_count", lambda: 1)())
    per_process = getattr(backend, "visibility_may_be_per_process", lambda: True)()
    return devices if devices >= local or not per_process else local


def _holders(settings, needs, need, ranks, caps) -> str:
    """Who holds ``need``: one rank (of which stage), or the ``ranks`` that share one host's or device's memory."""
    if ranks > 1:
        where = "one host (its RAM is the device's memory)" if getattr(caps, "host_memory", False) else "one device"
        return f"the {ranks} ranks on {where} hold together"
    if settings.parallel.pipeline_model_parallel_size > 1:
        return f"pipeline stage {needs.index(need)}'s ranks hold"
    return "each rank holds"


def _fewer(ranks: int, caps) -> str:
    if ranks < 2:
        return ""
    return ", or start fewer ranks a host (--nproc-per-node)" if getattr(caps, "host_memory", False) else \
        ", or give each rank a device of its own"


def _size(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.3f} MiB"


def refuse_once_a_host(err: DoesNotFit) -> int:
    """Exit code 2 for every rank, the line printed by local rank 0 only (every rank reaches the same verdict).

    The other local ranks wait (at most :data:`SAID_WAIT_S`) until local rank 0 has printed, marked by a file
    (:func:`_said_marker`): their exit would make torchrun SIGTERM the rest, and a local rank 0 that had not reached
    its print yet (slow imports) died without a word on the host's stderr. The marker is made only where a local
    rank waits for it; each waiter marks it seen, the last removes it (:func:`_seen`), and no rank leaves while it
    is there (the first exit makes torchrun SIGTERM the others: one not yet past its mark left the file behind).
    It used to stay in the temporary folder, one file for each refused job and attempt."""
    from omnitron.core.training.failures import refuse

    marker, waiters, first = _said_marker(), _waiters(), os.environ.get("LOCAL_RANK", "0") == "0"
    code = refuse(err, say=first)
    if waiters:
        sys.stderr.flush()
        _leave_together(marker, waiters, first)
    return code


def _leave_together(marker, waiters: int, first: bool) -> None:
    """Local rank 0 (``first``) makes ``marker`` once it has said the line; each of the ``waiters`` others waits
    for it and marks it seen; the last removes it; none leaves while it is there (bounded by SAID_WAIT_S; then
    local rank 0 removes it: a waiter that never came)."""
    deadline = time.monotonic() + SAID_WAIT_S
    if first:
        try:
            marker.touch()
        except OSError:  # an unwritable folder: the others wait out their bound
            return
    else:
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        _seen(marker, waiters)
    while marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if first:
        with contextlib.suppress(OSError):
            os.unlink(marker)


def _waiters() -> int:
    """How many local ranks wait for local rank 0's line: the host's other ranks under a launcher that starts each
    rank (torchrun: ``LOCAL_RANK`` set), none for the ``--nproc-per-node`` launcher, which checks alone."""
    if "LOCAL_RANK" not in os.environ:
        return 0
    return max(0, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1) - 1)


def _seen(marker, waiters: int) -> None:
    """Tell the marker this rank has seen it (one byte appended); the rank whose byte makes ``waiters`` removes it."""
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_APPEND)  # no O_CREAT: a marker that never came stays absent
    except OSError:
        return
    try:
        os.write(fd, b".")
        last = os.fstat(fd).st_size >= waiters
    finally:
        os.close(fd)
    if last:
        with contextlib.suppress(OSError):
            os.unlink(marker)


def _said_marker():
    """The file local rank 0 touches once it has printed the refusal (:func:`refuse_once_a_host`): in this
    attempt's folder of torchrun's logs (``<log_dir>/<run>/attempt_<n>/<local rank>/error.json`` is each rank's
    error file: one folder a job and attempt, shared by the host's ranks), else in the temporary folder, named
    after the process that started the host's ranks (the same for each local rank), the port and the attempt."""
    import pathlib

    from omnitron.core.training.prejoin import attempt

    error_file = pathlib.Path(os.environ.get("TORCHELASTIC_ERROR_FILE", "") or os.devnull)
    if error_file.parent.name == os.environ.get("LOCAL_RANK") and error_file.parent.parent.name.startswith("attempt_"):
        return error_file.parent.parent / "omnitron-unfit-said"
    name = f"omnitron-unfit-{os.getppid()}-{os.environ.get('MASTER_PORT', '')}-{attempt()}"
    return pathlib.Path(tempfile.gettempdir()) / name
