"""The fit check weighs what one host (cpu, sim: the device's memory is the host's RAM) or one device must hold for
all the ranks placed on it, and a refusal is said once a host.

Before, under torchrun with N ranks on one host each rank weighed its own state against the host's whole RAM: N ranks
of 6 GiB each passed on a 16 GiB host, and a refusal came as N identical lines. The references: the rank grid's own
pipeline groups (:func:`omnitron.core.parallel.grid.rank_grid`) for which stage each rank holds, summed by hand over
the ranks a host or device holds; the bytes of one rank come from the count ``test_model_fits`` checks.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import random
import signal
import subprocess
import sys
import types

import pytest

from omnitron.commands import fits
from omnitron.core.config.parallel import ConfigError, ParallelConfig
from omnitron.core.parallel.grid import rank_grid
from omnitron.core.training.arguments import parse_settings
from omnitron.testing.ports import free_port
from tests.training.test_model_fits import _argv, _hand_bytes


class _Device:
    """A backend as the check sees it: a name, its devices, and its capabilities' total and kind of memory."""

    name = "test"

    def __init__(self, total: int, host_memory: bool, devices: int = 1, per_process: bool = False) -> None:
        self.caps = types.SimpleNamespace(memory_total=total, host_memory=host_memory)
        self.devices, self.per_process = devices, per_process

    def capabilities(self):
        return self.caps

    def device_count(self) -> int:
        return self.devices

    def visibility_may_be_per_process(self) -> bool:
        return self.per_process


def _reference_peak(pp: int, world: int, local: int, devices: int, needs: list[int]) -> int:
    """The most one device holds: each rank's stage from the grid's pipeline groups (a group's i-th rank is on stage
    i), ranks ``local`` to a host in order, local rank ``l`` on device ``l % devices``."""
    cfg = ParallelConfig(pipeline_model_parallel_size=pp)
    stage = {rank: i for group in rank_grid(cfg, world)["pp"] for i, rank in enumerate(group)}
    held: dict[tuple[int, int], int] = {}
    for rank in range(world):
        where = (rank // local, (rank % local) % devices)
        held[where] = held.get(where, 0) + needs[stage[rank]]
    return max(held.values())


def test_shared_peak_is_the_grid_sum_over_a_hosts_ranks():
    """Fresh random layouts (pp, dp, ranks a host, devices a host) and stage sizes: the check's peak is the
    reference's, and the ranks it counts hold exactly that."""
    rng = random.Random()
    for _ in range(50):
        pp, dp = rng.randint(1, 4), rng.randint(1, 4)
        world = pp * dp
        local = rng.choice([d for d in range(1, world + 1) if world % d == 0])
        devices = rng.randint(1, local)
        needs = [rng.randint(1, 10**9) for _ in range(pp)]
        settings = types.SimpleNamespace(world_size=world)
        need, ranks = fits.shared_peak(settings, needs, local, devices)
        assert need == _reference_peak(pp, world, local, devices, needs), (pp, dp, local, devices, needs)
        assert 1 <= ranks <= -(-local // devices)


@pytest.mark.parametrize("local", [2, 3])
def test_ranks_sharing_host_memory_are_weighed_together(local, monkeypatch):
    """torchrun with ``local`` ranks on one host (data parallel, each holding the whole fp32 state: 16 bytes a
    parameter, hand-derived, plus the gradient buffer's padding to a multiple of the data-parallel size, which the
    count includes: ``test_model_fits`` checks it against the live tensors): host memory one byte short of their sum
    is refused naming the ranks and --nproc-per-node (each rank's own share, one local-th of it, fit); their sum
    exactly fits; an accelerator with a device a rank is not refused at the same size."""
    rng = random.Random()
    h, layers, vocab = 4 * rng.randint(2, 16), rng.randint(1, 3), rng.randint(2, 300)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    settings = parse_settings(_argv(h, layers, vocab) + ["--global-batch-size", str(local)], local)
    one = fits.state_peak(settings)[0]
    # each gradient bucket is padded to a multiple of dp (< dp fp32 elements); at most one bucket a parameter
    # tensor (12 a GPT-2 layer, 4 outside: word and position embeddings, the final norm's two)
    assert 0 <= one - _hand_bytes(h, layers, vocab, 16) < 4 * local * (4 + 12 * layers)
    with pytest.raises(fits.DoesNotFit, match=rf"^the model does not fit: the {local} ranks on one host .*"
                       r"--nproc-per-node") as err:
        fits.check_fits(settings, _Device(local * one - 1, host_memory=True))
    assert isinstance(err.value, ConfigError) and len(str(err.value).splitlines()) == 1
    fits.check_fits(settings, _Device(local * one, host_memory=True))
    fits.check_fits(settings, _Device(one, host_memory=False, devices=local))
    with pytest.raises(fits.DoesNotFit, match=r"the 2 ranks on one device hold together"):
        fits.check_fits(settings, _Device(2 * one - 1, host_memory=False, devices=local - 1))


@pytest.mark.parametrize("local", [2, 8])
def test_a_rank_that_sees_only_its_own_device_is_weighed_alone(local, monkeypatch):
    """``srun --gpus-per-task=1`` with RANK / LOCAL_RANK / LOCAL_WORLD_SIZE exported: each of the host's ``local``
    ranks sees one device, its own. A device that holds one rank's state (hand-derived, 16 bytes a parameter, plus
    the buckets' padding) fits; it used to be refused as the ``local`` ranks' sum. The same single visible device
    with no per-process mask (the host has one device, every rank on it) is still refused one byte short of the
    ranks' sum; one byte short of one rank's state is refused either way."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    settings = parse_settings(_argv(16, 1, 64) + ["--global-batch-size", str(local)], local)
    one = fits.state_peak(settings)[0]
    assert 0 <= one - _hand_bytes(16, 1, 64, 16) < 4 * local * (4 + 12)  # the padding bound of the test above
    fits.check_fits(settings, _Device(one, host_memory=False, devices=1, per_process=True))
    with pytest.raises(fits.DoesNotFit, match="each rank holds"):
        fits.check_fits(settings, _Device(one - 1, host_memory=False, devices=1, per_process=True))
    with pytest.raises(fits.DoesNotFit, match=rf"the {local} ranks on one device hold together"):
        fits.check_fits(settings, _Device(local * one - 1, host_memory=False, devices=1, per_process=False))


def test_the_launchers_ranks_count_too(monkeypatch):
    """``--nproc-per-node N`` (no torchrun): the launcher's check counts its N workers on the host."""
    monkeypatch.delenv("RANK", raising=False)
    settings = parse_settings(_argv(16, 1, 64) + ["--nproc-per-node", "2", "--global-batch-size", "2"], 2)
    one = _hand_bytes(16, 1, 64, 16)
    with pytest.raises(fits.DoesNotFit, match="the 2 ranks on one host"):
        fits.check_fits(settings, _Device(2 * one - 1, host_memory=True))


@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_a_refusal_is_said_by_local_rank_0_only(local_rank, monkeypatch, capsys, tmp_path):
    """Every rank refuses with exit code 2 (none waits for another); only local rank 0 prints the line, and each
    writes it into torchrun's error file."""
    import omnitron.backends.cpu.backend as cpu
    from omnitron.commands.train import main_from_dict
    from omnitron.core.training import launch

    def no_launch(*a, **k):
        raise AssertionError("launched a run that cannot fit")

    monkeypatch.setattr(launch, "launch", no_launch)
    monkeypatch.setattr(fits, "SAID_WAIT_S", 0.1)  # no local rank 0 here to wait for
    argv = {"num_layers": 1, "hidden_size": 16, "num_attention_heads": 4, "seq_length": 16,
            "max_position_embeddings": 16, "micro_batch_size": 1, "global_batch_size": 2, "train_iters": 2,
            "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 64, "backend": "cpu"}
    one = _hand_bytes(16, 1, 64, 16)
    real = cpu.CPUBackend.capabilities
    monkeypatch.setattr(cpu.CPUBackend, "capabilities",
                        lambda self: dataclasses.replace(real(self), memory_total=2 * one - 1))
    for k, v in dict(RANK=local_rank, LOCAL_RANK=local_rank, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                     TORCHELASTIC_ERROR_FILE=str(tmp_path / "error.json")).items():
        monkeypatch.setenv(k, v)
    assert main_from_dict(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ([] if local_rank == "1" else [err[0]]), err
    assert "the 2 ranks on one host" in (tmp_path / "error.json").read_text()
    if local_rank == "0":
        assert err[0].startswith("omnitron train: error: the model does not fit: the 2 ranks on one host"), err


_RANK = """
import dataclasses, sys, time
import omnitron.backends.cpu.backend as cpu
from omnitron.commands.train import main_from_dict
real = cpu.CPUBackend.capabilities
cpu.CPUBackend.capabilities = lambda self: dataclasses.replace(real(self), memory_total=1)
time.sleep(float(sys.argv[1]))
sys.exit(main_from_dict({"num_layers": 1, "hidden_size": 16, "num_attention_heads": 4, "seq_length": 16,
    "max_position_embeddings": 16, "micro_batch_size": 1, "global_batch_size": 2, "train_iters": 2,
    "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 64, "backend": "cpu"}))
"""


def test_the_line_is_said_when_local_rank_0_is_slow(tmp_path):
    """An agent as torchrun's: two local ranks, children of one process, the first to exit makes it SIGTERM the
    other. Local rank 0 reaches the check 3 s after local rank 1 (slow imports); the host's stderr still has the
    refusal's one line (before, local rank 1 exited at once and local rank 0 died of the SIGTERM, silent)."""
    import time

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
               RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_PORT=str(free_port()),
               TMPDIR=str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    for k in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE"):
        env.pop(k, None)
    ranks = []
    for local, delay in (("0", "3"), ("1", "0")):
        err = open(tmp_path / f"err{local}", "w")
        ranks.append(subprocess.Popen([sys.executable, "-c", _RANK, delay], stderr=err, text=True,
                                      env=dict(env, RANK=local, LOCAL_RANK=local)))
    deadline = time.monotonic() + 120
    while all(p.poll() is None for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in ranks:  # the agent's reaction to the first exit
        if p.poll() is None:
            p.terminate()
    codes = [p.wait(timeout=60) for p in ranks]
    said = [line for local in "01" for line in (tmp_path / f"err{local}").read_text().splitlines()
            if "the model does not fit" in line]
    # both leave once local rank 1 has seen the line out (the marker gone); the later one may then still be in its
    # interpreter's teardown when the agent's SIGTERM comes (-15), as under torchrun: the line is said either way
    assert len(said) == 1 and set(codes) <= {2, -signal.SIGTERM} and 2 in codes, (codes, said)
    assert list((tmp_path / "tmp").glob("omnitron-unfit*")) == []  # the marker went with them


@pytest.mark.parametrize("name", ["cpu", "sim"])
def test_host_memory_backends_say_so(name):
    """cpu and sim keep tensors in the host's RAM: their capabilities say so, which is what makes the check sum a
    host's ranks (a vendor accelerator leaves the default, False). A fresh process: sim takes the PrivateUse1 device,
    which another test of this session may have given to a test double."""
    from omnitron.backends.base import Capabilities

    code = ("from omnitron.backends.registry import get_backend; "
            f"print(get_backend({name!r}).capabilities().host_memory)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.stdout.strip() == "True", out.stderr[-2000:]
    assert Capabilities.__dataclass_fields__["host_memory"].default is False


@pytest.mark.parametrize("waiters", [1, 3])
def test_the_said_marker_is_removed_by_the_last_rank_that_waits_for_it(waiters, monkeypatch, tmp_path):
    """Local rank 0 and its ``waiters`` (threads here, local rank 0 last, as when its imports are slow): each waiter
    marks the marker seen, the last removes it, and every one returns once it is gone, well within the bound (here
    60 s; a marker left behind kept them all until local rank 0 removed it then). Before, the marker stayed."""
    import threading

    monkeypatch.setattr(fits, "SAID_WAIT_S", 60.0)
    marker = tmp_path / "omnitron-unfit-said"
    ranks = [threading.Thread(target=fits._leave_together, args=(marker, waiters, r == 0), daemon=True)
             for r in range(waiters, -1, -1)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(timeout=30.0)
    assert not any(t.is_alive() for t in ranks) and list(tmp_path.iterdir()) == []


def test_the_said_marker_lives_in_torchruns_attempt_folder(monkeypatch, tmp_path):
    """Under torchrun each local rank's error file is ``<logs>/<run>/attempt_<n>/<local rank>/error.json``: the
    marker is the attempt's own file there (one job and attempt: no other job's can collide with it), the same
    for every local rank; elsewhere it is in the temporary folder."""
    import tempfile

    attempt = tmp_path / "torchelastic_x" / "run_y" / "attempt_2"
    found = set()
    for r in ("0", "1"):
        monkeypatch.setenv("LOCAL_RANK", r)
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(attempt / r / "error.json"))
        found.add(fits._said_marker())
    assert found == {attempt / "omnitron-unfit-said"}
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))  # not torchrun's layout
    assert fits._said_marker().parent == pathlib.Path(tempfile.gettempdir())


def test_the_nproc_launcher_makes_no_marker(monkeypatch, tmp_path, capsys):
    """``--nproc-per-node`` checks in its launcher, before any worker starts (no ``LOCAL_RANK``): nothing waits for a
    marker, so none is made (before, one was left in the temporary folder by each refused launch)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(k, raising=False)
    assert fits.refuse_once_a_host(fits.DoesNotFit("the model does not fit: test")) == 2
    assert list(tmp_path.iterdir()) == []
