"""Distributed faults under ``omnitron train --nproc-per-node 2`` and torchrun: a frozen rank, a killed
launcher, a killed worker, an elastic restart. Each asserts the outcome (every process gone in time, the exit
code, the resumed loss curve) and the message. The watchdog's timeout is set in seconds through
``OMNITRON_DISTRIBUTED_TIMEOUT_S`` (the flag's minutes would make these tests minutes long)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from omnitron.core.training.workers import GRACE_ENV
from omnitron.testing.faults import (DictStore, children, records, start, tiny_train_args, wait_for_iteration,
                                     wait_gone)

TIMEOUT_S = 6.0
"""The watchdog / collective timeout of these runs: long enough for a step on a loaded 2-core machine."""


def _run(tmp_path, *extra, env=None):
    args = tiny_train_args(tmp_path, "--train-iters", "100000", "--nproc-per-node", "2",
                           "--tensor-model-parallel-size", "2", *extra)
    return start(args, env={"OMNITRON_DISTRIBUTED_TIMEOUT_S": str(TIMEOUT_S), **(env or {})})


def test_children_names_ranks_by_their_arguments_not_the_interpreter_path(tmp_path):
    """``children`` under an interpreter whose path names omnitron (a venv in ``/tmp/omnitron-oldest-torch``): a
    helper child (multiprocessing's resource tracker there) is no rank; a child whose arguments name omnitron is.
    Before, the path matched, and every launcher test counted three workers in that venv."""
    (tmp_path / "omnitron-venv").mkdir()
    exe = tmp_path / "omnitron-venv" / "python"
    exe.symlink_to(sys.executable)
    sleep = "import time; time.sleep(60)"
    parent = subprocess.Popen([str(exe), "-c", f"""import subprocess, sys, time
kids = [subprocess.Popen([sys.argv[1], "-c", {sleep!r}, *extra]) for extra in ([], ["-m", "omnitron"])]
print(" ".join(str(k.pid) for k in kids), flush=True)
time.sleep(60)""", str(exe)], stdout=subprocess.PIPE, text=True)
    kids = [int(p) for p in parent.stdout.readline().split()]  # (each sleeps a minute at most if left)
    try:
        assert children(parent.pid) == kids[1:], kids
    finally:
        for pid in kids + [parent.pid]:
            os.kill(pid, signal.SIGKILL)
        parent.wait()


def _launcher_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("omnitron train:")]


def test_frozen_rank_everything_exits_with_stacks(tmp_path):
    # the frozen rank's report never comes: a 1 s grace (GRACE_ENV) instead of the production 5 s before the
    # launcher kills it; rank 0's report is written before its exit, which starts the grace
    proc = _run(tmp_path, env={GRACE_ENV: "1"})
    wait_for_iteration(str(tmp_path / "logs" / "metrics.jsonl"), 2, proc)
    workers = children(proc.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGSTOP)
    # detection after TIMEOUT_S (+ one heartbeat interval), then the launcher's grace before it kills the frozen
    # one; 60 s leaves room for a loaded machine
    wait_gone([proc.pid, *workers], 60)
    out = proc.stdout.read()
    assert proc.wait() == 1
    lines = _launcher_lines(out)
    # whole seconds when the watched peer went silent first; one decimal (the staleness bound) when the step deadline
    # fired first and the census found the silent rank: which comes first depends on the machine's load
    assert re.match(rf"omnitron train: rank 1 \(pid {workers[1]}\) stopped responding: sent no heartbeat for "
                    rf"\d+(\.\d)? s", lines[0]), out
    assert lines[1].startswith("omnitron train: rank 0 timed out waiting (watchdog"), out
    assert f"[omnitron watchdog] rank 0 (pid {workers[0]}): rank 1" in out
    assert "Python stacks of every thread" in out and "in train" in out  # rank 0's main thread, in the loop


def test_killed_launcher_takes_its_workers(tmp_path):
    proc = _run(tmp_path, "--save", str(tmp_path / "ck"), "--save-interval", "1")
    wait_for_iteration(str(tmp_path / "logs" / "metrics.jsonl"), 2, proc)
    workers = children(proc.pid)
    assert len(workers) == 2
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    wait_gone(workers, 10)
    saved = sorted(os.listdir(tmp_path / "ck"))
    time.sleep(1.0)
    assert sorted(os.listdir(tmp_path / "ck")) == saved  # nobody trains on


def test_start_up_watch_names_a_worker_without_cpu_time():
    """The launcher's start-up check on real processes (fast): a stopped and a sleeping worker that have not
    joined are frozen once they used no CPU time for the timeout; a busy one and one that joined are not."""
    import torch.distributed as dist

    from omnitron.core.training.workers import StartupWatch, prefixed

    class Proc:
        def __init__(self, then: str):
            self.popen = subprocess.Popen([sys.executable, "-c", f"print('up', flush=True)\n{then}"],
                                          stdout=subprocess.PIPE, text=True)
            self.pid, self.exitcode = self.popen.pid, None

    store = dist.HashStore()
    sleep = "import time; time.sleep(60)"
    procs = [Proc(sleep), Proc("while True: pass"), Proc(sleep), Proc(sleep)]
    try:
        assert all(p.popen.stdout.readline() == "up\n" for p in procs)  # past the interpreter's start-up
        os.kill(procs[2].pid, signal.SIGSTOP)
        prefixed(store).set("arrived/3", "1")
        watch = StartupWatch(store, procs, timeout_s=1.0)
        found, t0 = {}, time.monotonic()
        while sorted(found) != [0, 2] and time.monotonic() - t0 < 10:
            frozen = watch.check(time.monotonic())
            if frozen is None:
                time.sleep(0.1)
                continue
            found[frozen[0]] = frozen[1]  # each call names the first frozen rank; drop it and look again
            watch.arrived.add(frozen[0])
        assert sorted(found) == [0, 2] and watch.arrived == {0, 2, 3}, found
        assert re.fullmatch(r"froze during start-up, before joining the job: no CPU time for \d+ s, process state "
                            r"S", found[0]), found
        assert found[2].endswith("stopped (SIGSTOP or a debugger)"), found
    finally:
        for p in procs:
            p.popen.kill()
            p.popen.wait()


AGENT = """
import os, subprocess, sys
env = dict(os.environ, TORCHELASTIC_RUN_ID="probe")
rank0 = (
    "import torch.distributed as dist\\n"
    "from omnitron.core.training.workers import _wait_for_arrivals\\n"
    "store = dist.HashStore(); store.set('arrived/0', '1')\\n"
    "_wait_for_arrivals(store, 2, 1.0)\\n")
rank1 = "import time; time.sleep(60)"  # frozen in its imports: no CPU time, never arrives
others = [subprocess.Popen([sys.executable, "-c", rank1], env=dict(env, RANK="1"))]
done = subprocess.run([sys.executable, "-c", rank0], env=dict(env, RANK="0"), capture_output=True, text=True)
others[0].kill()
print(done.returncode, others[0].pid, done.stderr.strip().splitlines()[-1])
"""


def test_under_torchrun_a_rank_names_a_sibling_frozen_in_start_up():
    """Under torchrun (no launcher of ours), a rank waiting for the others to arrive names a sibling of the same
    agent that has not arrived and used no CPU time for the timeout (fast: a stand-in agent, a HashStore)."""
    proc = subprocess.run([sys.executable, "-c", AGENT], capture_output=True, text=True, timeout=120)
    code, pid, line = proc.stdout.split(" ", 2)
    assert code == "1", proc.stdout + proc.stderr
    assert re.fullmatch(rf"omnitron\.core\.training\.nonfinite\.TrainingStopped: rank 1 \(pid {pid}\) froze during "
                        rf"start-up, before joining the job: no CPU time for \d+ s, process state S\n", line), line


def test_ranks_that_never_join_are_named_and_the_wait_is_quiet(monkeypatch, capfd):
    """A rank waiting at a TCP store (as under torchrun: every rank a client) for peers: ranks that arrive late are
    waited for; ranks that never come are named in one line when the join wait ends, and the wait prints nothing
    meanwhile (it printed two C++ "waitForInput ... timed out" warnings a second, per waiting rank)."""
    import datetime
    import threading

    import torch.distributed as dist

    from omnitron.core.training import workers
    from omnitron.core.training.nonfinite import TrainingStopped

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(workers, "JOIN_TIMEOUT_S", 3.0)
    host = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", host.port, 1, False, datetime.timedelta(seconds=30))
    client.set("arrived/0", "1")
    late = threading.Timer(1.0, lambda: [host.set(f"arrived/{r}", "1") for r in (1, 2)])
    late.start()
    t0 = time.monotonic()
    workers._wait_for_arrivals(client, 3, 0.5)  # ranks 1 and 2 come after 1 s
    assert 1.0 <= time.monotonic() - t0 < 2.9
    with pytest.raises(TrainingStopped) as stopped:
        workers._wait_for_arrivals(client, 6, 0.5)  # ranks 3, 4, 5 never come
    assert str(stopped.value) == ("ranks 3, 4, 5 did not join the job within 3 s (a node that did not start "
                                  "omnitron, or a rank that failed before joining: see its log)")
    err = capfd.readouterr().err
    assert "waitForInput" not in err and "timed out" not in err, err


@pytest.mark.slow
def test_rank_frozen_in_start_up_ends_the_job_within_the_timeout(tmp_path):
    """A worker stopped (SIGSTOP) before it joins the job, while the other waits for it at the store (which
    waits 300 s for a slow start): the launcher ends the job after TIMEOUT_S without CPU time, naming it."""
    proc = _run(tmp_path)
    t0 = time.monotonic()
    workers = children(proc.pid)
    while len(workers) < 2:  # stop rank 1 as soon as it exists: still importing
        assert proc.poll() is None and time.monotonic() - t0 < 60, proc.stdout.read() if proc.poll() else workers
        time.sleep(0.005)
        workers = children(proc.pid)
    os.kill(workers[1], signal.SIGSTOP)
    stopped = time.monotonic()
    wait_gone([proc.pid, *workers], 40)  # the timeout, a poll, the kill: well under the 300 s join wait
    out = proc.stdout.read()
    assert proc.wait() == 1 and time.monotonic() - stopped < 40
    lines = _launcher_lines(out)
    assert re.match(rf"omnitron train: rank 1 \(pid {workers[1]}\) stopped responding: froze during start-up, before "
                    rf"joining the job: no CPU time for \d+ s, stopped \(SIGSTOP", lines[0]), out
    assert lines[1] == "omnitron train: rank 0 still running then: killed by the launcher", out
    assert "metrics.jsonl" not in os.listdir(tmp_path / "logs") if os.path.isdir(tmp_path / "logs") else True


def test_killed_worker_is_named_first(tmp_path):
    proc = _run(tmp_path)
    wait_for_iteration(str(tmp_path / "logs" / "metrics.jsonl"), 2, proc)
    workers = children(proc.pid)
    os.kill(workers[1], signal.SIGKILL)
    wait_gone([proc.pid, *workers], 30)
    out = proc.stdout.read()
    assert proc.wait() == 1
    lines = _launcher_lines(out)
    assert lines[0] == f"omnitron train: rank 1 (pid {workers[1]}) was killed by signal SIGKILL", out
    assert lines[1].startswith("omnitron train: rank 0 then lost the connection to it ("), out
    # rank 0 exits 1 after its report, or is killed (-9) by the launcher when its exit outlasts the grace
    # period on a loaded machine (seen once on torch 2.9.1 at load 20+): either way its report came first
    assert lines[2] in ("omnitron train: worker exit codes [1, -9]", "omnitron train: worker exit codes [-9, -9]")
    assert "Traceback" not in out  # the other rank's gloo error is the one line above


def test_step_deadline_fires_on_a_live_but_stuck_rank(tmp_path):
    """A rank alive and heartbeating but stuck inside a step (a p2p that never completes) is stopped by the
    step deadline, with its stack (the stuck frame) and exit code 75."""
    script = (
        "import time\n"
        "from omnitron.core.training.watchdog import Watchdog\n"
        "class Store(dict):\n"
        "    def set(self, k, v): self[k] = v.encode() if isinstance(v, str) else v\n"
        "    def get(self, k): return self[k]\n"
        "    def check(self, keys): return all(k in self for k in keys)\n"
        "store = Store()\n"
        "wd = Watchdog(0, 1, 1.5, lambda: store, interval_s=0.2).start()\n"
        "def stuck_in_p2p():\n"
        "    time.sleep(30)\n"
        "with wd.deadline('iteration 7'):\n"
        "    stuck_in_p2p()\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 75, proc.stderr
    assert re.search(r"rank 0 \(pid \d+\): iteration 7 has not finished after \d s", proc.stderr), proc.stderr
    assert "in stuck_in_p2p" in proc.stderr


FROZEN_STORE = """
import threading, time
from omnitron.core.training.watchdog import Watchdog
frozen = threading.Event()
class Store(dict):
    def _wait(self):
        if frozen.is_set():
            time.sleep(3600)  # the launcher hosting the store is SIGSTOPped: calls never return
    def set(self, k, v):
        self._wait(); self[k] = v.encode() if isinstance(v, str) else v
    def get(self, k):
        self._wait(); return self[k]
    def check(self, keys):
        self._wait(); return all(k in self for k in keys)
store = Store()
def healthy_rank_1():
    n = 0
    while not frozen.is_set():
        n += 1; dict.__setitem__(store, "hb/1", str(n).encode()); time.sleep(0.05)
threading.Thread(target=healthy_rank_1, daemon=True).start()
wd = Watchdog(0, 2, 1.5, lambda: store, interval_s=0.2).start()
with wd.deadline("iteration 3"):
    time.sleep(0.5)
    frozen.set()
    time.sleep(30)
"""


def test_frozen_store_is_named_not_a_healthy_neighbour():
    """The store's host (the launcher) freezes while rank 0 is inside a step and rank 1 heartbeats on: rank 0
    stops (75) naming the store, not rank 1 (its heartbeats are unreadable, not missing) nor the step."""
    proc = subprocess.run([sys.executable, "-c", FROZEN_STORE], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 75, proc.stderr
    first = proc.stderr.splitlines()[0]
    assert re.search(r"rank 0 \(pid \d+\): the rendezvous store has not answered for \d+ s: the launcher or "
                     r"torchrun agent that hosts it is frozen or gone", first), proc.stderr
    assert "rank 1" not in proc.stderr.split("Python stacks")[0], proc.stderr


DUMPERS = """
import multiprocessing as mp, threading, time
from omnitron.backends import collectives  # noqa: F401 - imported once, before the fork
from omnitron.core.training.watchdog import dump_state
def rank_main(rank, barrier):
    ns = {"time": time}
    name = f"parked_on_rank_{rank}"
    exec(f"def {name}(depth):\\n    return {name}(depth - 1) if depth else time.sleep(60)", ns)
    for _ in range(12):  # deep stacks: each dump past the size a pipe keeps whole
        threading.Thread(target=ns[name], args=(40,), daemon=True).start()
    time.sleep(0.3)
    barrier.wait()
    dump_state("test dump", rank)
ctx = mp.get_context("fork")
barrier = ctx.Barrier(4)
procs = [ctx.Process(target=rank_main, args=(r, barrier)) for r in range(4)]
[p.start() for p in procs]
[p.join() for p in procs]
"""


def test_stack_dumps_of_ranks_that_fire_together_do_not_interleave():
    """Four ranks dump at the same instant into one stderr pipe (each dump over 16 KiB, past the size a pipe
    keeps whole): every dump comes out whole, its header, then only its own rank's frames, then its closing line."""
    proc = subprocess.run([sys.executable, "-c", DUMPERS], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    heads = [i for i, line in enumerate(lines) if re.match(r"\[omnitron watchdog\] rank \d \(pid \d+\): test dump$",
                                                             line)]
    assert len(heads) == 4, proc.stderr[-2000:]
    for start, end in zip(heads, heads[1:] + [len(lines)]):
        rank = lines[start].split()[3]
        block = lines[start:end]
        assert block[-1].startswith(f"[omnitron watchdog] rank {rank}: "), block[-3:]
        frames = [line for line in block if "parked_on_rank_" in line]
        assert len(frames) >= 12 and all(f"parked_on_rank_{rank}" in f for f in frames), (rank, block[:5])
        assert len("\n".join(block)) > 4 * 4096  # past PIPE_BUF: a pipe would not keep even one write whole


def test_torchrun_restart_resumes_bit_identically(tmp_path):
    """torchrun --max-restarts 1, one worker killed after the checkpoint at iteration 4: the restarted attempt
    rendezvous, resumes from it and repeats the iterations the killed attempt had already run with the very
    same losses (bit for bit), then finishes."""
    save, metrics = tmp_path / "ck", str(tmp_path / "logs" / "metrics.jsonl")
    args = tiny_train_args(tmp_path, "--train-iters", "9", "--tensor-model-parallel-size", "2", "--save", str(save),
                           "--load", str(save), "--save-interval", "4")
    proc = start(["--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.2", "-m", "omnitron",
                  "train", *args], launcher=("-m", "torch.distributed.run"),
                 env={"OMNITRON_DISTRIBUTED_TIMEOUT_S": "30"})
    first = {r["iteration"]: r["lm_loss"] for r in wait_for_iteration(metrics, 5, proc)}
    workers = children(proc.pid)  # torchrun's agent is the launched process itself
    assert len(workers) == 2
    os.kill(workers[-1], signal.SIGKILL)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert "resumed from" in out and "iter_0000004" in out, out
    second = {r["iteration"]: r["lm_loss"] for r in records(metrics)}
    assert sorted(second) == list(range(1, 10))
    repeated = [i for i in first if i > 4]
    assert repeated and all(second[i] == first[i] for i in repeated), (first, second)


def test_summary_names_the_cause_first():
    """The launcher's lines from exit codes and reports (pure logic): the cause first, reactions grouped."""
    from omnitron.core.training.failures import classify, summarize

    def w(rank, code, order, killed=False):
        return {"rank": rank, "pid": 100 + rank, "exitcode": code, "order": order, "killed": killed}

    peer = classify(RuntimeError("[/x/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by "
                                 "peer. This is typically caused by a remote worker hanging"))
    assert peer == ("peer", "Read error [127.0.0.1]:1: Connection reset by peer")
    reports = {r: {"rank": r, "kind": peer[0], "line": peer[1]} for r in (0, 1, 3)}
    assert summarize([w(0, 1, 1), w(1, 1, 2), w(2, -9, 0), w(3, 1, 3)], reports) == [
        "rank 2 (pid 102) was killed by signal SIGKILL",
        "ranks 0, 1, 3 then lost the connection to it (Read error [127.0.0.1]:1: Connection reset by peer)"]
    frozen = "rank 1 (pid 101 on h) sent no heartbeat for 61 s: it is frozen"
    reports = {0: {"rank": 0, "kind": "watchdog", "line": frozen, "suspect": 1}}
    assert summarize([w(0, 75, 0), w(1, -9, 1, killed=True)], reports) == [
        "rank 1 (pid 101) stopped responding: sent no heartbeat for 61 s: it is frozen",
        "rank 0 timed out waiting (watchdog: stacks and last collectives above)"]
    store = "the rendezvous store has not answered for 61 s: the launcher or torchrun agent that hosts it is frozen"
    reports = {r: {"rank": r, "kind": "store", "line": store, "suspect": None} for r in (0, 1)}
    assert summarize([w(0, 75, 0), w(1, 75, 1)], reports) == [
        "the rendezvous store stopped answering (the launcher or torchrun agent that hosts it was frozen or gone): "
        "ranks 0, 1 stopped on it"]
    reports[1] = {"rank": 1, "kind": "peer", "line": "Connection reset by peer"}
    assert summarize([w(0, 75, 0), w(1, 1, 1)], reports)[1] == "rank 1 then lost the connection to it (Connection " \
        "reset by peer)"
    err = classify(ValueError("bad shape"))
    reports = {1: {"rank": 1, "kind": err[0], "line": err[1]}, 0: {"rank": 0, "kind": "peer", "line": "closed"}}
    assert summarize([w(0, 1, 1), w(1, 1, 0)], reports) == [
        "rank 1 (pid 101) failed: ValueError: bad shape", "rank 0 then lost the connection to it (closed)"]


@pytest.mark.parametrize("argv,want", [
    (["/usr/bin/omnitron", "generate", "--load", "x"], "omnitron generate"),
    (["/x/omnitron/__main__.py", "serve", "--port", "1"], "omnitron serve"),
    (["/usr/bin/omnitron", "train", "--config", "a.yaml"], "omnitron train"),
    (["/x/omnitron/train.py", "--train-iters", "3"], "omnitron train"),  # python -m omnitron.train (torchrun)
])
def test_failure_lines_name_the_sub_command(monkeypatch, argv, want):
    """The launcher's failure lines are prefixed with the sub-command the user ran, not always ``train``."""
    import sys

    from omnitron.core.training.workers import command_name

    monkeypatch.setattr(sys, "argv", argv)
    assert command_name() == want


def test_failure_grace_defaults_to_the_heartbeats_and_a_bad_override_stops_before_any_worker(monkeypatch):
    """The launcher's grace after a failure: 5 s, or two heartbeat intervals and 2 s at long timeouts (hand-derived
    from watchdog.heartbeat_interval: a twelfth of the timeout, at most 5 s); ``$OMNITRON_FAILURE_GRACE_S``
    (the frozen-rank test's) replaces it; a value that is not seconds is one line naming the variable, raised
    by run_workers before it starts a worker."""
    from omnitron.core.config.parallel import ConfigError
    from omnitron.core.training import workers

    monkeypatch.delenv(GRACE_ENV, raising=False)
    assert workers.failure_grace_s(6.0) == 5.0 and workers.failure_grace_s(36.0) == 8.0  # 2 x 3 s + 2 s
    assert workers.failure_grace_s(600.0) == 12.0  # the interval capped at 5 s
    monkeypatch.setenv(GRACE_ENV, "0.5")
    assert workers.failure_grace_s(600.0) == 0.5
    started = []
    monkeypatch.setattr(workers, "host_store", lambda *a: started.append(a))
    settings = type("S", (), {"training": type("T", (), {"distributed_timeout_minutes": 10})()})()
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv(GRACE_ENV, bad)
        with pytest.raises(ConfigError, match=f"{GRACE_ENV}='{bad}' is not a number of seconds"):
            workers.run_workers(settings, None, 2, None)
    assert started == []


def test_timeout_is_the_flags_minutes_unless_the_environment_gives_seconds(monkeypatch):
    """--distributed-timeout-minutes counts minutes (x 60 s); ``OMNITRON_DISTRIBUTED_TIMEOUT_S`` overrides it in
    seconds. The heartbeat is a twelfth of the timeout within [0.2, 5] s."""
    from omnitron.core.training.watchdog import TIMEOUT_ENV, distributed_timeout_s, heartbeat_interval

    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert distributed_timeout_s(10) == 600.0 and distributed_timeout_s(0.5) == 30.0
    monkeypatch.setenv(TIMEOUT_ENV, "7.5")
    assert distributed_timeout_s(10) == 7.5
    assert [heartbeat_interval(t) for t in (1.0, 12.0, 36.0, 600.0)] == [0.2, 1.0, 3.0, 5.0]


@pytest.mark.parametrize("peer_beats", [False, True])
def test_a_peer_whose_heartbeat_counter_stops_is_named_frozen_between_steps(peer_beats):
    """Outside any step deadline, rank 0 names its watched peer (rank 1) frozen once the peer's counter has not
    moved for the timeout, though the key is still there to read; a peer whose counter moves is not named over
    the same window. (A check that refreshed the peer's last-seen time on every successful read, not on a changed
    value, would never fire here.)"""
    from omnitron.core.training.watchdog import Watchdog

    store, fired, stop = DictStore({"hb/1": b"7", "info/1": b"pid 42 on host"}), [], threading.Event()

    class Recorder(Watchdog):
        def fire(self, reason, suspect=None, publish=True, kind="watchdog"):
            fired.append((reason, suspect))

    def beat():
        n = 7
        while not stop.wait(0.05):
            n += 1
            store.set("hb/1", str(n))

    if peer_beats:
        threading.Thread(target=beat, daemon=True).start()
    timeout, interval = 1.0, 0.1
    wd = Recorder(0, 2, timeout, lambda: store, interval_s=interval).start()
    deadline = time.monotonic() + timeout + 20 * interval  # the verdict needs one read past the timeout
    while not fired and time.monotonic() < deadline:
        time.sleep(interval)
    wd.stop()
    stop.set()
    if peer_beats:
        assert fired == []
    else:
        assert fired and fired[0][1] == 1, fired
        assert re.match(r"rank 1 \(pid 42 on host\) sent no heartbeat for \d+ s: it is frozen", fired[0][0])
