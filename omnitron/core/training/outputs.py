"""The job's output directories (``--save``, ``--log-dir`` / ``--tensorboard-dir``, ``--wandb-save-dir``):
writable before any process starts, and written by one job at a time.

- :func:`check_writable`: each directory (or, when it does not exist yet, its nearest existing ancestor)
  takes a probe file, so a read-only or foreign location is refused in one line by the launcher instead of
  at the first save, after the work it was to keep.
- :func:`lock_outputs`: an exclusive lock on ``--save`` (and on a ``--log-dir``, and a
  ``--non-persistent-global-ckpt-dir`` that non-persistent saves write, elsewhere: :func:`locked_dirs`), held by the
  launcher (or, under torchrun, by rank 0) for the job's life. Two jobs on one directory would interleave
  their checkpoints and share ``metrics.jsonl``; the second is refused in one line naming the first's host
  and pid. The lock is ``fcntl.lockf`` on ``DIR/omnitron.lock`` (released by the kernel when its process
  dies, however it dies; across hosts on NFS through its lock manager); the file records the owner's host,
  pid and start time for the message. Where the filesystem has no record locks (``ENOLCK``, ``EOPNOTSUPP``)
  the recorded owner decides alone: a dead pid on this host (or a reused one: another start time) is a
  stale lock and is taken over; a live one, or one on another host, refuses (best effort: two jobs that
  start in the same instant on such a filesystem can both pass).
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import tempfile
import time

from omnitron.core.config.parallel import ConfigError

log = logging.getLogger("omnitron.train")
LOCK_NAME = "omnitron.lock"
_NO_RECORD_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_held: dict[str, int] = {}
"""Real paths of the locks this process holds -> their descriptors (POSIX record locks are per process:
a second ``lockf`` from the same process would succeed, so the process keeps its own count)."""


def output_dirs(settings) -> list[tuple[str, str]]:
    """``(flag, directory)`` of every output directory given on the command line (none for the inference jobs
    that :func:`~omnitron.core.training.launch.launch` also runs)."""
    ck, lg = getattr(settings, "checkpoint", None), getattr(settings, "logging", None)
    given = [("--save", getattr(ck, "save", None)), ("--log-dir", getattr(lg, "log_dir", None)),
             ("--non-persistent-global-ckpt-dir", _non_persistent_dir(ck)),
             ("--wandb-save-dir", getattr(lg, "wandb_save_dir", None))]
    return [(flag, path) for flag, path in given if path]


def _non_persistent_dir(ck) -> str | None:
    """--non-persistent-global-ckpt-dir when non-persistent saves write it (its default lies in --save)."""
    on = getattr(ck, "non_persistent_save_interval", None) and getattr(ck, "save", None)
    return getattr(ck, "non_persistent_global_ckpt_dir", None) if on else None


def locked_dirs(settings) -> list[tuple[str, str]]:
    """``(flag, directory)`` that :func:`lock_outputs` locks: every output directory but wandb's (wandb's folder is
    wandb's), each once; the non-persistent directory not when inside --save (--save's lock covers it)."""
    out, save = [], None
    for flag, path in output_dirs(settings):
        real = os.path.realpath(path)
        inside = flag.startswith("--non-") and save is not None and (real + os.sep).startswith(save + os.sep)
        if flag != "--wandb-save-dir" and not inside and real not in (os.path.realpath(p) for _, p in out):
            out.append((flag, path))
        save = real if flag == "--save" else save
    return out


def check_writable(settings) -> None:
    """Every output directory can be written (raises ConfigError naming the flag and why not)."""
    for flag, path in output_dirs(settings):
        probe_writable(flag, path)


def probe_writable(flag: str, path: str, *, shown: str | None = None,
                   fix: str = "give a directory this job can write") -> None:
    """Create and remove a file in ``path`` (or, when it does not exist yet, a directory in its nearest
    existing ancestor, where it would be made): ``os.access`` misses read-only mounts for root, ACLs, quotas.
    ``shown``: the value the user gave ``flag``, when ``path`` is derived from it (a file's directory);
    ``fix``: the remedy the error names."""
    target = os.path.abspath(path)
    while not os.path.exists(target):
        target = os.path.dirname(target)
    if not os.path.isdir(target):
        raise ConfigError(f"{flag} {shown or path}: {target} is a file, not a directory; {fix}")
    try:
        if target == os.path.abspath(path):
            fd, name = tempfile.mkstemp(prefix=".omnitron-probe-", dir=target)
            os.close(fd)
            os.remove(name)
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".omnitron-probe-", dir=target))
    except OSError as err:
        where = "" if target == os.path.abspath(path) else f" (it would be made in {target})"
        raise ConfigError(f"{flag} {shown or path}: not writable{where}: {err.strerror or err}; {fix}") from None


# ---- the lock ------------------------------------------------------------------------------
def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux ``/proc``; None elsewhere): tells a
    live owner from a new process that reused its pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid()),
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def _read_owner(fd: int) -> dict | None:
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        owner = json.loads(os.read(fd, 4096).decode() or "null")
    except (ValueError, UnicodeDecodeError):
        return None
    return owner if isinstance(owner, dict) else None


def _alive(owner: dict) -> bool:
    """Whether the recorded owner may still run: another host's cannot be checked (assumed alive)."""
    if owner.get("host") != socket.gethostname():
        return True
    pid = int(owner.get("pid", 0))
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process
    start = _start_time(pid)
    return start is None or owner.get("start") in (None, start)


def _describe(owner: dict | None) -> str:
    if not owner:
        return "another job (its owner is being written)"
    return f"pid {owner.get('pid')} on {owner.get('host')} (since {owner.get('since', '?')})"


def _record_lock(fd: int) -> bool | None:
    """Try the exclusive record lock: True taken, False held by another process, None unsupported here."""
    import fcntl

    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as err:
        if err.errno in (errno.EACCES, errno.EAGAIN):
            return False
        if err.errno in _NO_RECORD_LOCKS:
            return None
        raise


def acquire(flag: str, directory: str) -> int:
    """Lock ``directory`` for this process (made if missing); its descriptor. ConfigError when another job
    holds it."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.realpath(os.path.join(directory, LOCK_NAME))
    if path in _held:
        raise ConfigError(f"{flag} {directory} is already in use by this process; give each run its own {flag}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        taken = _record_lock(fd)
        owner = _read_owner(fd)
        if taken is False or (taken is None and owner is not None and _alive(owner)):
            raise ConfigError(f"{flag} {directory} is in use by another job: {_describe(owner)}; wait for it to "
                              f"end or give another {flag} (a stale lock: delete {path})")
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_owner()).encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    _held[path] = fd
    return fd


def release(fd: int) -> None:
    """Clear the owner record and drop the lock."""
    for path, held in list(_held.items()):
        if held == fd:
            del _held[path]
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
    os.close(fd)


def lock_identity(directory: str) -> tuple[int, int] | None:
    """``(device, inode)`` of ``directory``'s lock file (None: there is none)."""
    try:
        st = os.stat(os.path.join(directory, LOCK_NAME))
    except OSError:
        return None
    return st.st_dev, st.st_ino


def recheck_lock(flag: str, directory: str, held: tuple[int, int]) -> tuple[int, int]:
    """At a save: whether ``directory``'s lock file is still the one this job took (``held``:
    :func:`lock_identity` then). Removed (the file, or the whole directory, deleted by something outside the
    job), another job could take the directory: say so and take the lock again for this process (held until
    :func:`lock_outputs` ends, or the process exits); another job's lock there now raises ConfigError in one line
    (this job must not mix its checkpoints with that job's). Returns the identity of the lock held now."""
    if lock_identity(directory) == held:
        return held
    gone = not os.path.isdir(directory)
    what = "the directory was deleted" if gone else f"{LOCK_NAME} was removed"
    path = os.path.realpath(os.path.join(directory, LOCK_NAME))
    _held.pop(path, None)  # the deleted file's descriptor stays with its holder (released as before)
    try:
        acquire(flag, directory)
    except ConfigError:
        try:
            with open(path, "rb") as f:
                owner = json.loads(f.read(4096).decode() or "null")
        except (OSError, ValueError, UnicodeDecodeError):
            owner = None
        raise ConfigError(f"{flag} {directory}: {what} during this run, and another job has taken it since "
                          f"({_describe(owner if isinstance(owner, dict) else None)}); this run stops without saving "
                          f"rather than mix its checkpoints with that job's: give it another {flag} and resume with "
                          f"--load from its last checkpoint") from None
    log.warning("%s %s: %s during this run (by something outside it), so another job could have taken it: took "
                "the lock again%s", flag, directory, what, "; the checkpoints saved before are gone" if gone else "")
    return lock_identity(directory)


@contextlib.contextmanager
def lock_outputs(settings):
    """Hold the locks of :func:`locked_dirs` while the block runs; at its end release them, and those
    :func:`recheck_lock` took again for the same directories (an in-process caller's next run may use them)."""
    fds, paths = [], []
    try:
        for flag, path in locked_dirs(settings):
            fds.append(acquire(flag, path))
            paths.append(os.path.realpath(os.path.join(path, LOCK_NAME)))
        yield
    finally:
        for fd in fds:
            release(fd)
        for path in paths:
            if path in _held:
                release(_held[path])
