"""``omnitron serve --tensor-model-parallel-size 2``: rank 0 answers HTTP, both ranks compute, the answers are the
one-process ones; bad requests (refused by rank 0, or by the library on every rank) leave the job serving; SIGTERM
stops every rank cleanly."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from test_sharded_generate import PROMPTS, _checkpoint, _one_process

from omnitron.testing.sim import requires_sim


def _put(port: int, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/api", data=json.dumps(body).encode(), method="PUT")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _wait_for_port(proc, deadline_s: float) -> int:
    start = time.monotonic()
    while time.monotonic() - start < deadline_s:
        line = proc.stdout.readline()
        if "serving gpt checkpoint" in line:
            return int(line.rsplit(":", 1)[1].split("/")[0])
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"the server did not start: {proc.stderr.read()[-2000:]}")


@contextlib.contextmanager
def serving(root: str, flags: list[str], cwd, backend: str | None = None):
    """``omnitron serve --load root --port 0 FLAGS`` in a child process (this checkout first on its path; ``backend``:
    the ranks' OMNITRON_BACKEND, None: the session's), yielding its port once it listens. After the block the server
    is sent SIGTERM and must exit 0 (a clean shutdown of every rank); on a failure inside the block it is killed."""
    repo = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    if backend is not None:
        env["OMNITRON_BACKEND"] = backend
    proc = subprocess.Popen([sys.executable, "-m", "omnitron", "serve", "--load", root, "--port", "0", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    try:
        yield _wait_for_port(proc, 240)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("backend", [None, pytest.param("sim", marks=[pytest.mark.slow, requires_sim()])])
def test_server_under_tensor_parallelism_answers_like_one_process(tmp_path, backend):
    """``backend``: the server ranks' (None: the session's; sim: 100 s on the loaded 2-core machine, 2026-12-03)."""
    root = str(tmp_path / "ck")
    _checkpoint(root)
    want = _one_process(root, {"temperature": 0.0})["text"]
    with serving(root, ["--tensor-model-parallel-size", "2"], tmp_path, backend) as port:
        greedy = {"prompts": PROMPTS, "tokens_to_generate": 10, "temperature": 0.0}
        assert _put(port, greedy) == (200, {"text": want})
        code, body = _put(port, {"prompts": ["1"], "top_k": 2, "top_p": 0.5})  # refused by rank 0 alone
        assert code == 400 and "top_k and top_p together" in body["error"]
        code, body = _put(port, {"prompts": [" ".join(["7"] * 60)], "tokens_to_generate": 2})  # by every rank
        assert code == 400 and "more than the model's context" in body["error"]
        assert _put(port, greedy) == (200, {"text": want})  # both ranks still in step
