"""SIGTERM: the run finishes its step, saves a checkpoint and exits 0; --load resumes from it. Also sent to the
process group of a multi-process job, and delivered more than once."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest


def test_sigterm_saves_and_exits_cleanly(tmp_path):
    save = str(tmp_path / "ck")
    cmd = [sys.executable, "-m", "omnitron", "train", "--num-layers", "2", "--hidden-size", "32",
           "--num-attention-heads", "2", "--seq-length", "16", "--max-position-embeddings", "16", "--mock-data",
           "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-workers", "0", "--train-iters", "100000",
           "--log-interval", "1", "--save", save, "--no-tensorboard", "--data-cache-path", str(tmp_path / "cache")]
    env = dict(os.environ, OMNITRON_KERNELS="reference")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    metrics = os.path.join(save, "metrics.jsonl")
    deadline = time.time() + 120
    while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() is not None else ""
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    last = [json.loads(line) for line in open(metrics)][-1]["iteration"]
    assert open(os.path.join(save, "latest")).read() == f"iter_{last:07d}", out
    assert "stopping after iteration" in out


@pytest.mark.parametrize("sig, times, group", [(signal.SIGTERM, 1, True), (signal.SIGINT, 2, True),
                                               (signal.SIGINT, 1, False)],
                         ids=["SIGTERM", "SIGINT-twice", "SIGINT-launcher-only"])
def test_signal_to_the_process_group_saves(tmp_path, sig, times, group):
    """A signal to the job's whole process group, as SLURM's scancel and time limit, ``kill -- -PGID``, GNU
    ``timeout`` and a terminal's Ctrl-C send it, under ``--nproc-per-node 2``: every rank finishes its step,
    saves and exits 0. SIGINT is sent twice a few ms apart, as a Ctrl-C under a relaying wrapper (``timeout``)
    arrives (SIGTERM may reach a rank twice too: the group's, and the launcher's relay). Fails without the
    fixes: SIGTERM, the fork server died of it and took its ranks (``worker exit codes [255, 255]``); SIGINT
    twice, the repeat was taken for a second signal ("stopping without saving"). SIGINT to the launcher alone (a
    scheduler signalling the main process) is relayed: before, the launcher ignored it and the job ran on."""
    from omnitron.testing.faults import children, records, tiny_train_args, wait_for_iteration, wait_gone

    save = str(tmp_path / "ck")
    args = tiny_train_args(tmp_path, "--train-iters", "100000", "--nproc-per-node", "2",
                           "--tensor-model-parallel-size", "2", "--save", save, "--save-interval", "100000")
    env = dict(os.environ, OMNITRON_KERNELS="reference")
    proc = subprocess.Popen([sys.executable, "-m", "omnitron", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        metrics = str(tmp_path / "logs" / "metrics.jsonl")
        wait_for_iteration(metrics, 2, proc)
        workers = children(proc.pid)
        assert len(workers) == 2
        for _ in range(times):
            os.killpg(proc.pid, sig) if group else os.kill(proc.pid, sig)
            time.sleep(0.005)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out
    last = records(metrics)[-1]["iteration"]
    assert open(os.path.join(save, "latest")).read() == f"iter_{last:07d}", out
    assert f"stopping after iteration {last} (checkpoint saved at {last})" in out, out
    wait_gone(workers, 10)


def test_a_repeat_within_the_window_is_the_same_request():
    """StopFlag: a stop signal within REPEAT_WINDOW_S of the one that took effect (SIGINT or SIGTERM, relayed or
    sent to the group) only asks again to stop after the step; one after the window interrupts at once, and
    its own repeats do not interrupt the interruption again. Fails without the window: the second SIGTERM raises.
    (End to end, two copies that land before the rank's main thread runs the handler count once: this is the
    deterministic check.)"""
    from omnitron.core.training.signals import REPEAT_WINDOW_S, StopFlag

    flag = StopFlag()
    try:
        for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGINT, signal.SIGINT):
            try:
                os.kill(os.getpid(), sig)
                time.sleep(0.01)  # the handler runs in the main thread, between bytecodes; one by one
            except KeyboardInterrupt as exc:  # not pytest's own: it would end the whole session
                pytest.fail(f"a repeat within the window interrupted: {exc}")
        assert flag.requested
        flag._acted_at -= REPEAT_WINDOW_S  # a person's second Ctrl-C, after the first message
        with pytest.raises(KeyboardInterrupt, match="second signal SIGINT: stopping without saving"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)  # that one's relay
        time.sleep(0.01)
    finally:
        flag.restore()


def _fork_server_of(pid: int) -> bool:
    """Whether launcher ``pid`` has started its fork server (which then imports torch, for seconds)."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if ppid == pid and b"multiprocessing.forkserver" in f.read():
                    return True
        except (OSError, ValueError, IndexError):
            continue
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the fork server in /proc")
def test_sigterm_while_the_launcher_starts_its_ranks_stops_the_job(tmp_path):
    """SIGTERM to the launcher while its fork server starts (seconds, before any rank exists), as a preemption
    early in a job: the launcher hands the signal to each rank as it starts, the ranks' stop flag (installed
    at their start) holds it, and the job stops before its first iteration, exit 0, in one line. Fails without
    the fix: the relay found no rank to signal and dropped it, and the job trained on to --train-iters."""
    from omnitron.testing.faults import records, signal_when_ready, tiny_train_args

    args = tiny_train_args(tmp_path, "--train-iters", "40", "--nproc-per-node", "2", "--save", str(tmp_path / "ck"))
    _, returncode, out = signal_when_ready(args, _fork_server_of, "no fork server", wait_s=120, poll_s=0.01)
    assert returncode == 0, out
    assert "stopping before iteration 1: a stop signal arrived during start-up" in out, out
    assert records(str(tmp_path / "logs" / "metrics.jsonl")) == [], out
    assert not os.path.exists(tmp_path / "ck" / "latest"), out


def test_a_second_signal_ends_the_rank_in_one_line(capfd, monkeypatch):
    """A second stop signal (after the repeat window) ends the rank at once: one line naming it and exit code 1,
    no traceback (the launcher's summary repeats that line). Fails without the fix: the KeyboardInterrupt left
    the rank with a traceback from wherever it landed (two screens for a 2-rank job)."""
    from types import SimpleNamespace

    from omnitron.core.training.launch import _run_rank
    from omnitron.core.training.signals import REPEAT_WINDOW_S, StopFlag

    def entry(settings, backend, watchdog=None):
        flag = StopFlag()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
            flag._acted_at -= REPEAT_WINDOW_S  # the second comes after the window
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
        finally:
            flag.restore()
        pytest.fail("the second signal did not interrupt")

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("OMNITRON_FAILURE_DIR", raising=False)
    try:
        code = _run_rank(SimpleNamespace(backend="cpu"), entry)
    except KeyboardInterrupt as exc:  # not pytest's own: it would end the whole session
        pytest.fail(f"the second signal left the rank as a KeyboardInterrupt: {exc}")
    assert code == 1
    err = capfd.readouterr().err
    assert "error: second signal SIGTERM: stopping without saving" in err, err
    assert "Traceback" not in err, err



def _descendants(pid: int) -> list[int]:
    """``pid`` and every process under it (from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += [c for c, parent in parents.items() if parent == p]
    return found


def _signal_every_process(tmp_path, sig: signal.Signals, *extra: str) -> tuple[str, list[int]]:
    """Start a tiny job (``extra`` flags), send ``sig`` to every process of it at iteration 3 as SLURM does, check
    that it finished its step, saved and exited 0; its output and the processes signalled."""
    from omnitron.testing.faults import records, start, tiny_train_args, wait_for_iteration

    save = str(tmp_path / "ck")
    proc = start(tiny_train_args(tmp_path, "--train-iters", "100000", "--save", save, *extra))
    try:
        metrics = str(tmp_path / "logs" / "metrics.jsonl")
        wait_for_iteration(metrics, 3, proc)
        everyone = _descendants(proc.pid)
        for pid in everyone:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    last = records(metrics)[-1]["iteration"]
    assert open(os.path.join(save, "latest")).read() == f"iter_{last:07d}", out
    return out, everyone


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="lists the job's processes in /proc")
def test_sigterm_to_every_process_of_the_job_saves_with_loader_workers(tmp_path):
    """SLURM's scancel and time limit signal every process of the job by pid, the data-loader workers too (out of
    the ranks' process group: omnitron.core.lifetime.tie_worker). With --num-workers 2 the run still finishes its
    step, saves and exits 0, and no worker is left. Fails without the fix: a worker died of the SIGTERM and the
    rank failed with "DataLoader worker ... killed by signal: Terminated", exit 1, no checkpoint."""
    from omnitron.testing.faults import alive, wait_gone

    _, everyone = _signal_every_process(tmp_path, signal.SIGTERM, "--num-workers", "2")
    assert len(everyone) >= 3, everyone  # the rank and its two workers
    wait_gone([p for p in everyone if alive(p)], 10)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="lists the job's processes in /proc")
@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGUSR2"])
def test_exit_signal_saves_when_sent_to_every_process(tmp_path, sig):
    """--exit-signal SIGUSR1 / SIGUSR2 (Megatron's flag; SLURM's --signal=USR1@SECONDS warns before the time limit
    so): sent to every process of a 2-rank job with a loader worker each (the launcher, its fork server and
    resource tracker, the ranks, their workers), the run finishes its step, saves and exits 0. Fails without the
    flag: argparse refuses it; and the signal killed every process (exit -10), nothing saved."""
    out, _ = _signal_every_process(tmp_path, getattr(signal, sig), "--nproc-per-node", "2", "--num-workers", "1",
                                   "--exit-signal", sig)
    assert f"{sig} received: stopping after this iteration" in out, out
