"""How ``omnitron train --nproc-per-node N`` starts its ranks: forked from a server that imported torch once,
each with the launcher's environment of the moment, each dying with the launcher."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from omnitron.core.training.workers import enter_worker, worker_context
from omnitron.testing.faults import alive, wait_gone


def _report(launcher_pid: int, env: dict, path: str) -> None:
    preloaded = "torch" in sys.modules  # before anything of the rank's imports it
    enter_worker(launcher_pid, env)
    with open(path, "w") as f:
        f.write(f"{os.environ.get('OMNITRON_PROBE')} {int(preloaded)}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is what Linux starts ranks from")
def test_ranks_take_the_launchers_environment_of_the_moment(tmp_path, monkeypatch):
    """The server's own environment is the one it started with; each rank gets the launcher's at its start
    (a second job in one process, as the tests run them, must not see the first job's report directory).
    Fails without the hand-over: the second rank reads the first value (or none)."""
    ctx = worker_context()
    seen = []
    for value in ("first", "second"):
        monkeypatch.setenv("OMNITRON_PROBE", value)
        path = str(tmp_path / value)
        p = ctx.Process(target=_report, args=(os.getpid(), dict(os.environ), path))
        p.start()
        p.join(60)
        assert p.exitcode == 0
        seen.append(open(path).read())
    assert seen == ["first 1", "second 1"]  # and torch came with the fork, not imported afresh


WATCHER = """
import sys, time
from omnitron.core.lifetime import die_with
die_with(int(sys.argv[1]))
print("watching", flush=True)
time.sleep(60)
"""


def test_a_rank_dies_with_its_launcher_not_only_its_parent():
    """``die_with``: a process watching another (not its parent, as a forked rank watches its launcher through
    the fork server) is killed within the poll interval once that process is gone. Fails if the watch
    never fires: the watcher sleeps on for 60 s."""
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watcher = subprocess.Popen([sys.executable, "-c", WATCHER, str(launcher.pid)], stdout=subprocess.PIPE, text=True)
    try:
        assert watcher.stdout.readline() == "watching\n"
        launcher.kill()
        launcher.wait()
        t0 = time.monotonic()
        wait_gone([watcher.pid], 10)
        assert watcher.wait() == -9 and time.monotonic() - t0 < 10
    finally:
        for p in (launcher, watcher):
            if alive(p.pid):
                p.kill()


def test_the_store_holds_its_port_from_the_moment_it_is_told():
    """The job's store is bound before its port is handed to any rank, so no other process can take the
    port in between (two suites side by side once lost a run to EADDRINUSE when the port was found free,
    closed, and bound again by rank 0). Fails with a found-then-closed port: the second bind succeeds."""
    import errno
    import socket

    from omnitron.core.training.workers import client_store, host_store

    store = host_store(2, 10.0)
    with socket.socket() as thief, pytest.raises(OSError) as taken:
        thief.bind(("127.0.0.1", store.port))
    assert taken.value.errno == errno.EADDRINUSE
    client_store(store.port, 2, 10.0).set("probe", "ok")  # a rank reaches the store it was told of
    assert store.get("probe") == b"ok"


def test_worker_threads_follow_the_flag_then_omp_num_threads_then_the_core_share(monkeypatch):
    """``--threads-per-process`` wins; else ``OMP_NUM_THREADS`` (torchrun's 1, a scheduler's share) as torch itself
    honours it; else the node's cores split among its workers. A malformed value is refused with its name."""
    from types import SimpleNamespace

    from omnitron.core.training.launch import _threads

    cores = os.cpu_count() or 1
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert _threads(SimpleNamespace(threads=None), 2 * cores) == 1
    assert _threads(SimpleNamespace(threads=None), 1) == min(cores, 8)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert _threads(SimpleNamespace(threads=None), 2 * cores) == 3
    assert _threads(SimpleNamespace(threads=5), 2 * cores) == 5
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("OMP_NUM_THREADS", bad)
        with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
            _threads(SimpleNamespace(threads=None), 1)


def _dispositions(launcher_pid: int, env: dict, path: str) -> None:
    import signal

    enter_worker(launcher_pid, env)
    sigint, sigterm = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    names = {signal.SIG_IGN: "ignored", signal.SIG_DFL: "default", signal.default_int_handler: "default"}
    with open(path, "w") as f:
        f.write(f"INT {names.get(sigint, sigint)} TERM {names.get(sigterm, sigterm)} blocked {sorted(blocked)}")
    os.kill(os.getpid(), signal.SIGTERM)  # a rank with no handler of its own dies of it
    time.sleep(30)


STOP_SIGNALS_PROBE = """
import os, signal, sys, time
from multiprocessing import forkserver
sys.path.insert(0, sys.argv[1])
import test_worker_start as t
from omnitron.core.training import workers
signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher's own, while it starts its ranks
signal.signal(signal.SIGTERM, lambda *a: None)
ctx = workers.worker_context()
workers.start_fork_server(ctx)
forkserver.ensure_running()  # a no-op once started: what the first rank's start does
server = forkserver._forkserver._forkserver_pid
for sig in (signal.SIGTERM, signal.SIGINT):  # as a signal to the job's process group reaches it
    os.kill(server, sig)
time.sleep(0.5)
print("server", "alive" if os.waitpid(server, os.WNOHANG) == (0, 0) else "dead", flush=True)
for name, ignored in (("plain", ""), ("nohup", "SIGINT")):
    env = dict(os.environ, **{workers.IGNORED_ENV: ignored})
    p = ctx.Process(target=t._dispositions, args=(os.getpid(), env, os.path.join(sys.argv[2], name)))
    p.start()
    p.join(60)
    print(name, p.exitcode, open(os.path.join(sys.argv[2], name)).read(), flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is what Linux starts ranks from")
def test_the_fork_server_outlives_stop_signals_and_its_ranks_do_not_inherit_them(tmp_path):
    """SIGTERM and SIGINT to the fork server (a signal to the job's process group reaches it) leave it running:
    it died of SIGTERM and took its ranks with it before they could save. Its ranks get the stop signals as a
    fresh process has them (not the launcher's ignored SIGINT, not the server's mask), unless the launcher's
    parent made it ignore one; a rank with no handler dies of SIGTERM. Fails without the fix: the server is
    dead (and the ranks ignored SIGINT)."""
    out = subprocess.run([sys.executable, "-c", STOP_SIGNALS_PROBE, os.path.dirname(__file__), str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.splitlines() == ["server alive", "plain -15 INT default TERM default blocked []",
                                       "nohup -15 INT ignored TERM default blocked []"], out.stdout + out.stderr
