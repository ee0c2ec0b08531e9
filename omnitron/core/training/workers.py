"""Worker processes that never outlive their launcher, join each restart attempt cleanly, and fail loudly.

- the workers call :func:`omnitron.core.lifetime.die_with_parent`: a ``kill -9`` of the launcher or of
  torchrun's agent leaves no orphan training on. The launcher's ranks fork from a server that imported
  torch once (:func:`worker_context`); a killed launcher ends the server, and the server's end the ranks.
- :func:`join_job`: one rendezvous store per restart attempt (``PrefixStore`` keyed on
  ``TORCHELASTIC_RESTART_COUNT``: a restarted torchrun attempt would otherwise read the dead attempt's
  gloo addresses and fail with "connectFullMesh ... Connection refused"), the process group with
  ``--distributed-timeout-minutes``, and the rank's :class:`~omnitron.core.training.watchdog.Watchdog`.
- :func:`run_workers`: ``--nproc-per-node N``. The launcher hosts the store (a frozen rank 0 does not take it
  down), supervises the workers (a worker frozen before it joins: :class:`StartupWatch`), and after the
  first failure gives the others a grace period to report, then kills what is left (a frozen worker, a
  worker stuck on a dead peer) and prints :func:`omnitron.core.training.failures.summarize`. It relays SIGTERM
  to the workers; the fork server blocks SIGTERM and SIGINT (:func:`start_fork_server`: a signal to the job's
  process group must not end it under its ranks), and each rank restores them (:func:`restore_stop_signals`).
"""
from __future__ import annotations

import datetime
import os
import shutil
import signal
import sys
import tempfile
import time

from omnitron.core.lifetime import die_with, die_with_parent
from omnitron.core.training import agreement, failures, lifeline
from omnitron.core.training.failures import command_name, rank_list
from omnitron.core.training.prejoin import prefixed
from omnitron.core.training.watchdog import Watchdog, collective_timeout_s, distributed_timeout_s, heartbeat_interval

HOSTED_STORE_ENV = "OMNITRON_LAUNCHER_STORE"
"""Set by the launcher for its workers: the store is hosted by the launcher, every rank is a client."""


STARTUP_POLL_S = 1.0
"""Seconds between the launcher's checks of its workers' start-up (:class:`StartupWatch`)."""
GRACE_ENV = "OMNITRON_FAILURE_GRACE_S"
"""Seconds, overriding the launcher's grace after a worker's failure (:func:`failure_grace_s`): the tests that freeze
a rank, whose report can never come, set it low rather than wait the production grace out."""
JOIN_TIMEOUT_S = 300.0
"""The least time the store waits for every rank to arrive: a slow start (imports on a loaded machine) is
not a hang, whatever the collective timeout (the watchdog and the collectives keep theirs)."""


def failure_grace_s(timeout_s: float) -> float:
    """How long the launcher waits, after a worker's failure, for the others to report before it kills them:
    ``$OMNITRON_FAILURE_GRACE_S`` if set, else 5 s or two heartbeats (their last reports) and 2 s, the longer."""
    env = os.environ.get(GRACE_ENV)
    if env:
        try:
            grace = float(env)
        except ValueError:
            grace = -1.0
        if not grace >= 0:
            from omnitron.core.config.parallel import ConfigError

            raise ConfigError(f"{GRACE_ENV}={env!r} is not a number of seconds >= 0; unset it or give e.g. 1")
        return grace
    return max(5.0, 2 * heartbeat_interval(timeout_s) + 2.0)


def open_store(timeout_s: float, is_master: bool):
    """A client (or, for ``is_master``, the host) of the job's store at MASTER_ADDR:MASTER_PORT, with this
    attempt's key prefix; its waits last ``max(timeout_s, JOIN_TIMEOUT_S)``."""
    import torch.distributed as dist

    wait = datetime.timedelta(seconds=max(timeout_s, JOIN_TIMEOUT_S))
    # NOTE: the host does not wait for every rank to connect: its join's wait does, and stops on a peer's failure
    # (rank 0 hosting under torchrun without the agent's store waited 300 s here for a refused peer)
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                         is_master, wait, multi_tenant=is_master, wait_for_workers=not is_master)
    return prefixed(base)


def _store_hosted_elsewhere() -> bool:
    """torchrun's agent (``TORCHELASTIC_USE_AGENT_STORE``) or our launcher hosts the store."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or os.environ.get(HOSTED_STORE_ENV) == "1"


def join_job(settings, backend) -> Watchdog:
    """Store, process group and watchdog of this rank (``RANK``/``WORLD_SIZE``/``MASTER_*`` from the launcher)."""
    timeout = distributed_timeout_s(settings.training.distributed_timeout_minutes)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    lifeline.hold()  # (once: omnitron train holds it from its start) a death before joining is seen on every node
    store = _join_store(timeout, rank)
    lg = getattr(settings, "logging", None)
    if rank == 0:  # before it arrives: every rank can read it once all have arrived
        store.set("run_dir", getattr(lg, "log_dir", None) or "")
    agreement.mark_save_dir(store, rank, settings)
    # NOTE: gloo's own rendezvous waits only the collective timeout: let every rank arrive first
    store.set(f"arrived/{rank}", "1")
    _wait_for_arrivals(store, world, timeout)
    if lg is not None and not lg.log_dir:
        # torchrun: the new ./runs/<timestamp> rank 0 named for a job with neither --save nor --log-dir
        # (launch.py; each rank naming its own from its clock could straddle a second)
        lg.log_dir = store.get("run_dir").decode() or None
    agreement.agreed(store, rank, world, settings, max(timeout, JOIN_TIMEOUT_S), backend)
    backend.collectives.init_process_group(rank=rank, world_size=world, timeout_s=collective_timeout_s(timeout),
                                           store=store, group_deadline_s=timeout)
    lifeline.release()  # joined: the watchdog watches the peers from here
    return Watchdog(rank, world, timeout, lambda: open_store(timeout, is_master=False)).start()


def _join_store(timeout: float, rank: int):
    """:func:`open_store` for this rank's join (rank 0 hosts it unless the launcher or torchrun's agent does); a
    peer of rank 0 that never hosted it stops in one line where the client's wait ends (torch's timeout error)."""
    import torch.distributed as dist

    hosted_elsewhere = _store_hosted_elsewhere()
    try:
        return open_store(timeout, is_master=rank == 0 and not hosted_elsewhere)
    except dist.DistError as err:
        if rank == 0 or hosted_elsewhere or not failures.is_timeout(str(err)):
            raise
        from omnitron.core.training.prejoin import PeerNeverJoined

        raise PeerNeverJoined(f"rank 0 never hosted the job's store ({os.environ['MASTER_ADDR']}:"
                              f"{os.environ['MASTER_PORT']}, waited {max(timeout, JOIN_TIMEOUT_S):.0f} s): see its "
                              "node's log") from None


def _cpu(pid: int) -> tuple[str, int] | None:
    """``(state, utime + stime in clock ticks)`` of a process (Linux ``/proc``; None elsewhere or when gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


class StartupWatch:
    """The launcher's deadline on its workers' start-up, before each joins the job (imports, settings, backend,
    store): the ranks that have arrived wait up to JOIN_TIMEOUT_S for the others (a slow start on a loaded
    machine is no hang), so a worker that has not arrived and has used no CPU time for the timeout (stopped,
    blocked in the kernel, asleep on a lock) is frozen, and the job ends naming it. After arrival the
    collective timeout and the watchdog (:func:`join_job`) cover every phase."""

    def __init__(self, store, procs: list, timeout_s: float) -> None:
        self.store, self.procs, self.timeout = prefixed(store), procs, timeout_s
        self.arrived: set[int] = set()
        self.moved: dict[int, tuple[int, float]] = {}  # rank -> (CPU ticks, when they last changed)

    @property
    def done(self) -> bool:
        return len(self.arrived) == len(self.procs)

    def ranks(self):
        """``(rank, process)`` pairs watched."""
        return enumerate(self.procs)

    def check(self, now: float) -> tuple[int, str] | None:
        """``(rank, reason)`` of a worker frozen in start-up, else None."""
        for r, p in self.ranks():
            if r in self.arrived or p.pid is None or p.exitcode is not None:
                continue
            if self.store.check([f"arrived/{r}"]):
                self.arrived.add(r)
                continue
            cpu = _cpu(p.pid)
            if cpu is None:
                continue  # no /proc: the ranks' own join timeout applies
            seen = self.moved.get(r)
            if seen is None or seen[0] != cpu[1]:
                self.moved[r] = (cpu[1], now)
            elif now - seen[1] > self.timeout:
                how = "stopped (SIGSTOP or a debugger)" if cpu[0] in "Tt" else f"process state {cpu[0]}"
                return r, (f"froze during start-up, before joining the job: no CPU time for {now - seen[1]:.0f} s, "
                           f"{how}")
        return None


def _frozen_at_start(startup: StartupWatch | None, failed_at) -> int | None:
    """The rank ``startup`` finds frozen (its report written for the launcher's summary), else None."""
    if startup is None or failed_at is not None or startup.done:
        return None
    found = startup.check(time.monotonic())
    if found is None:
        return None
    failures.write_report(found[0], "startup", found[1], suspect=found[0])
    return found[0]


def _wait_for_arrivals(store, world: int, timeout: float) -> None:
    """Wait (up to ``max(timeout, JOIN_TIMEOUT_S)``) for every rank's ``arrived`` key; past that, stop in one line
    naming the ranks that never came. Under torchrun, whose agent does not watch for freezes, the ranks on this
    host that have not arrived are checked once a second as the launcher does (:class:`StartupWatch`): one frozen
    in start-up stops this rank in one line naming it (torchrun then stops the others), and so does one that exited
    (:class:`_LocalSiblings`); a rank refused before joining, or dead before joining (its lifeline's watcher
    posts it: :mod:`omnitron.core.training.lifeline`), on any node, ends the wait within a poll
    (:func:`prejoin.check_abandoned`). A store call that fails (its host ended: rank 0, where it hosts the store,
    or the torchrun agent that does) stops the wait in one line (:func:`prejoin.store_gone`)."""
    import torch.distributed as dist

    try:
        _arrivals_loop(store, world, timeout)
    except dist.DistError as err:  # a store call failed: its server ended (rank 0, or the agent hosting it)
        from omnitron.core.training.prejoin import PeerNeverJoined, store_gone

        raise PeerNeverJoined(store_gone(err, os.environ.get(HOSTED_STORE_ENV) == "1")) from None


def _arrivals_loop(store, world: int, timeout: float) -> None:
    """:func:`_wait_for_arrivals`'s loop (store errors are its caller's)."""
    from omnitron.core.training.nonfinite import TrainingStopped
    from omnitron.core.training.prejoin import check_abandoned

    keys, rank = [f"arrived/{r}" for r in range(world)], int(os.environ["RANK"]) if "RANK" in os.environ else None
    limit = max(timeout, JOIN_TIMEOUT_S)
    give_up = time.monotonic() + limit
    siblings = _LocalSiblings(store, timeout) if os.environ.get("TORCHELASTIC_RUN_ID") else None
    pause = 0.01
    # NOTE: check() and a sleep, not wait() with a short timeout: each timed-out wait() of a TCPStore client
    # prints two C++ warnings ("waitForInput ... timed out"), two lines a second per rank while a peer is late
    while not store.check(keys):
        check_abandoned(store, rank)
        if time.monotonic() >= give_up:
            missing = [r for r in range(world) if not store.check([f"arrived/{r}"])]
            raise TrainingStopped(f"{rank_list(missing)} did not join the job within {limit:.0f} s (a node that "
                                  f"did not start omnitron, or a rank that failed before joining: see its log)")
        frozen = siblings.check(time.monotonic()) if siblings is not None else None
        if frozen is not None:
            raise TrainingStopped(f"rank {frozen[0]} (pid {siblings.pid(frozen[0])}) {frozen[1]}")
        time.sleep(pause)
        pause = min(STARTUP_POLL_S, 2 * pause)  # quick while the ranks arrive together, once a second after


class _LocalSiblings(StartupWatch):
    """:class:`StartupWatch` over this rank's siblings under torchrun: the agent's other children of this run
    (their ``RANK`` read from ``/proc/PID/environ``; none where there is no ``/proc``)."""

    def __init__(self, store, timeout_s: float) -> None:
        self.store, self.timeout, self.arrived, self.moved = store, timeout_s, set(), {}
        self.procs = _sibling_ranks(os.getppid(), os.environ.get("TORCHELASTIC_RUN_ID", ""))

    @property
    def done(self) -> bool:
        return False

    def pid(self, rank: int) -> int | None:
        return self.procs[rank].pid if rank in self.procs else None

    def ranks(self):
        return self.procs.items()

    def check(self, now: float) -> tuple[int, str] | None:
        """:meth:`StartupWatch.check`; first, a sibling that exited before it arrived raises PeerNeverJoined (its
        peers used to wait for it until torchrun's agent, whose SIGTERM a rank takes as "stop after this
        iteration", killed them 30 s later)."""
        from omnitron.core.training.prejoin import PeerNeverJoined

        for r, p in self.ranks():
            if r not in self.arrived and _gone(p.pid) and not self.store.check([f"arrived/{r}"]):
                raise PeerNeverJoined(f"rank {r} (pid {p.pid}) exited before joining the job (its log says why)")
        return super().check(now)


def _gone(pid: int) -> bool:
    """Process ``pid`` has exited (no longer in ``/proc``, a zombie not yet reaped, or dead)."""
    cpu = _cpu(pid)
    return cpu is None or cpu[0] in "ZX"


def _sibling_ranks(parent: int, run_id: str) -> dict:
    """``{rank: process}`` (``pid``, ``exitcode`` None) of ``parent``'s other children in run ``run_id``."""
    import types

    found = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if env.get(b"TORCHELASTIC_RUN_ID", b"").decode() == run_id and b"RANK" in env:
            found[int(env[b"RANK"])] = types.SimpleNamespace(pid=int(entry), exitcode=None)
    return found


def _supervise(procs: list, grace_s: float, startup: StartupWatch | None = None) -> list[dict]:
    """Wait for every worker; ``grace_s`` after the first failure, kill the ones still running. ``startup``:
    polled every STARTUP_POLL_S until every worker has joined; a frozen one ends the job at once."""
    from multiprocessing.connection import wait

    pending = {p.sentinel: r for r, p in enumerate(procs)}
    order, killed, failed_at = {}, set(), None
    while pending:
        left = None if failed_at is None or killed else max(0.0, failed_at + grace_s - time.monotonic())
        if failed_at is None and startup is not None and not startup.done:
            left = STARTUP_POLL_S
        for sentinel in wait(list(pending), timeout=left):
            r = pending.pop(sentinel)
            procs[r].join()
            order[r] = len(order)
            if procs[r].exitcode and failed_at is None:
                failed_at = time.monotonic()
        if _frozen_at_start(startup, failed_at) is not None:
            failed_at = time.monotonic() - grace_s  # nothing to wait for: every rank waits on the frozen one
        if failed_at is not None and not killed and pending and time.monotonic() >= failed_at + grace_s:
            for r in pending.values():
                killed.add(r)
                procs[r].kill()  # SIGKILL: also ends a stopped (SIGSTOP) process
    return [{"rank": r, "pid": p.pid, "exitcode": p.exitcode, "order": order[r], "killed": r in killed}
            for r, p in enumerate(procs)]


def host_store(world: int, timeout_s: float, port: int = 0):
    """The job's rendezvous store, hosted by this process on ``port`` (0: the OS picks one, and the store holds
    it from that moment; ``.port`` tells it to the ranks, which all connect as clients: :func:`client_store`).
    A port found free (bound to 0, closed) and bound again later by rank 0 can be taken in between by any
    other process's outgoing connection (a gloo pair, another job's store client): with two test runs side
    by side, rank 0 once failed with EADDRINUSE while its peers waited 180 s for it."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, world, True, datetime.timedelta(seconds=max(timeout_s, JOIN_TIMEOUT_S)),
                         wait_for_workers=False)


def client_store(port: int, world: int, timeout_s: float, host: str = "127.0.0.1"):
    """A rank's connection to the store :func:`host_store` started (its waits last ``timeout_s``)."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, world, False, datetime.timedelta(seconds=timeout_s))


def worker_context():
    """The multiprocessing context the ranks start from: a fork server that has imported torch once (its
    ranks are forked from it, each with the launcher's environment handed over, :func:`enter_worker`), where
    the platform has one; else spawn. A spawned rank imports torch afresh: about 2 s of CPU each, so a
    4-rank job on 2 cores started ~10 s later than it does now (tp2 x pp2, 2 iterations: 22.5-27.4 s
    spawned, 11.2-16.3 s forked, at load 4). Only torch is preloaded, and the server never touches a device:
    omnitron's modules and any device runtime are imported in the rank, after its environment is set."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
"""The signals that stop a job (SIGUSR1 / SIGUSR2 under --exit-signal): blocked in the fork server and the resource
tracker (:func:`start_fork_server`), restored in each rank."""
IGNORED_ENV = "OMNITRON_LAUNCHER_IGNORED_SIGNALS"
"""Handed to the ranks in their ``env`` (and taken out of it there): the stop signals the launcher's own parent
made it ignore (``nohup``-style, a background job of a script), which the ranks ignore too."""


def start_fork_server(ctx) -> None:
    """Start ``ctx``'s fork server (a no-op under spawn, or when it runs already) with STOP_SIGNALS blocked.
    NOTE: SIGTERM to the job's process group (SLURM's scancel and time limit, ``kill -- -PGID``, GNU
    ``timeout``) reaches the server too: with Python's default action it died, and its ranks, tied to it by
    their parent-death signal, were SIGKILLed before they could finish the step and save. Blocked (the mask
    survives exec), the signal stays pending in the server and never acts; the server still exits when the
    launcher goes (its "alive" pipe closes). Blocked rather than ignored: a rank forked from it inherits the
    mask, and a signal that reaches the rank before :func:`enter_worker` unblocks it waits instead of being
    lost. The resource tracker is started first, with them blocked too (it ignores SIGTERM and SIGINT itself; a
    SIGUSR1 to the group killed it): its start unblocks SIGTERM and SIGINT in the calling thread."""
    if ctx.get_start_method() != "forkserver" or not hasattr(signal, "pthread_sigmask"):
        return
    from multiprocessing import forkserver, resource_tracker

    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def ignored_stop_signals(dispositions: dict) -> str:
    """``"SIGINT,SIGTERM"``-style names of the signals whose disposition (``{signal: handler}``) is SIG_IGN."""
    return ",".join(sorted(sig.name for sig, handler in dispositions.items() if handler == signal.SIG_IGN))


def restore_stop_signals(ignored: str = "", unblock: bool = True) -> None:
    """In a rank: the STOP_SIGNALS as a fresh process has them (default action; Python's KeyboardInterrupt),
    except those named in ``ignored``, then unblocked (a pending one acts now; ``unblock=False``: by
    :func:`unblock_stop_signals`, once the rank has its own handler). A rank would otherwise inherit
    what the launcher and the fork server set for themselves (SIGINT ignored, both blocked), and one without a
    handler of its own would survive them."""
    names = set(filter(None, ignored.split(",")))
    for sig in STOP_SIGNALS:
        default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
        signal.signal(sig, signal.SIG_IGN if sig.name in names else default)
    if unblock:
        unblock_stop_signals()


def unblock_stop_signals() -> None:
    """Unblock STOP_SIGNALS in this thread (a no-op where they are not blocked)."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def enter_worker(launcher_pid: int, env: dict[str, str], unblock: bool = True) -> None:
    """First thing in a rank started from :func:`worker_context`: take the launcher's ``env`` (a fork server's
    children inherit the server's environment, from when it started), die with the parent that forked it
    (the fork server, which exits when the launcher does; or the launcher itself under spawn) and with the
    launcher (within a second, whatever the server takes to exit; at once if it is gone already); then the
    stop signals as the launcher's parent gave them (:func:`restore_stop_signals`; ``unblock=False``: still blocked,
    for the rank to unblock once its stop flag is installed)."""
    env = dict(env)
    ignored = env.pop(IGNORED_ENV, "")
    os.environ.clear()
    os.environ.update(env)
    die_with_parent(os.getppid())
    die_with(launcher_pid)
    restore_stop_signals(ignored, unblock)


def _exit_signals(settings) -> tuple:
    """The signals a training job stops on (:func:`omnitron.core.training.signals.handled`); none for other jobs."""
    ck = getattr(settings, "checkpoint", None)
    if ck is None or not ck.save_on_signal:
        return ()
    from omnitron.core.training.signals import handled

    return handled(ck.exit_signal)


def run_workers(settings, entry, n: int, worker) -> int:
    """Start ``worker(rank, n, port, settings, entry, launcher_pid, env)`` for every rank (the worker calls
    :func:`enter_worker` first); the job's exit code."""
    timeout = distributed_timeout_s(settings.training.distributed_timeout_minutes)
    grace = failure_grace_s(timeout)  # a bad value stops here, before any worker starts
    store = host_store(n, timeout, int(os.environ.get("MASTER_PORT") or 0))
    port = store.port
    report_dir = tempfile.mkdtemp(prefix="omnitron-failures-")
    saved = {k: os.environ.get(k) for k in (HOSTED_STORE_ENV, failures.REPORT_DIR_ENV)}
    os.environ.update({HOSTED_STORE_ENV: "1", failures.REPORT_DIR_ENV: report_dir})  # inherited by spawn
    ctx, env = worker_context(), dict(os.environ)
    procs = [ctx.Process(target=worker, args=(r, n, port, settings, entry, os.getpid(), env)) for r in range(n)]
    early = []  # (signal, ranks it reached) of each signal that came before every worker had started

    def forward(signum, frame):
        # NOTE: a signal to the process group (a terminal's Ctrl-C, scancel) reaches the workers too: they take
        # this relayed copy, milliseconds later, as the same request (omnitron.core.training.signals.StopFlag)
        reached = set()
        for r, p in enumerate(procs):
            if p.is_alive() and p.pid:
                os.kill(p.pid, signum)
                reached.add(r)
        if any(p.pid is None for p in procs):
            early.append((signum, reached))

    from omnitron.core.training.signals import early_signal

    pending = early_signal()  # one that came during the launcher's own start (imports, parsing, checks)
    if pending is not None:
        early.append((pending.signum, set()))
    # SIGINT is relayed like SIGTERM (a scheduler may signal this process alone), unless this process's parent
    # made it ignore SIGINT (a background job of a script): then the workers ignore it too; --exit-signal too
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.SIG_IGN if previous == signal.SIG_IGN else forward)
    previous_term = signal.signal(signal.SIGTERM, forward)
    extra = [s for s in _exit_signals(settings) if s not in (signal.SIGTERM, signal.SIGINT)]
    previous_extra = {s: signal.signal(s, forward) for s in extra}
    env[IGNORED_ENV] = ignored_stop_signals({signal.SIGINT: previous, signal.SIGTERM: previous_term})
    try:
        start_fork_server(ctx)  # NOTE: seconds (it imports torch): a stop signal then was lost, the job ran on
        for p in procs:
            p.start()
        for signum, reached in early:  # now that every worker is there (its stop flag takes it from start-up)
            for r, p in enumerate(procs):
                if r not in reached and p.is_alive():
                    os.kill(p.pid, signum)
        workers = _supervise(procs, grace_s=grace,
                             startup=StartupWatch(store, procs, timeout))
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGTERM, previous_term)
        for s, handler in previous_extra.items():
            signal.signal(s, handler)
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    reports = failures.read_reports(report_dir)
    shutil.rmtree(report_dir, ignore_errors=True)
    del store
    codes = [w["exitcode"] for w in workers]
    if not any(codes):
        return 0
    name = command_name()
    for line in failures.summarize(workers, reports):
        print(f"{name}: {line}", file=sys.stderr)
    print(f"{name}: worker exit codes {codes}", file=sys.stderr)
    return 1
