"""Output directories: one job at a time on a --save (a second writer refused in one line, a dead owner's
lock taken over), and unwritable --save / --log-dir refused before any process starts."""
from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile

import pytest

from omnitron.core.config.parallel import ConfigError
from omnitron.core.training import outputs
from omnitron.core.training.arguments import parse_settings
from omnitron.testing.faults import start, tiny_train_args, wait_gone

HOLD = ("import sys, time\nfrom omnitron.core.training.outputs import acquire\n"
        "acquire('--save', sys.argv[1])\nprint('held', flush=True)\ntime.sleep(120)\n")


def _holder(directory) -> subprocess.Popen:
    """A process that holds ``directory``'s lock until killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_writer_is_refused_then_a_dead_owners_lock_is_taken_over(tmp_path):
    save = tmp_path / "ck"
    holder = _holder(save)
    try:
        proc = start(tiny_train_args(tmp_path, "--train-iters", "1", "--save", str(save)))
        out, _ = proc.communicate(timeout=120)
        lines = out.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, out
        assert lines[0].startswith(f"omnitron train: error: --save {save} is in use by another job: pid "
                                   f"{holder.pid} on {socket.gethostname()}"), out
        assert not os.path.exists(save / "latest") and not os.path.exists(tmp_path / "logs" / "metrics.jsonl")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    wait_gone([holder.pid], 10)
    fd = outputs.acquire("--save", str(save))  # the kernel dropped the dead owner's lock
    try:
        assert json.loads((save / outputs.LOCK_NAME).read_text())["pid"] == os.getpid()
        with pytest.raises(ConfigError, match="already in use by this process"):
            outputs.acquire("--save", str(save))
    finally:
        outputs.release(fd)
    assert (save / outputs.LOCK_NAME).read_text() == ""


def test_without_record_locks_the_recorded_owner_decides(tmp_path, monkeypatch):
    """A filesystem without record locks: a live owner (or another host's) refuses, a dead pid on this host
    is a stale lock and is taken over."""
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = tmp_path / outputs.LOCK_NAME
    host = socket.gethostname()
    for owner, refused in (({"host": host, "pid": os.getppid(), "start": outputs._start_time(os.getppid())}, True),
                           ({"host": host + "-elsewhere", "pid": dead.pid}, True),
                           ({"host": host, "pid": os.getppid(), "start": "1"}, False),  # pid reused since
                           ({"host": host, "pid": dead.pid}, False)):
        lock.write_text(json.dumps(owner))
        if refused:
            with pytest.raises(ConfigError, match=f"in use by another job: pid {owner['pid']} on {owner['host']}"):
                outputs.acquire("--save", str(tmp_path))
        else:
            outputs.release(outputs.acquire("--save", str(tmp_path)))


@pytest.mark.parametrize("flag", ["--save", "--log-dir", "--tensorboard-dir"])
def test_unwritable_output_is_refused_before_launch(tmp_path, monkeypatch, flag):
    from omnitron.core.training.launch import precheck

    base = tiny_train_args(tmp_path)[:-2]  # without its own --log-dir
    shown = "--log-dir" if flag == "--tensorboard-dir" else flag  # Megatron's alias of --log-dir
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match=f"^{shown} .*/f/x: .*/f is a file, not a directory"):
        precheck(parse_settings([*base, flag, str(tmp_path / "f" / "x")], 1))

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    s = parse_settings([*base, flag, str(tmp_path / "new" / "out")], 1)
    with pytest.raises(ConfigError, match=f"^{shown} .*/new/out: not writable \\(it would be made in .*\\): "
                                          f"Read-only file system; give a directory"):
        precheck(s)
