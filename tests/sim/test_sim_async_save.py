"""--async-save's writer group on the sim device: the background thread's collectives (DCP's planning and
result exchange: object collectives and a barrier) run while the main thread trains, so they must not
share the device's communicator, where NCCL runs one collective at a time and ranks may interleave the two
threads differently. With the writer group on the device (simccl) sim reports the race; with the host
(gloo) group :class:`~omnitron.core.checkpoint.dist_async.AsyncSaver` makes, it runs silently."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim

pytestmark = [requires_sim(), pytest.mark.multiprocess]
ENV = {"OMNITRON_SIM_DEADLOCK_S": "3", "OMNITRON_STRICT_COLLECTIVES": "0"}


def save_while_training(device_group: bool, out: str = "") -> str:
    """The writer thread's DCP-like collectives beside the main thread's all-reduces; '' or the first error
    (also written to ``out``/rank<N>.txt: a rank whose peer is left waiting may not get to return it)."""
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.checkpoint.dist_async import AsyncSaver

    be = get_backend()
    saver = AsyncSaver(be.collectives)
    if device_group:
        saver.group = be.collectives.new_group([0, 1])  # what the writer group was before it became a host group
    saver._writer_group(SimpleNamespace(groups=SimpleNamespace(world_size=2)))
    errors, done = [], threading.Event()
    device = be.current_device()

    def writer():
        be.set_device(device.index)
        try:
            for i in range(20):
                out = [None, None]
                dist.all_gather_object(out, {"plan": i}, group=saver.group)
                dist.barrier(group=saver.group)
        except RuntimeError as err:
            errors.append(str(err))
        finally:
            done.set()

    thread = threading.Thread(target=writer, name="omnitron-async-save-1", daemon=True)
    thread.start()
    flag = torch.zeros(1024, device=device)  # a step's all-reduce, which also says whether a writer is done
    try:
        while True:
            flag.fill_(float(done.is_set()))
            be.collectives.all_reduce(flag)
            if flag[0].item() > 0:  # every rank leaves at the same step
                break
    except RuntimeError as err:
        errors.append(str(err))
    if out and errors:
        with open(f"{out}/rank{dist.get_rank()}.txt", "w") as f:
            f.write(errors[0])
    thread.join(timeout=4.0)
    if errors:  # a stuck communicator: run_distributed's closing barrier waits on the store, not on the device,
        # and the process ends once the result is written, or 1 s after returning (a peer left in a gloo collective
        # is freed only by this process's end; the test reads the files, not the results)
        from omnitron.testing.distributed import device_wedged

        device_wedged()
        timer = threading.Timer(1.0, __import__("os")._exit, (0,))
        timer.daemon = True
        timer.start()
    return errors[0] if errors else ""


def test_async_save_writer_group_is_safe_beside_training():
    assert run_distributed(save_while_training, 2, False, backend="sim", env=ENV, timeout_s=90) == ["", ""]


def test_writer_group_on_the_device_is_reported(tmp_path):
    """The same run with the writer group on the device communicator (the old design) is caught. The rank that
    catches it stops issuing, so its peer may be left in a collective (as on NCCL, until a watchdog): the run
    itself may fail; what each rank caught is read from its file."""
    try:
        run_distributed(save_while_training, 2, True, str(tmp_path), backend="sim", env=ENV, timeout_s=40)
    except RuntimeError:
        pass
    messages = [p.read_text() for p in sorted(tmp_path.glob("rank*.txt"))]
    assert any("two threads at once" in m or "collective deadlock" in m for m in messages), messages
    assert any("omnitron-async-save-1" in m and "MainThread" in m for m in messages), messages


def writer_barrier_in_strict_mode() -> list[str]:
    """The writer thread's strict-mode barrier and object gather on the host group (what ``--async-save``'s
    thread issues first), beside nothing; returns the engine's flight-record lines for them."""
    from omnitron.backends import get_backend
    from omnitron.backends.collectives import flight_recorder_dump

    coll = get_backend().collectives
    group = coll.new_host_group([0, 1])
    errors: list[BaseException] = []

    def writer():
        try:
            coll.barrier(group)
            coll.gather_object({"plan": 1}, dst=0, group=group)
        except BaseException as err:  # noqa: BLE001 - re-raised on the main thread
            errors.append(err)

    thread = threading.Thread(target=writer, name="omnitron-async-save-1")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return [line for line in flight_recorder_dump() if line.startswith("#")]


def test_writer_barrier_on_the_host_group_is_checked_in_strict_mode():
    """Strict mode exchanges a host group's fingerprints on the host: the exchange was made on the device,
    which gloo does not take ("No backend type associated with device type sim": every --async-save on sim,
    or any device gloo does not take, failed in strict mode)."""
    for lines in run_distributed(writer_barrier_in_strict_mode, 2, backend="sim",
                                 env={**ENV, "OMNITRON_STRICT_COLLECTIVES": "1"}, timeout_s=90):
        ops = [line.split()[2] for line in lines]
        assert ops[-2:] == ["barrier", "gather_object"], lines
