"""--save deleted by something outside the job: a save under way stops in one line saying so (not a traceback,
not a line claiming 'latest' still names the previous checkpoint); the lock the job took is taken again at the
next save, or, when another job took the directory meanwhile, the run stops in one line naming that job."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

from omnitron.core.checkpoint import io
from omnitron.core.config.parallel import ConfigError
from omnitron.core.training import outputs


def _save(d: str, iteration: int) -> str:
    return io.save_checkpoint(d, iteration, {"w": torch.randn(3)}, {"model": {}, "layout": {}}, rank=0,
                              world_size=1, barrier=lambda: None)


@pytest.mark.parametrize("where", ["_write_shard", "collect_digests"])
def test_a_save_whose_directory_vanished_says_so(tmp_path, monkeypatch, where):
    """The directory is deleted at a planted point of the save (before a shard is written; before the commit
    reads the shards' digests). Fails without the fix: "saving iter_0000002 failed (FileNotFoundError ...); ...
    'latest' still names the previous checkpoint" (false: it went with the directory), and "its writer left no
    sha256 digest; the shard was not written completely" (a damaged-write line)."""
    d = str(tmp_path / "save")
    _save(d, 1)
    owner = io.integrity if where == "collect_digests" else io
    original = getattr(owner, where)

    def planted(*args):
        shutil.rmtree(d)
        return original(*args)

    monkeypatch.setattr(owner, where, planted)
    with pytest.raises(io.SaveDirGone) as err:
        _save(d, 2)
    line = str(err.value)
    assert "\n" not in line
    assert f"--save {d} was deleted while saving iter_0000002" in line, line
    assert "latest" not in line and "digest" not in line, line
    assert "and with it every checkpoint the directory held" in line and "previous" not in line, line


@pytest.mark.parametrize("before", [0, 1, 2])
def test_a_save_whose_tmp_dir_vanished_says_so(tmp_path, monkeypatch, before):
    """Only ``iter_N.tmp`` deleted (a cleaner sweeping *.tmp): the line names it, not the whole --save, and names
    the newest checkpoint left (``before`` saved first) as the one to resume from with --load, or says there is
    none. Fails without the fix: "resume with --load from a checkpoint that is left", naming none."""
    import random

    d = str(tmp_path / "save")
    its = sorted(random.sample(range(1, 1000), before + 1))
    for it in its[:-1]:
        _save(d, it)
    original = io._write_shard

    def planted(tmp, rank, shard):
        shutil.rmtree(tmp)
        return original(tmp, rank, shard)

    monkeypatch.setattr(io, "_write_shard", planted)
    name = io.iter_dir_name(its[-1])
    with pytest.raises(io.SaveDirGone) as err:
        _save(d, its[-1])
    line = str(err.value)
    assert "\n" not in line and f"{name}.tmp under --save {d} was deleted while saving {name}" in line, line
    if before:
        assert f"The previous checkpoint, {io.iter_dir_name(its[-2])}, is intact: resume from it with --load {d}" \
               in line, line
        assert io.find_latest(d) == os.path.join(d, io.iter_dir_name(its[-2]))  # what --load d resumes from
    else:
        assert "--save holds no complete checkpoint" in line and "previous" not in line, line


def _other_job(d: str) -> subprocess.Popen:
    """A second process that takes ``d``'s lock and holds it until its stdin closes."""
    code = ("import sys; from omnitron.core.training import outputs; outputs.acquire('--save', sys.argv[1]); "
            "print('held', flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code, d], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout.readline().strip() == "held", proc.stdout.read()
    return proc


@pytest.mark.parametrize("remove", ["directory", "lock file"])
def test_a_removed_lock_is_taken_again_at_the_next_save(tmp_path, caplog, remove):
    """Fails without the fix: nothing noticed the removal, and a second job took --save under the running one."""
    d = str(tmp_path / "save")
    fd = outputs.acquire("--save", d)
    try:
        held = outputs.lock_identity(d)
        assert outputs.recheck_lock("--save", d, held) == held  # untouched: nothing said, nothing done
        shutil.rmtree(d) if remove == "directory" else os.remove(os.path.join(d, outputs.LOCK_NAME))
        with caplog.at_level(logging.WARNING, logger="omnitron.train"):
            now = outputs.recheck_lock("--save", d, held)
        assert now == outputs.lock_identity(d) and now != held
        what = "the directory was deleted" if remove == "directory" else "omnitron.lock was removed"
        assert f"--save {d}: {what} during this run" in caplog.text, caplog.text
        code = "import sys; from omnitron.core.training import outputs; outputs.acquire('--save', sys.argv[1])"
        other = subprocess.run([sys.executable, "-c", code, d], capture_output=True, text=True, timeout=60)
        assert other.returncode != 0 and f"pid {os.getpid()}" in other.stderr, other.stderr
    finally:
        outputs.release(fd)
        for path, held_fd in list(outputs._held.items()):  # the lock recheck_lock took for this process
            if os.path.dirname(path) == os.path.realpath(d):
                outputs.release(held_fd)


def test_another_job_on_the_directory_since_stops_the_run(tmp_path):
    """The lock removed, and another job took --save before this one's next save: one line naming that job."""
    d = str(tmp_path / "save")
    fd = outputs.acquire("--save", d)
    try:
        held = outputs.lock_identity(d)
        os.remove(os.path.join(d, outputs.LOCK_NAME))
        other = _other_job(d)
        try:
            with pytest.raises(ConfigError) as err:
                outputs.recheck_lock("--save", d, held)
        finally:
            other.communicate("", timeout=60)
    finally:
        outputs.release(fd)
    line = str(err.value)
    assert "omnitron.lock was removed during this run, and another job has taken it since" in line, line
    assert f"pid {other.pid}" in line and "stops without saving" in line, line
