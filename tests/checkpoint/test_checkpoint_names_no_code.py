"""A checkpoint's ``metadata.json`` never makes omnitron import the modules it names (issue 39).

The metadata records ``config.model_family_module`` (the ``--model-family-module`` of the run that saved
it). A crafted checkpoint names a module ``evil_family`` placed in the working directory (on the path,
as ``python -m`` puts it) whose import creates a marker file. Reading the checkpoint (inspect, generate,
export) must not create the marker: a registered family (``gpt``) loads without the module, an unknown
one is refused in one line that names ``--model-family-module``; given on the command line, the module
is imported (the user's choice), which the marker shows.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from omnitron.cli import main as cli
from omnitron.core.models.family import MODULES_ENV

EVIL = "evil_family_39"


@pytest.fixture
def crafted(tmp_path, monkeypatch):
    """(checkpoint dir, marker path, edit(model_type)): a tiny GPT checkpoint whose metadata names ``EVIL``,
    with ``EVIL.py`` in the working directory, which is on sys.path."""
    from omnitron.core.checkpoint.hf import write_weights_checkpoint
    from omnitron.core.checkpoint.reshard import Layout
    from omnitron.core.models.gpt.presets import gpt2_tiny
    from omnitron.core.models.gpt.model import GPTModel
    from omnitron.core.models.gpt.state import gather_full_state
    from omnitron.core.parallel.groups import ParallelGroups

    cfg = gpt2_tiny(num_layers=1, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, vocab_size=64,
                    seq_length=8, max_position_embeddings=8)
    model = GPTModel(cfg, ParallelGroups.single(), seed=int.from_bytes(os.urandom(2), "little"))
    path = write_weights_checkpoint(gather_full_state(model, model.groups), cfg, str(tmp_path / "ck"), Layout(),
                                    config={"tokenizer_type": "NullTokenizer", "vocab_size": 63})
    marker = tmp_path / "imported"
    (tmp_path / f"{EVIL}.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(MODULES_ENV, "")
    monkeypatch.delitem(sys.modules, EVIL, raising=False)

    def edit(model_type: str) -> None:
        file = os.path.join(path, "metadata.json")
        meta = json.load(open(file))
        meta["config"].update(model_type=model_type, model_family_module=[EVIL])
        json.dump(meta, open(file, "w"))

    yield path, marker, edit
    sys.modules.pop(EVIL, None)


def _one_line(err: str) -> str:
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_unknown_family_is_refused_and_nothing_imported(crafted, capsys):
    path, marker, edit = crafted
    edit("evil")
    for argv in (["checkpoint", "inspect", path], ["checkpoint", "export", "--load", path, "--out", "x.safetensors"],
                 ["generate", "--load", os.path.dirname(path), "--prompt", "a", "--max-new-tokens", "1"]):
        assert cli(argv) == 2, argv
        err = _one_line(capsys.readouterr().err)
        assert f"model family 'evil' (its run imported {EVIL}) is not registered" in err and \
            "--model-family-module MODULE" in err, err
        assert not marker.exists(), argv
    assert cli(["checkpoint", "inspect", "--model-family-module", EVIL, path]) == 2  # the user's choice: imported
    assert marker.exists() and "is not registered" in capsys.readouterr().err  # (it registers no family)


def test_registered_family_loads_without_the_recorded_module(crafted, capsys):
    path, marker, edit = crafted
    edit("gpt")
    assert cli(["checkpoint", "inspect", path]) == 0
    assert "decoder.layers.0" in capsys.readouterr().out and not marker.exists()


def test_python_m_from_the_modules_directory(crafted):
    """The reported case: ``python -m omnitron checkpoint inspect`` run where the module file lies."""
    path, marker, edit = crafted
    edit("evil")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}
    proc = subprocess.run([sys.executable, "-m", "omnitron", "checkpoint", "inspect", path], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "is not registered" in _one_line(proc.stderr) and not marker.exists()
