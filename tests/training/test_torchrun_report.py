"""Under torchrun, the last line of the job's output names the failing rank and the cause.

torchrun's agent prints its report after the workers' output and after its own traceback; the report's
"Root Cause" block shows the first failed worker's error file (``$TORCHELASTIC_ERROR_FILE``), or "To enable
traceback see ..." without one. A failed omnitron rank writes that file (JSON, as torch's own error handler
writes it) with its one line. The reference is torch's own reader and formatter (ProcessFailure,
ChildFailedError), and a real torchrun run of two ranks, one of which fails.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from omnitron.core.training import failures

RANK_SCRIPT = """
import os, sys, time
from omnitron.core.training import failures
rank = int(os.environ["RANK"])
if rank == 1:
    try:
        raise ValueError("boom in the data pipeline")
    except ValueError as exc:
        sys.exit(failures.handle(exc, rank, lambda reason: None))
time.sleep(20)  # rank 0 is still working when rank 1 fails: torchrun's agent ends it
"""


def _report_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and set(line.strip()) != {"="}]


def test_error_file_is_what_torchrun_reads(tmp_path, monkeypatch):
    """handle() on rank 1 and a peer reaction on rank 0 at the same moment: torch's reader takes rank 1 as the
    root cause and its formatted report ends with rank 1's one line."""
    files = {r: str(tmp_path / f"error_{r}.json") for r in (0, 1)}
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", files[1])
    assert failures.handle(ValueError("boom"), 1, lambda reason: None) == 1
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", files[0])
    failures.handle(RuntimeError("Connection reset by peer"), 0, lambda reason: None)
    with open(files[1]) as f:
        assert json.load(f)["message"]["message"].endswith(f"rank 1 (pid {os.getpid()}) failed: ValueError: boom")
    got = {r: ProcessFailure(local_rank=r, pid=os.getpid(), exitcode=1, error_file=files[r]) for r in (0, 1)}
    err = ChildFailedError("omnitron.train", {0: got[0], 1: got[1]})  # rank 0 first: torch's order of keys
    assert err.get_first_failure()[0] == 1
    last = _report_lines(err.format_msg())[-1]
    assert last == f"traceback : omnitron train: error: rank 1 (pid {os.getpid()}) failed: ValueError: boom", last


@pytest.mark.slow
def test_torchrun_output_ends_with_the_cause(tmp_path):
    """A real torchrun job of two ranks: its output's last line is rank 1's cause, after torchrun's traceback
    (about 30 s on the 2-core machine under load: torch imported by the agent and both ranks)."""
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--monitor-interval", "0.1", str(script)], capture_output=True, text=True, timeout=120,
                          env=env, cwd=str(tmp_path))
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = _report_lines(proc.stdout + proc.stderr)
    assert "Traceback (most recent call last):" in proc.stderr  # torchrun's own, before its report
    assert lines[-1].startswith("traceback : omnitron train: error: rank 1 (pid "), proc.stderr[-3000:]
    assert lines[-1].endswith(") failed: ValueError: boom in the data pipeline"), lines[-1]


def test_bad_layout_under_torchrun_is_the_reports_last_line(tmp_path, monkeypatch, capsys):
    """A layout the world does not divide, found before any work on a torchrun rank (world 4 of two nodes, pp 3):
    its one line goes to stderr and into the agent's error file, so torch's report (its own reader and
    formatter) ends with it instead of "To enable traceback see ..."."""
    from omnitron.commands.train import main_from_dict

    error_file = str(tmp_path / "error_1.json")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", error_file)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    given = {"model": "gpt2_tiny", "mock_data": True, "num_layers": 6, "pipeline_model_parallel_size": 3}
    assert main_from_dict(given) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "world size 4 is not a multiple of" in err[0], err
    failure = ProcessFailure(local_rank=1, pid=os.getpid(), exitcode=2, error_file=error_file)
    last = _report_lines(ChildFailedError("omnitron.train", {1: failure}).format_msg())[-1]
    assert last == f"traceback : omnitron train: error: rank 1 (pid {os.getpid()}) stopped: " + \
        err[0].removeprefix("omnitron train: error: "), last
