"""Checkpoint commands refuse bad input and faults in one line, before any work is lost.

- ``checkpoint convert`` (and the other writers of an ``iter_N``: ``import-hf``, ``import-megatron``,
  ``export-megatron``) never replace a checkpoint: a ``--save`` that already holds the ``iter_N`` it would
  write, or that is (or resolves to) the ``--load`` directory, is refused before anything is written; the
  checkpoint there keeps every byte and ``latest``.
- A rank file torch's weights-only loader refuses (a pickle calling ``os.system``; a raw protocol-4 pickle)
  is reported in one line as refused as unsafe, naming what was refused, never advising
  ``weights_only=False``, with no warning from torch on stderr; the reason is read robustly from the wording
  of torch 2.4 to 2.15.
- A ``metadata.json`` that is valid JSON but has a field of the wrong type is refused naming the file and
  the field.
- ``checkpoint export --out`` in a place that cannot be written (under a file, in /proc, a directory) is
  refused before the checkpoint is read.

Checkpoints are tiny GPT models made in-process with fresh random weights.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import warnings

import pytest
import torch

from omnitron.cli import main as cli
from omnitron.core.checkpoint import CheckpointError
from omnitron.core.checkpoint.io import read_metadata, read_shard, torch_load_reason, write_checkpoint

SEED = int.from_bytes(os.urandom(4), "little")


def _one_line(text: str) -> str:
    text = text.strip()
    assert text and "\n" not in text, text
    return text


def _checkpoint(save: str, seed: int, hidden: int = 32, tp: int = 1) -> str:
    """A weights-only omnitron checkpoint (iteration 0) of a tiny GPT with random weights under ``save``."""
    from omnitron.core.checkpoint.hf import write_weights_checkpoint
    from omnitron.core.checkpoint.reshard import Layout
    from omnitron.core.models.gpt.presets import gpt2_tiny
    from omnitron.core.models.gpt.model import GPTModel
    from omnitron.core.models.gpt.state import gather_full_state
    from omnitron.core.parallel.groups import ParallelGroups

    cfg = gpt2_tiny(num_layers=2, hidden_size=hidden, num_attention_heads=4, ffn_hidden_size=2 * hidden,
                    vocab_size=64, seq_length=16, max_position_embeddings=16)
    m = GPTModel(cfg, ParallelGroups.single(), seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g))
    full = {n: t.clone() for n, t in gather_full_state(m, m.groups).items()}
    return write_weights_checkpoint(full, cfg, save, Layout(tp=tp))


def _snapshot(d: str) -> dict:
    """Every file under ``d`` -> its sha256."""
    out = {}
    for root, _, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, d)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


# ---- 1. no writer replaces a checkpoint ----------------------------------------------------------------------
def test_convert_never_overwrites(tmp_path, capsys):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _checkpoint(a, SEED)
    _checkpoint(b, SEED + 1, hidden=64)
    before = _snapshot(a)
    conv = ["checkpoint", "convert", "--target-tensor-model-parallel-size", "2",
            "--target-pipeline-model-parallel-size", "2"]
    os.symlink(a, tmp_path / "link")
    cases = [(["--load", b, "--save", a], "already holds iter_0000000"),  # a typo'd --save: another run's
             (["--load", a, "--save", a], "is the directory --load reads"),
             (["--load", os.path.join(a, "iter_0000000"), "--save", a + "/"], "is the directory --load reads"),
             (["--load", a, "--save", str(tmp_path / "link")], "is the directory --load reads")]
    for flags, said in cases:
        capsys.readouterr()
        assert cli(conv + flags) == 2, flags
        err = _one_line(capsys.readouterr().err)
        assert said in err and "--save" in err and "empty directory" in err, err
        assert _snapshot(a) == before  # every byte, 'latest' too
    # an empty --save converts, and so does a --save holding only other iterations
    assert cli(conv + ["--load", a, "--save", str(tmp_path / "c")]) == 0
    m = read_metadata(str(tmp_path / "c" / "iter_0000000"))
    assert m["layout"]["tensor_model_parallel_size"] == 2
    # the offline writer itself refuses too (whatever command calls it)
    with pytest.raises(CheckpointError, match="already holds iter_0000000"):
        write_checkpoint(a, 0, iter([]), {}, world_size=1)
    assert _snapshot(a) == before


def test_imports_and_megatron_export_never_overwrite(tmp_path, capsys):
    a = str(tmp_path / "a")
    _checkpoint(a, SEED)
    before = _snapshot(a)
    missing = str(tmp_path / "nothing")  # refused before the source is even looked at
    for cmd in (["import-hf", "--hf-dir", missing, "--save", a], ["import-megatron", "--load", missing, "--save", a]):
        capsys.readouterr()
        assert cli(["checkpoint", *cmd]) == 2
        err = _one_line(capsys.readouterr().err)
        assert "--save" in err and "already holds iter_0000000" in err and "empty directory" in err, err
    assert _snapshot(a) == before
    capsys.readouterr()
    assert cli(["checkpoint", "import-megatron", "--load", a, "--save", os.path.join(a, "iter_0000000", "..")]) == 2
    assert "is the directory --load reads" in _one_line(capsys.readouterr().err)
    meg = tmp_path / "meg"
    (meg / "iter_0000000").mkdir(parents=True)
    (meg / "iter_0000000" / "keep").write_text(str(SEED))
    assert cli(["checkpoint", "export-megatron", "--load", a, "--out", str(meg), "--target-tensor-model-parallel-size",
                "1", "--target-pipeline-model-parallel-size", "1"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "--out" in err and "already holds iter_0000000" in err, err
    assert (meg / "iter_0000000" / "keep").read_text() == str(SEED)
    assert _snapshot(a) == before


# ---- 2. a refused pickle is one line, called unsafe --------------------------------------------------------
class _System:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _tamper(path: str, write) -> str:
    """Replace rank 0 of checkpoint ``path`` by ``write(file)`` and record its digest (an attacker can)."""
    shard = os.path.join(path, "rank_00000.pt")
    write(shard)
    meta = json.load(open(os.path.join(path, "metadata.json")))
    meta["checksums"]["rank_00000.pt"] = "sha256:" + hashlib.sha256(open(shard, "rb").read()).hexdigest()
    json.dump(meta, open(os.path.join(path, "metadata.json"), "w"))
    return shard


@pytest.mark.parametrize("kind", ["torch_save", "raw_pickle4"])
def test_refused_pickle_is_one_line_called_unsafe(tmp_path, capfd, kind):
    path = _checkpoint(str(tmp_path / "ck"), SEED)
    marker = tmp_path / f"pwned_{SEED}"
    payload = {"model": _System(str(marker)), "w": torch.randn(3, generator=torch.Generator().manual_seed(SEED))}
    if kind == "torch_save":
        _tamper(path, lambda f: torch.save(payload, f))
    else:
        _tamper(path, lambda f: open(f, "wb").write(pickle.dumps(_System(str(marker)), protocol=4)))
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointError) as err:
            read_shard(path, 0)
    msg = _one_line(str(err.value))
    assert "rank_00000.pt: refused as unsafe by torch's weights-only loader (" in msg, msg
    assert "corrupt" not in msg and "weights_only" not in msg and "trust" not in msg, msg
    named = "GLOBAL " if kind == "torch_save" else "Unsupported operand 149: pickle opcode FRAME"
    assert named in msg and ("system" in msg or kind != "torch_save"), msg
    assert not [w for w in caught if "pickle protocol" in str(w.message)]
    assert capfd.readouterr().err == ""  # no warning, no source line
    assert not marker.exists()


# torch's wrappings of a weights-only refusal across versions (2.4/2.5 legacy, 2.6+ with an unsafe global, 2.6+
# blocked module, an unknown future wording): the reason survives, the advice to load unsafely never does
_WRAPPED = [
    ("Weights only load failed. Re-running `torch.load` with `weights_only` set to `False` will likely succeed, but "
     "it can result in arbitrary code execution. Do it only if you got the file from a trusted source.\nPlease file "
     "an issue with the following so that we can make `weights_only=True` compatible with your use case: "
     "WeightsUnpickler error: Unsupported global: GLOBAL {g} was not an allowed global by default. Please use "
     "`torch.serialization.add_safe_globals([{g}])` to allowlist this global if you trust this class/function.",
     "Unsupported global: GLOBAL {g}"),
    ("Weights only load failed. This file can still be loaded, to do so you have two options, \x1b[1mdo those steps "
     "only if you trust the source of the checkpoint\x1b[0m. \n\t(1) In PyTorch 2.6, we changed the default value "
     "of the `weights_only` argument in `torch.load` from `False` to `True`. Re-running `torch.load` with "
     "`weights_only` set to `False` will likely succeed, but it can result in arbitrary code execution. Do it only "
     "if you got the file from a trusted source.\n\t(2) Alternatively, to load with `weights_only=True` please check "
     "the recommended steps in the following error message.\n\tWeightsUnpickler error: Unsupported global: GLOBAL "
     "{g} was not an allowed global by default.\n\nCheck the documentation of torch.load to learn more about types "
     "accepted by default with weights_only https://pytorch.org/docs/stable/generated/torch.load.html.",
     "Unsupported global: GLOBAL {g}"),
    ("Weights only load failed. In PyTorch 2.6, we changed the default value of the `weights_only` argument in "
     "`torch.load` from `False` to `True`. Re-running `torch.load` with `weights_only` set to `False` will likely "
     "succeed, but it can result in arbitrary code execution. Do it only if you got the file from a trusted "
     "source.\n\n\nTrying to load unsupported GLOBAL {g} whose module {m} is blocked.\n\nCheck the documentation "
     "of torch.load to learn more about types accepted by default with weights_only "
     "https://pytorch.org/docs/stable/generated/torch.load.html.",
     "unsupported GLOBAL {g} whose module {m} is blocked"),
    ("Weights only load failed. Loading with weights_only=False would run code from the file. Do so only for a "
     "trusted source.\nThe pickle asks for {g}, a callable that is not on the allow-list.",
     "The pickle asks for {g}, a callable that is not on the allow-list"),
]


@pytest.mark.parametrize("case", range(len(_WRAPPED)))
def test_refusal_reason_across_torch_wordings(case):
    rng = random.Random(SEED + case)
    m = rng.choice(["posix", "nt", "subprocess", "builtins"])
    g = f"{m}.{rng.choice(['system', 'popen', 'eval', 'getcwd'])}{rng.randrange(100)}"
    text, want = (s.format(g=g, m=m) for s in _WRAPPED[case])
    for err in (pickle.UnpicklingError(text), RuntimeError(text)):
        why = _one_line(torch_load_reason(err))
        assert why == "weights-only refusal: " + want, why
        assert "weights_only" not in why and "False" not in why and "safe_globals" not in why


# ---- 3. metadata.json of the wrong types ----------------------------------------------------------------
BAD = {"layout": "garbage", "iteration": "x", "model": [1, 2], "world_size": 0, "shards": "rank_00000.pt",
       "checksums": ["sha256:00"], "ckpt_format": 3, "consumed_samples": -1, "config": "none"}


@pytest.mark.parametrize("field", [*BAD, "iteration_bool"])
def test_wrong_typed_metadata_names_file_and_field(tmp_path, capsys, field):
    path = _checkpoint(str(tmp_path / "ck"), SEED)
    file = os.path.join(path, "metadata.json")
    meta = json.load(open(file))
    key, value = ("iteration", True) if field == "iteration_bool" else (field, BAD[field])
    meta[key] = value
    json.dump(meta, open(file, "w"))
    with pytest.raises(CheckpointError) as err:
        read_metadata(path)
    msg = _one_line(str(err.value))
    assert msg.startswith(f"{file}: '{key}' is {json.dumps(value)}, not ") and "re-save" in msg, msg
    capsys.readouterr()
    assert cli(["checkpoint", "inspect", str(tmp_path / "ck")]) == 2
    assert f"'{key}' is" in _one_line(capsys.readouterr().err)


def test_train_load_checks_metadata_types(tmp_path):
    """``train --load``'s compatibility check reads the metadata through the same reader."""
    from omnitron.core.checkpoint import check_compatible

    path = _checkpoint(str(tmp_path / "ck"), SEED)
    meta = json.load(open(os.path.join(path, "metadata.json")))
    check_compatible(read_metadata(path), meta["model"], meta["layout"], path)
    meta["layout"] = "garbage"
    json.dump(meta, open(os.path.join(path, "metadata.json"), "w"))
    with pytest.raises(CheckpointError, match="'layout' is \"garbage\", not an object of parallel-layout settings"):
        check_compatible(read_metadata(path), meta["model"], {}, path)


# ---- 4. export --out that cannot be written ----------------------------------------------------------------
def test_export_out_checked_first(tmp_path, capsys):
    a = str(tmp_path / "a")
    _checkpoint(a, SEED)
    (tmp_path / "afile").write_text("x")
    cases = [(str(tmp_path / "afile" / "x.safetensors"), "is a file, not a directory"),
             (str(tmp_path / "afile" / "deeper" / "x.safetensors"), "is a file, not a directory"),
             (str(tmp_path), "is a directory; give the name of the file")]
    if os.path.isdir("/proc"):
        cases.append(("/proc/x.safetensors", "not writable"))
    for out, said in cases:
        for load in (a, str(tmp_path / "nothing")):  # checked before the checkpoint is looked at
            capsys.readouterr()
            assert cli(["checkpoint", "export", "--load", load, "--out", out]) == 2
            err = _one_line(capsys.readouterr().err)
            assert f"--out {out}" in err and said in err, err
    capsys.readouterr()
    assert cli(["checkpoint", "export-hf", "--load", a, "--out", str(tmp_path / "afile")]) == 2
    assert "is a file, not a directory" in _one_line(capsys.readouterr().err)
    out = tmp_path / "new" / "dir" / "m.safetensors"  # a directory that does not exist yet is made
    assert cli(["checkpoint", "export", "--load", a, "--out", str(out)]) == 0
    from safetensors.torch import load_file

    from omnitron.core.checkpoint.reshard import read_full_state

    got, want = load_file(str(out)), read_full_state(os.path.join(a, "iter_0000000"), with_optimizer=False).model
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
