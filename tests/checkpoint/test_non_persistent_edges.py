"""The edges of --non-persistent-ckpt-type global: --use-checkpoint-args reads the checkpoint actually resumed;
a --non-persistent-global-ckpt-dir outside --save is locked like --save; the lock re-taken after a removal is
released at the run's end; --async-save's non-persistent saves never leave a half-written one to be loaded."""
from __future__ import annotations

import logging
import os

import pytest

from omnitron.core.config.parallel import ConfigError
from omnitron.core.training import outputs
from tests.checkpoint.test_save_dir_deleted import _other_job

ARGS = ["--num-layers", "2", "--num-attention-heads", "2", "--seq-length", "16", "--max-position-embeddings", "16",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--num-workers", "0", "--no-tensorboard", "--non-persistent-ckpt-type", "global",
        "--lr", "1e-3"]


def _settings(tmp_path, name, *extra):
    from omnitron.core.training.arguments import parse_settings

    return parse_settings(ARGS + ["--log-dir", str(tmp_path / name), *extra], world_size=1)


def _train(tmp_path, name, *extra):
    from omnitron.backends import get_backend
    from omnitron.core.training.loop import train

    return train(_settings(tmp_path, name, *extra), get_backend("cpu"))["losses"]


def test_use_checkpoint_args_reads_the_checkpoint_resumed(tmp_path):
    """--load ck holds a regular iteration-2 checkpoint of a hidden-32 model and, in ck/non_persistent, a
    non-persistent iteration-2 one of a hidden-64 model: the run resumes the latter (at least as new), so its args
    are the ones taken (Megatron's load_args_from_checkpoint goes through _load_base_checkpoint, which makes the
    same choice). --ckpt-step 2 asks for --load's own iteration 2 (the non-persistent one is not considered).
    Fails without the fix: hidden 32 was read from --load's latest while the hidden-64 checkpoint was loaded."""
    ck = str(tmp_path / "ck")
    _train(tmp_path, "a", "--hidden-size", "32", "--train-iters", "2", "--save", ck)
    np_dir = os.path.join(ck, "non_persistent")  # where --load ck looks for it
    _train(tmp_path, "b", "--hidden-size", "64", "--train-iters", "3", "--save", str(tmp_path / "other"),
           "--non-persistent-save-interval", "1", "--non-persistent-global-ckpt-dir", np_dir)
    assert sorted(os.listdir(np_dir)) == ["iter_0000002", "latest"]
    taken = _settings(tmp_path, "c", "--hidden-size", "48", "--train-iters", "3", "--load", ck, "--use-checkpoint-args")
    assert taken.model.hidden_size == 64
    asked = _settings(tmp_path, "d", "--hidden-size", "48", "--train-iters", "3", "--load", ck, "--use-checkpoint-args",
                      "--ckpt-step", "2")
    assert asked.model.hidden_size == 32
    assert _train(tmp_path, "e", "--hidden-size", "48", "--train-iters", "3", "--load", ck,
                  "--use-checkpoint-args").keys() == {3}  # the hidden-64 checkpoint loads into the model built


def test_a_non_persistent_dir_elsewhere_is_locked(tmp_path):
    """Another job holds the --non-persistent-global-ckpt-dir: refused in one line before any work. Inside --save
    (the default) it is --save's lock that covers it. Fails without the fix: the run started and its non-persistent
    saves went into the other job's directory."""
    from omnitron.core.training.launch import launch
    from omnitron.core.training.outputs import locked_dirs

    np_dir, save = str(tmp_path / "np"), str(tmp_path / "ck")
    other = _other_job(np_dir)  # another job holding it
    try:
        with pytest.raises(ConfigError) as err:
            launch(_settings(tmp_path, "a", "--hidden-size", "32", "--train-iters", "2", "--save", save,
                             "--non-persistent-save-interval", "1", "--non-persistent-global-ckpt-dir", np_dir))
    finally:
        other.communicate("", timeout=60)
    line = str(err.value)
    assert "\n" not in line and f"--non-persistent-global-ckpt-dir {np_dir} is in use by another job: pid " \
        f"{other.pid}" in line, line
    assert sorted(os.listdir(np_dir)) == [outputs.LOCK_NAME] and not os.path.exists(os.path.join(save, "latest"))
    inside = _settings(tmp_path, "b", "--hidden-size", "32", "--train-iters", "2", "--save", save,
                       "--non-persistent-save-interval", "1")
    assert [flag for flag, _ in locked_dirs(inside)] == ["--save", "--log-dir"]
    (tmp_path / "file").write_text("")  # and a directory that cannot be made is refused before the start
    with pytest.raises(ConfigError, match=r"--non-persistent-global-ckpt-dir \S+: \S+file is a file, not a dir"):
        outputs.check_writable(_settings(tmp_path, "c", "--hidden-size", "32", "--train-iters", "2", "--save", save,
                                         "--non-persistent-save-interval", "1", "--non-persistent-global-ckpt-dir",
                                         str(tmp_path / "file" / "np")))


def test_the_non_persistent_dir_cannot_be_save(tmp_path):
    """--non-persistent-global-ckpt-dir naming --save itself (or a path to it) is refused before the start. Fails
    without the fix: the run went on, and its non-persistent save at 3 (which keeps only the newest checkpoint of
    its directory) deleted the regular iter_0000002 of --save (checked by hand: iter_0000003, iter_0000004 left)."""
    save = str(tmp_path / "ck")
    for given in (save, str(tmp_path / "." / "ck") + os.sep):
        with pytest.raises(ConfigError, match="-global-ckpt-dir .* is --save: keeping only the newest"):
            _settings(tmp_path, "a", "--hidden-size", "32", "--train-iters", "4", "--save", save, "--save-interval",
                      "2", "--non-persistent-save-interval", "1", "--non-persistent-global-ckpt-dir", given)


@pytest.mark.parametrize("removed", ["--save", "--non-persistent-global-ckpt-dir"])
def test_a_lock_taken_again_is_released_at_the_runs_end(tmp_path, monkeypatch, caplog, removed):
    """Two in-process runs in a row on one --save (and one non-persistent directory elsewhere); during the first,
    ``removed``'s lock file is deleted before the first save into it, so that save takes the lock again. The second
    run starts (and holds every lock), and no lock stays with this process after it. Fails without the fix: the
    second run was refused, "--save ... is already in use by this process"."""
    from omnitron.core.training import checkpointing
    from omnitron.core.training.launch import launch

    save, np_dir = str(tmp_path / "ck"), str(tmp_path / "np")
    target = save if removed == "--save" else np_dir
    real, removals = checkpointing.recheck_lock, []

    def remove_once(flag, directory, held):
        if directory == target and not removals:
            removals.append(flag)
            os.remove(os.path.join(directory, outputs.LOCK_NAME))
        return real(flag, directory, held)

    monkeypatch.setattr(checkpointing, "recheck_lock", remove_once)
    args = ["--hidden-size", "32", "--train-iters", "3", "--save-interval", "2", "--non-persistent-save-interval", "1",
            "--non-persistent-global-ckpt-dir", np_dir]
    with caplog.at_level(logging.WARNING, logger="omnitron.train"):
        assert launch(_settings(tmp_path, "a", *args, "--save", save)) == 0
    assert removals == [removed] and f"{removed} {target}: omnitron.lock was removed during this run" in caplog.text
    assert launch(_settings(tmp_path, "b", *args, "--save", save, "--load", save)) == 0, caplog.text
    assert "already in use" not in caplog.text
    assert not [p for p in outputs._held if p.startswith(str(tmp_path))], outputs._held
    assert sorted(d for d in os.listdir(save) if d.startswith("iter_")) == ["iter_0000002", "iter_0000003"]


def _write_then_die(target: str, argv: list[str]) -> None:
    """Train ``argv`` (in a process of its own, :func:`run_forked`) until the background write of ``target`` is
    done, then SIGKILL the process before that save's commit."""
    import signal

    from omnitron.backends import get_backend
    from omnitron.core.checkpoint import dist
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    write = dist.write

    def write_then_die(tmp, *args, **kwargs):
        write(tmp, *args, **kwargs)
        if tmp == target:
            os.kill(os.getpid(), signal.SIGKILL)

    dist.write = write_then_die
    train(parse_settings(argv, world_size=1), get_backend("cpu"))


def _weights(out):
    return [{k: v.clone() for k, v in m.state_dict().items()} for m in out["components"].modules]


ASYNC = ["--hidden-size", "32", "--train-iters", "7", "--save-interval", "4", "--non-persistent-save-interval", "3",
         "--ckpt-format", "torch_dist", "--async-save", "--hidden-dropout", "0.1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """ASYNC's run without a kill: its flags and its output."""
    from omnitron.backends import get_backend
    from omnitron.core.training.loop import train

    tmp = tmp_path_factory.mktemp("whole")
    return ASYNC, train(_settings(tmp, "a", *ASYNC, "--save", str(tmp / "ck")), get_backend("cpu"))


@pytest.mark.parametrize("killed", ["non_persistent/iter_0000006", "iter_0000007"])
def test_async_non_persistent_then_regular_killed_between(tmp_path, uninterrupted, killed):
    """--async-save, torch_dist: non-persistent saves at 3 and 6, regular ones at 4 and 7. A process is killed once
    ``killed``'s background write is done and before its commit (the next save's, or the end's): its iter_N.tmp
    stays behind, uncommitted. Resumed, the run loads the newest committed checkpoint -- the regular 4 when the
    non-persistent 6 was cut (the committed non-persistent 3 is older), the non-persistent 6 when the regular 7 was
    -- never the .tmp, and its iterations after that come out bit-exact as in the uninterrupted run (every loss,
    every weight; with dropout, so the RNG streams resume too)."""
    import torch

    from omnitron.backends import get_backend
    from omnitron.core.training.loop import train
    from omnitron.testing.distributed import run_forked

    args, whole = uninterrupted
    ck = str(tmp_path / "ck")
    argv = [*ARGS, "--log-dir", str(tmp_path / "b"), *args, "--save", ck]
    assert run_forked(_write_then_die, os.path.join(ck, killed + ".tmp"), argv) == -9
    assert os.path.isdir(os.path.join(ck, killed + ".tmp")) and not os.path.exists(os.path.join(ck, killed))
    resumed = train(_settings(tmp_path, "c", *args, "--save", ck, "--load", ck), get_backend("cpu"))
    first = 7 if killed == "iter_0000007" else 5
    assert resumed["losses"] == {i: whole["losses"][i] for i in range(first, 8)}, (resumed["losses"], whole["losses"])
    for a, b in zip(_weights(whole), _weights(resumed)):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "weights differ after the resume"
    assert sorted(os.listdir(os.path.join(ck, "non_persistent"))) == ["iter_0000006", "latest"]
