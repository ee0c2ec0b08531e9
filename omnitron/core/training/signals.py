"""Stop cleanly on SIGTERM/SIGINT: finish the current step, save, exit.

The handler only sets a flag (a second signal interrupts at once, :class:`StopNow`, unless it is a repeat of the
first: :data:`REPEAT_WINDOW_S`); :meth:`StopFlag.agreed` ORs it over every rank (a signal may reach only some
processes), so all ranks stop after the same iteration. A rank installs its flag when it starts
(:func:`install`), before it joins the job, builds the model and data and loads a checkpoint (minutes on a
cluster); the training loop takes it over (:func:`adopt`), so a preemption during start-up stops the run before
its first iteration instead of killing the ranks.
"""
from __future__ import annotations

import os
import signal
import time


REPEAT_WINDOW_S = 2.0
"""A stop signal within this many seconds of the one that last took effect is the same request, not a second
one. One action often arrives several times, milliseconds apart: a terminal's Ctrl-C reaches the whole
foreground group and a wrapper relays it again (GNU ``timeout`` to its child and to the group), a SIGTERM to
the process group (SLURM, ``kill -- -PGID``) reaches the ranks and the launcher, which relays it; each copy
counted as a second signal, and the job stopped without saving. A person's second Ctrl-C, after reading the
first message, comes later than that: it still interrupts at once."""


class StopNow(KeyboardInterrupt):
    """A second stop signal: stop at once, without saving. A KeyboardInterrupt, so that no ``except Exception``
    on the way catches it; the rank reports it in one line (:mod:`omnitron.core.training.launch`)."""


class StopFlag:
    def __init__(self, enabled: bool = True, exit_signal: str = "SIGTERM") -> None:
        self.requested = False
        self.signum = None  # the signal that set ``requested``
        self._acted_at = None  # time.monotonic() of the signal that last took effect
        self._previous = {}
        if enabled:
            for sig in handled(exit_signal):
                try:
                    self._previous[sig] = signal.signal(sig, self._handle)
                except ValueError:  # not the main thread
                    pass

    def _handle(self, signum, frame) -> None:
        now, name = time.monotonic(), signal.Signals(signum).name
        if self._acted_at is not None and now - self._acted_at < REPEAT_WINDOW_S:
            return  # the same request, delivered again (a relay, or the process group and the launcher)
        first = not self.requested
        self._acted_at = now
        if not first:  # a second signal: stop now, without the checkpoint
            raise StopNow(f"second signal {name}: stopping without saving (a resumed run starts from the last "
                          f"checkpoint under --save)")
        self.requested, self.signum = True, signum
        if os.environ.get("RANK", "0") == "0":  # os.write: print() from a handler may re-enter the stream's buffer
            os.write(2, (f"omnitron: {name} received: stopping after this iteration (saved where --save is set); "
                         f"another stop signal from {REPEAT_WINDOW_S:g} s on stops at once, without saving\n").encode())

    def agreed(self, collectives, device=None) -> bool:
        """True on every rank when any rank was signalled (one tiny all-reduce over the world)."""
        import torch  # here, not at the top: the CLI imports this module before anything heavy (install_early)

        from omnitron.backends.collectives import ReduceOp

        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        if collectives.is_initialized():
            collectives.all_reduce(flag, op=ReduceOp.MAX)
        return bool(flag.item() > 0)

    def agreed_or_past(self, deadline: float | None, collectives, device=None) -> bool:
        """:meth:`agreed`, a rank whose clock (``time.time()``) is past ``deadline`` (--exit-duration-in-mins;
        None: none) counting as signalled."""
        if deadline is not None and time.time() >= deadline:
            self.requested = True
        return self.agreed(collectives, device)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def handled(exit_signal: str = "SIGTERM") -> tuple[signal.Signals, ...]:
    """The signals a run stops on: SIGTERM, SIGINT and --exit-signal."""
    extra = signal.Signals[exit_signal]
    return (signal.SIGTERM, signal.SIGINT) + ((extra,) if extra not in (signal.SIGTERM, signal.SIGINT) else ())


_installed: StopFlag | None = None


_early: StopFlag | None = None


def install_early(argv: list[str]) -> None:
    """At ``omnitron train``'s very start (before its imports, parsing and checks: seconds), the stop flag of the
    launcher, so that a stop signal then gives the line and exit code it gives later instead of killing the
    launcher with -15 and no word: :func:`install` (this process's rank) and the launcher's relay to its workers
    (:func:`early_signal`) take it over. ``--exit-signal`` is read from ``argv`` (a bad value: SIGTERM / SIGINT
    only; the parser names it)."""
    global _early
    exit_signal = "SIGTERM"
    for i, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if arg.startswith("--exit-signal=") else \
            argv[i + 1] if arg == "--exit-signal" and i + 1 < len(argv) else None
        if value in signal.Signals.__members__:
            exit_signal = value
    flag = StopFlag(enabled=False)
    for sig in handled(exit_signal):  # one the parent made this process ignore (a script's background job) stays so
        if signal.getsignal(sig) != signal.SIG_IGN:
            flag._previous[sig] = signal.signal(sig, flag._handle)
    _early = flag


def early_signal() -> StopFlag | None:
    """The flag of :func:`install_early` when a stop signal reached it (None: no signal, or none installed), once:
    its handlers are put back either way (the caller installs its own over them)."""
    global _early
    flag, _early = _early, None
    if flag is None:
        return None
    flag.restore()
    return flag if flag.requested else None


def install(ck) -> StopFlag:
    """This process's stop flag from now on (at a rank's start; ``ck``: the run's CheckpointConfig, its
    --save-on-signal and --exit-signal), for the training loop to :func:`adopt`; :meth:`StopFlag.restore` puts
    the previous handlers back. A signal :func:`install_early` caught is in it (said already)."""
    global _installed
    early = early_signal()
    _installed = StopFlag(ck.save_on_signal, ck.exit_signal)
    if early is not None:
        _installed.requested, _installed.signum, _installed._acted_at = True, early.signum, early._acted_at
    return _installed


def adopt(ck) -> StopFlag:
    """The flag :func:`install` made (a signal during start-up is in it), or a new one (a caller that runs the
    loop without the launcher, e.g. a test)."""
    global _installed
    flag, _installed = _installed, None
    return flag if flag is not None else StopFlag(ck.save_on_signal, ck.exit_signal)


def uninstall(flag: StopFlag) -> None:
    """Undo :func:`install` (at the rank's end: the handlers before it, no flag left to adopt)."""
    global _installed
    flag.restore()
    if _installed is flag:
        _installed = None
