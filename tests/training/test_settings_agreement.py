"""Ranks started with different settings (nodes launched with different flags) stop in one line before any work.

The store protocol is run by threads over a real TCPStore (one client each, as ranks on several hosts); the whole
path by two torchrun agents of one rank each, as two nodes (``--nnodes 2 --node-rank 0/1``) with different flags.
"""
from __future__ import annotations

import datetime
import os
import random
import subprocess
import sys
import threading
import time
import types

import pytest
import torch
import torch.distributed as dist

from omnitron.core.config.parallel import ConfigError, ParallelConfig
from omnitron.core.parallel.grid import rank_grid
from omnitron.core.training.agreement import SEES_SAVE, SOFTWARE, canonical, check_same_settings, software
from omnitron.core.training.arguments import parse_settings
from omnitron.testing.faults import on_own_disk, private_mount_works
from omnitron.testing.ports import free_port

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "2", "--num-workers", "0"]


def _run_ranks(argvs: list[list[str]], sees_save: list[bool] | None = None,
               softwares: list[dict] | None = None) -> list[BaseException | None]:
    """check_same_settings on one thread per rank (rank r parses ``argvs[r]``; ``sees_save[r]``: whether it sees
    rank 0's mark in --save; ``softwares[r]``: its software); what each raised."""
    world = len(argvs)
    host = dist.TCPStore("127.0.0.1", 0, world, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    values = [canonical(parse_settings(a, world_size=world)) for a in argvs]
    for v, seen in zip(values, sees_save or []):
        v[SEES_SAVE] = seen
    for v, versions in zip(values, softwares or []):
        v[SOFTWARE] = versions
    got: list[BaseException | None] = [None] * world

    def rank(r: int) -> None:
        store = dist.PrefixStore("job/", dist.TCPStore("127.0.0.1", host.port, world, False,
                                                       datetime.timedelta(seconds=30)))
        try:
            check_same_settings(store, r, world, values[r], limit_s=30.0)
        except BaseException as err:  # noqa: BLE001 - the test inspects it
            got[r] = err

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank still waits"
    return got


def test_a_different_seed_on_one_node_stops_every_rank_naming_the_flag():
    seed = random.randrange(1, 10**6)
    other = seed + random.randrange(1, 1000)
    argvs = [BASE + ["--seed", str(s)] for s in (seed, seed, other, other)]  # node 1 (ranks 2, 3) differs
    got = _run_ranks(argvs)
    assert all(isinstance(e, ConfigError) for e in got), got
    lines = {str(e) for e in got}
    assert len(lines) == 1, lines  # the same line on every rank
    line = lines.pop()
    assert f"ranks 2, 3 of 4 differ from rank 0): --seed {other} on rank 2, {seed} on rank 0." in line, line
    assert "\n" not in line


def test_several_flags_are_named_the_rest_counted():
    got = _run_ranks([BASE, BASE + ["--tensor-model-parallel-size", "2", "--lr", "0.5", "--seed", "3",
                                    "--data-cache-path", "/elsewhere", "--clip-grad", "0.3"]])
    line = str(got[1])
    assert all(isinstance(e, ConfigError) and str(e) == line for e in got), got
    # sorted by setting name: the first three, then a count of the others
    assert "(rank 1 of 2 differ from rank 0): --clip-grad 0.3 on rank 1, 1.0 on rank 0; --data-cache-path " \
           "/elsewhere on rank 1, (unset) on rank 0; --lr 0.5 on rank 1, " in line, line
    assert line.endswith(" and 2 more. Start every node with the same flags and config file"), line


def test_equal_settings_spelled_differently_agree():
    """A flag given at its default on one node and left out on the other, and the node-local settings
    (processes and threads per node, the config file's name) are no difference."""
    assert _run_ranks([BASE, BASE + ["--seed", "1234", "--nproc-per-node", "3", "--threads-per-process", "2"],
                       BASE, BASE]) == [None] * 4


def test_a_save_directory_a_node_does_not_share_is_named():
    save = f"/shared{random.randrange(10**6)}/ck"
    got = _run_ranks([BASE + ["--save", save]] * 4, sees_save=[True, True, False, False])
    line = str(got[0])
    assert all(isinstance(e, ConfigError) and str(e) == line for e in got), got
    assert line.startswith(f"--save {save} is not one directory shared by every node: ranks 2, 3 of 4 do not see "
                           "the file rank 0 made in it"), line


def test_a_different_torch_on_one_node_stops_every_rank_naming_the_versions(monkeypatch):
    mine = software()
    monkeypatch.setattr(torch, "__version__", f"2.{random.randrange(1, 99)}.0+other")
    theirs = software()
    got = _run_ranks([BASE] * 4, softwares=[mine, mine, theirs, theirs])
    line = str(got[0])
    assert all(isinstance(e, ConfigError) and str(e) == line for e in got), got
    assert line == (f"the ranks run different software (ranks 2, 3 of 4 differ from rank 0): torch {torch.__version__} "
                    f"on rank 2, {mine['torch']} on rank 0. Install the same omnitron, torch and C++ extensions "
                    f"(python setup.py build_ext) on every node"), line


def test_an_extension_built_from_other_sources_differs_one_built_alike_does_not(monkeypatch):
    """The extensions' entry: their functions' names and signatures (pybind's docstrings), not the file's bytes."""
    def build(*signatures):
        module = types.ModuleType("omnitron._sim")
        for i, doc in enumerate(signatures):
            fn = types.FunctionType((lambda: None).__code__, {})
            fn.__doc__ = doc
            setattr(module, f"op{i}", fn)
        monkeypatch.setitem(sys.modules, "omnitron._sim", module)
        return software()["omnitron._sim"]

    n = random.randrange(1, 5)
    docs = [f"op{i}(arg0: Tensor, arg1: float) -> Tensor" for i in range(n)]
    first = build(*docs)
    assert first.startswith(f"{n} ops #") and build(*docs) == first
    assert build(*docs[:-1], docs[-1].replace("float", "int")) != first  # a signature changed
    assert build(*docs, "extra() -> None").startswith(f"{n + 1} ops #")


TWO_NODES_TIMEOUT_S = 150


def _two_nodes(tmp_path, node_args, wrap=lambda node, argv: argv):
    """Two torchrun agents (--nnodes 2, one rank each) of ``omnitron train BASE + node_args[node]``; each
    ``(returncode, output)``. ``wrap(node, argv)``: the command that runs node's torchrun (a mount namespace)."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen(wrap(node, [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                                          "--nproc-per-node", "1", "--node-rank", str(node), "--master-addr",
                                          "127.0.0.1", "--master-port", str(port), "--monitor-interval", "0.2", "-m",
                                          "omnitron.train", *BASE, "--no-tensorboard", *node_args[node]]),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=str(tmp_path))
             for node in (0, 1)]
    try:
        outs = [p.communicate(timeout=TWO_NODES_TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, out) for p, out in zip(procs, outs)]


def _last_line(out: str) -> str:
    return [s.strip() for s in out.splitlines() if s.strip() and set(s.strip()) != {"="}][-1]


@pytest.mark.slow
def test_two_torchrun_nodes_with_different_tensor_parallel_sizes_stop_in_one_line(tmp_path):
    """Two torchrun agents (--nnodes 2, one rank each, as two nodes) given different --tensor-model-parallel-size:
    each node's job ends with exit code 1 and torchrun's report names the flag. Without the check the world of 2
    trains (tp 1 on one node, tp 2 on the other; with --seed it trains silently wrong). About 20 s on 2 cores."""
    save = str(tmp_path / "ck")
    got = _two_nodes(tmp_path, [["--save", save, "--tensor-model-parallel-size", str(1 + node)] for node in (0, 1)])
    line = ("the ranks were started with different settings (rank 1 of 2 differ from rank 0): "
            "--tensor-model-parallel-size 2 on rank 1, 1 on rank 0.")
    for node, (code, out) in enumerate(got):
        assert code == 1, out[-3000:]
        last = _last_line(out)
        assert last.startswith(f"traceback : omnitron train: error: rank {node} (pid "), out[-3000:]
        assert line in last, last
    assert not os.path.exists(tmp_path / "ck" / "latest")  # no step was taken, nothing saved


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux") or not private_mount_works(),
                    reason="needs a mount namespace (unshare -m) to give one node a disk of its own")
def test_a_node_whose_save_is_its_own_disk_stops_before_training(tmp_path):
    """Node 1's torchrun runs in a mount namespace with a tmpfs over --save (a node-local disk at the same path):
    both nodes stop before the first step, naming --save. Without the check the job trained until its first save
    and stopped there on "rank_00001.pt: its writer left no sha256 digest". About 20 s on 2 cores."""
    save = tmp_path / "ck"
    save.mkdir()

    got = _two_nodes(tmp_path, [["--save", str(save), "--save-interval", "1"]] * 2,
                     lambda node, argv: on_own_disk(str(save), argv) if node == 1 else argv)
    for node, (code, out) in enumerate(got):
        assert code == 1, out[-3000:]
        assert f"--save {save} is not one directory shared by every node: rank 1 of 2 does not see the file rank 0 " \
               "made in it" in _last_line(out), out[-3000:]
    assert sorted(os.listdir(save)) == ["omnitron.lock"]  # no checkpoint begun, rank 0's mark removed


def _two_nodes_running(tmp_path, source: str, node_args):
    """:func:`_two_nodes` where torchrun runs the script ``source`` (which plants a difference, then runs
    ``omnitron.train``) in place of ``-m omnitron.train``."""
    script = tmp_path / "planted.py"
    script.write_text(source)

    def run_script(node, argv):
        at = argv.index("omnitron.train")
        return argv[:at - 1] + [str(script)] + argv[at + 1:]

    return _two_nodes(tmp_path, node_args, run_script)


OTHER_VERSION = """import os, sys
import omnitron
if os.environ["RANK"] == "1":  # node 1 runs another omnitron release
    omnitron.__version__ = "0.0.1-other"
from omnitron.train import main
sys.exit(main())
"""


@pytest.mark.slow
def test_two_torchrun_nodes_running_different_omnitron_versions_stop_in_one_line(tmp_path):
    """Node 1's omnitron reports another version: both nodes stop before the first step, naming the versions.
    About 20 s on 2 cores."""
    got = _two_nodes_running(tmp_path, OTHER_VERSION, [["--save", str(tmp_path / "ck")]] * 2)
    from omnitron import __version__

    line = (f"the ranks run different software (rank 1 of 2 differ from rank 0): omnitron 0.0.1-other on rank 1, "
            f"{__version__} on rank 0. Install the same omnitron, torch and C++ extensions (python setup.py "
            f"build_ext) on every node")
    for node, (code, out) in enumerate(got):
        assert code == 1, out[-3000:]
        last = _last_line(out)
        assert last.startswith(f"traceback : omnitron train: error: rank {node} (pid ") and last.endswith(line), last
    assert not os.path.exists(tmp_path / "ck" / "latest")


PLANTED = """import os, sys
if os.environ["RANK"] == "1":  # a branch only node 1 takes: one group more, before the job's groups
    from omnitron.core.parallel.groups import ParallelGroups
    build = ParallelGroups.build.__func__

    def planted(cls, config, collectives=None, *, backend=None):
        (collectives or backend.collectives).new_group([0, 1], "planted")
        return build(cls, config, collectives, backend=backend)

    ParallelGroups.build = classmethod(planted)
from omnitron.train import main
sys.exit(main())
"""


@pytest.mark.slow
def test_two_torchrun_nodes_creating_different_groups_stop_in_one_line_naming_the_group(tmp_path):
    """Node 1 creates one process group more than node 0 (planted before the job's groups): both nodes stop at
    once, naming the group and the rank, well within the job's timeout. Without the agreement node 1 waited in
    torch's new_group for its default 30 minutes, node 0 in a collective on a group node 1 never made. About
    20 s on 2 cores."""
    start = time.monotonic()
    got = _two_nodes_running(tmp_path, PLANTED, [["--distributed-timeout-minutes", "5"]] * 2)
    built = "; ".join(f"{name} [0, 1]" for name, lists in rank_grid(ParallelConfig(), 2).items() if lists == [[0, 1]])
    line = (f"process group creation #1 ({built}): rank 1 of 2 creates other groups (rank 1 creates planted [0, 1]): "
            f"every rank must create the same groups in the same order")
    for node, (code, out) in enumerate(got):
        assert code == 1, out[-3000:]
        last = _last_line(out)
        assert last.startswith(f"traceback : omnitron train: error: rank {node} (pid ") and last.endswith(
            f" stopped: {line}"), out[-3000:]
    assert time.monotonic() - start < 5 * 60, "the deadline (5 minutes) passed: the mismatch was not found at once"
