"""``omnitron checkpoint import-hf`` on damaged and crafted Hugging Face directories.

The directory is a tiny random ``LlamaForCausalLM`` written by ``transformers``' own ``save_pretrained``; each
test damages one file the way a download or an attacker could, and asserts the import is refused with exit
code 2 and one line naming that file (no traceback), and that nothing was written. The reference for
"accepted" is the untouched directory, which imports.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from omnitron.cli import main as cli  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100, max_position_embeddings=32,
                                   tie_word_embeddings=False)
    d = str(tmp_path_factory.mktemp("hf") / "llama")
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    return d


def _copy(hf_dir: str, tmp_path) -> str:
    d = str(tmp_path / "copy")
    shutil.copytree(hf_dir, d)
    return d


def _refused(d: str, tmp_path, capsys, *names: str) -> str:
    """The import's one-line error (exit 2, nothing saved), which names each of ``names``."""
    capsys.readouterr()
    save = str(tmp_path / "out")
    assert cli(["checkpoint", "import-hf", "--hf-dir", d, "--save", save]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and err.startswith("omnitron checkpoint import-hf: error:"), err
    assert all(n in err for n in names), err
    assert not os.path.exists(save) or not os.listdir(save)
    return err


def test_untouched_directory_imports(hf_dir, tmp_path):
    assert cli(["checkpoint", "import-hf", "--hf-dir", hf_dir, "--save", str(tmp_path / "out")]) == 0


@pytest.mark.parametrize("damage", ["truncated", "empty", "header"])
def test_damaged_safetensors_is_one_line(hf_dir, tmp_path, capsys, damage):
    """A download cut short anywhere, an empty file and a header length past the file's end."""
    d = _copy(hf_dir, tmp_path)
    path = os.path.join(d, "model.safetensors")
    data = open(path, "rb").read()
    cut = 1 + int.from_bytes(os.urandom(4), "little") % (len(data) - 1)
    out = {"truncated": data[:cut], "empty": b"", "header": (len(data) * 1000).to_bytes(8, "little") + data[8:]}
    open(path, "wb").write(out[damage])
    _refused(d, tmp_path, capsys, path, "not a readable safetensors file")


@pytest.mark.parametrize("content,why", [(b'{"model_type": ', "not valid JSON"), (b"\xff\xfe{}", "not valid JSON"),
                                         (b"[1, 2]", "holds a JSON list, not an object")])
def test_malformed_config_json_is_one_line(hf_dir, tmp_path, capsys, content, why):
    d = _copy(hf_dir, tmp_path)
    open(os.path.join(d, "config.json"), "wb").write(content)
    _refused(d, tmp_path, capsys, os.path.join(d, "config.json"), why)


@pytest.mark.parametrize("shard", ["../elsewhere/model.safetensors", "{outside}", "sub/model.safetensors"])
def test_index_naming_a_file_outside_the_directory_is_refused(hf_dir, tmp_path, capsys, shard):
    """A shard index may name only files in the directory: a valid weights file elsewhere (which would import)
    is not read."""
    d = _copy(hf_dir, tmp_path)
    outside = str(tmp_path / "elsewhere" / "model.safetensors")
    os.makedirs(os.path.dirname(outside))
    os.replace(os.path.join(d, "model.safetensors"), outside)
    os.makedirs(os.path.join(d, "sub"))
    shutil.copy(outside, os.path.join(d, "sub", "model.safetensors"))
    from safetensors import safe_open

    with safe_open(outside, "pt") as f:
        names = list(f.keys())
    shard = shard.format(outside=outside)
    index = os.path.join(d, "model.safetensors.index.json")
    json.dump({"metadata": {}, "weight_map": {n: shard for n in names}}, open(index, "w"))
    _refused(d, tmp_path, capsys, index, "is not a file name in the checkpoint's directory")


@pytest.mark.parametrize("weight_map", [None, [], {"w": 5}])
def test_malformed_index_is_one_line(hf_dir, tmp_path, capsys, weight_map):
    d = _copy(hf_dir, tmp_path)
    index = os.path.join(d, "model.safetensors.index.json")
    json.dump({} if weight_map is None else {"weight_map": weight_map}, open(index, "w"))
    _refused(d, tmp_path, capsys, index, "'weight_map'")


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size"])
def test_config_declaring_a_huge_model_is_refused_before_allocating(hf_dir, tmp_path, capsys, field):
    """config.json declares a model of about 10**13 bytes over small weights: the shapes are compared first (on the
    meta device), so the import is refused naming config.json instead of trying to allocate that model."""
    d = _copy(hf_dir, tmp_path)
    path = os.path.join(d, "config.json")
    cfg = json.load(open(path))
    cfg[field] = 2 ** 40 if field == "vocab_size" else 2 ** 20
    if field == "hidden_size":
        cfg["head_dim"] = 2 ** 20 // cfg["num_attention_heads"]
    json.dump(cfg, open(path, "w"))
    _refused(d, tmp_path, capsys, path, "the weights and their config.json do not match")


def _damage_one(path: str, how: str) -> tuple[str, int | None]:
    """Rewrite safetensors file ``path`` with one weight, chosen at random, damaged ``how``: one random element set
    to NaN / +-inf, or the whole tensor as int8 codes. Returns (its name, the element set, or None)."""
    from safetensors.torch import load_file, save_file

    state = load_file(path)
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    name = sorted(state)[int(torch.randint(len(state), (1,), generator=gen))]
    t, at = state[name].clone(), None
    if how == "int8":
        t = t.mul(127).round().to(torch.int8)
    else:
        at = int(torch.randint(t.numel(), (1,), generator=gen))
        t.view(-1)[at] = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}[how]
    state[name] = t
    save_file(state, path, metadata={"format": "pt"})
    return name, at


@pytest.mark.parametrize("how, says", [("nan", "holds NaN"), ("inf", "holds inf"), ("-inf", "holds inf"),
                                       ("int8", "is int8, not a floating-point weight")])
def test_nonfinite_or_integer_weight_is_refused_naming_tensor_and_file(hf_dir, tmp_path, capsys, how, says):
    """A NaN / inf weight (every loss of the run NaN) or an integer one (cast to float and trained on as codes)
    imported silently."""
    d = _copy(hf_dir, tmp_path)
    path = os.path.join(d, "model.safetensors")
    name, at = _damage_one(path, how)
    err = _refused(d, tmp_path, capsys, path, f"tensor {name!r} {says}")
    assert at is None or f"(element {at})" in err, err


def test_an_ignored_integer_buffer_still_imports(hf_dir, tmp_path):
    """The check spares the buffers the importer drops (older GPT-2 files carry a bool causal mask)."""
    from safetensors.torch import load_file, save_file

    d = _copy(hf_dir, tmp_path)
    path = os.path.join(d, "model.safetensors")
    save_file({**load_file(path), "model.layers.1.attn.bias": torch.ones(4, 4, dtype=torch.bool)}, path,
              metadata={"format": "pt"})
    assert cli(["checkpoint", "import-hf", "--hf-dir", d, "--save", str(tmp_path / "out")]) == 0


def test_weight_problem_finds_the_element_in_any_float_dtype_and_slice(monkeypatch):
    """float8 (no isfinite kernel: tested in float32) and bf16, with the bad element in a later slice than the
    first (slices of 7 elements here), found at its index; a finite tensor of each passes."""
    from omnitron.core.checkpoint import weight_values

    monkeypatch.setattr(weight_values, "_SLICE", 7)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16, torch.float64):
        t = torch.randn(5, 6).clamp(-4, 4).to(dtype)
        assert weight_values.weight_problem(t) is None, dtype
        at = 7 + int.from_bytes(os.urandom(2), "little") % 23
        t.view(-1)[at] = float("nan")
        assert weight_values.weight_problem(t) == f"holds NaN (element {at})", dtype
