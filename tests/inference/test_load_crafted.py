"""``omnitron generate`` (and the checkpoint commands) on damaged and crafted checkpoints: a safetensors file from
``checkpoint export`` that is truncated or whose metadata is not the export's, and metadata (the safetensors
header's, a checkpoint's metadata.json) declaring a model far larger than the weights stored. Each is refused with
exit code 2 and one line naming the file; the huge model is refused on the meta device, before it is built. The
reference for "accepted" is the untouched export, which generates."""
from __future__ import annotations

import json
import os

import pytest

from omnitron.cli import main as cli


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(checkpoint directory, its safetensors export) of a tiny GPT with fresh random weights."""
    from omnitron.core.checkpoint.hf import write_weights_checkpoint
    from omnitron.core.checkpoint.reshard import Layout
    from omnitron.core.models.gpt.presets import gpt2_tiny
    from omnitron.core.models.gpt.model import GPTModel
    from omnitron.core.models.gpt.state import gather_full_state
    from omnitron.core.parallel.groups import ParallelGroups

    root = tmp_path_factory.mktemp("crafted")
    cfg = gpt2_tiny(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=64,
                    seq_length=16, max_position_embeddings=16)
    seed = int.from_bytes(os.urandom(4), "little")
    full = gather_full_state(GPTModel(cfg, ParallelGroups.single(), seed=seed), ParallelGroups.single())
    ck = write_weights_checkpoint(full, cfg, str(root / "ck"), Layout(),
                                  config={"tokenizer_type": "NullTokenizer", "vocab_size": 63})
    out = str(root / "model.safetensors")
    assert cli(["checkpoint", "export", "--load", str(root / "ck"), "--out", out]) == 0
    return ck, out


def _generate(load: str, capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli(["generate", "--load", load, "--prompt", "1 2 3", "--max-new-tokens", "2"])
    return rc, capsys.readouterr().err.strip()


def _one_line(rc: int, err: str, *names: str) -> None:
    assert rc == 2 and "\n" not in err and "Traceback" not in err, err
    assert all(n in err for n in names), err


def _rewrite_header(src: str, dst: str, **metadata) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(src, "pt") as f:
        meta = {**f.metadata(), **metadata}
    save_file(load_file(src), dst, metadata=meta)


def test_untouched_export_generates(exported, capsys):
    rc, err = _generate(exported[1], capsys)
    assert rc == 0, err


@pytest.mark.parametrize("damage,why", [("truncated", "not a readable safetensors file"),
                                        ("empty", "not a readable safetensors file"),
                                        ("model_not_json", "its metadata is not what `checkpoint export` writes"),
                                        ("model_a_list", "model / config are not JSON objects"),
                                        ("huge", "but the files holding its weights have")])
def test_crafted_safetensors_is_one_line(exported, tmp_path, capsys, damage, why):
    src, path = exported[1], str(tmp_path / "x.safetensors")
    data = open(src, "rb").read()
    if damage in ("truncated", "empty"):
        cut = 0 if damage == "empty" else 1 + int.from_bytes(os.urandom(4), "little") % (len(data) - 1)
        open(path, "wb").write(data[:cut])
    elif damage == "huge":  # ~2**42 parameters declared over a few hundred kilobytes
        from safetensors import safe_open

        with safe_open(src, "pt") as f:
            model = {**json.loads(f.metadata()["model"]), "hidden_size": 2 ** 20, "ffn_hidden_size": 2 ** 22}
        _rewrite_header(src, path, model=json.dumps(model))
    else:
        _rewrite_header(src, path, model="{not json" if damage == "model_not_json" else "[1]")
    _one_line(*_generate(path, capsys), path, why)


@pytest.mark.parametrize("command", ["generate", "export"])
def test_metadata_json_declaring_a_huge_model_is_refused_before_building(exported, tmp_path, capsys, command):
    """metadata.json's model config is what generate / export build: 2**20 hidden over the tiny model's shards is
    refused by comparing the parameter count (on the meta device) with the checkpoint's bytes."""
    import shutil

    ck = str(tmp_path / "ck")
    shutil.copytree(os.path.dirname(exported[0]), ck)
    it = os.path.join(ck, os.path.basename(exported[0]))
    meta = json.load(open(os.path.join(it, "metadata.json")))
    meta["model"].update(hidden_size=2 ** 20, ffn_hidden_size=2 ** 22)
    json.dump(meta, open(os.path.join(it, "metadata.json"), "w"))
    capsys.readouterr()
    if command == "generate":
        rc, err = _generate(ck, capsys)
    else:
        rc = cli(["checkpoint", "export", "--load", ck, "--out", str(tmp_path / "o.safetensors")])
        err = capsys.readouterr().err.strip()
    _one_line(rc, err, it, "but the files holding its weights have")
