"""Untrusted ``torch.save`` files run no code: Megatron's ``model_optim_rng.pt`` and HF's ``pytorch_model.bin``.

Each payload is a realistic Megatron checkpoint (args Namespace, tensors, numpy RNG state) in which one
value, unpickled, would create a marker file: pickle's GLOBAL / STACK_GLOBAL / INST lookups of
``eval`` and ``exec``, and the attribute walks pickle protocol 4 makes along dotted names
(``torch._utils._rebuild_tensor.__builtins__.get`` -> ``dict.get`` of the builtins -> ``eval``), in
the zip and the legacy (pre-zip) torch.save formats. The reference is plain ``pickle``: every payload
marked live does create its marker when loaded with ``weights_only=False`` (so the test can fail),
and through omnitron's readers none does and each is refused in one line naming the file. A fuzz run
over dotted, nested and dunder names (both opcodes, protocols 2 and 4) holds the same bound.
"""
from __future__ import annotations

import argparse
import io
import os
import pickle
import pickletools
import random
import signal
import struct
import zipfile

import numpy as np
import pytest
import torch

from omnitron.cli import main as cli
from omnitron.core.checkpoint import CheckpointError
from omnitron.core.checkpoint.megatron import MegatronConversionError, Opaque, import_megatron, load_file
from omnitron.core.checkpoint import safe_load
from omnitron.core.checkpoint.reshard import Layout


class _Eval:
    """Pickled as ``GLOBAL builtins eval`` + REDUCE(code): the hook the variants below rewrite."""

    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        return (eval, (self.code,))


def _u(s: str) -> bytes:
    """BINUNICODE ``s``."""
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def _call(arg: str) -> bytes:
    """Call the callable on the stack with one string: MARK, the string, TUPLE, REDUCE."""
    return b"(" + _u(arg) + b"tR"


_HOOK = b"c__builtin__\neval\n"  # what protocol 2 writes for eval (Python 2's module name)
# each leaves ``eval`` (or what a walk along the name reaches) where GLOBAL builtins eval stood; live: does
# plain pickle (weights_only=False) then create the marker?
VARIANTS = {
    "global_eval": (b"cbuiltins\neval\n", True),
    "global_exec": (b"cbuiltins\nexec\n", True),
    "dotted_builtins_get": (b"ctorch._utils\n_rebuild_tensor.__builtins__.get\n" + _call("eval"), True),
    "nested_dotted": (b"ctorch._utils\n_rebuild_tensor_v2.__call__.__self__.__builtins__.get\n" + _call("eval"), True),
    "stack_global": (_u("builtins") + _u("eval") + b"\x93", True),
    "stack_global_dotted": (_u("torch._utils") + _u("_rebuild_tensor.__builtins__.get") + b"\x93" + _call("eval"),
                            True),
    "inst": (None, True),  # built in _payload: INST builtins eval with the code as its argument
    "dots_in_module": (b"ctorch._utils._rebuild_tensor.__builtins__\nget\n" + _call("eval"), False),
    "megatron_dunder": (b"cmegatron.core.enums\nAttnBackend.__init__.__globals__\n", False),
    "dtype_walk": (b"ctorch\nfloat32.__class__.__subclasses__\n", False),
    "os_system": (b"cos\nsystem\n", False),
}


def _checkpoint(marker: str) -> dict:
    """A Megatron file's entries with ``_Eval`` (creating ``marker``) hidden in the args."""
    code = f"open({marker!r}, 'w').close()"
    return {"args": argparse.Namespace(num_layers=2, hidden_size=8, tensor_model_parallel_size=1,
                                       params_dtype=torch.bfloat16, hook=_Eval(code)),
            "model": {"decoder.final_layernorm.weight": torch.ones(8)}, "iteration": 3, "checkpoint_version": 3.0,
            "rng_state": [{"np_rng_state": np.random.RandomState(0).get_state(), "torch": torch.get_rng_state()}]}


def _rewrite(pkl: bytes, variant: str, marker: str) -> bytes:
    """``pkl`` with the ``_Eval`` hook rewritten as ``variant`` and its protocol raised to 4 (dotted names
    resolve attribute by attribute from protocol 4)."""
    assert pkl.count(_HOOK) == 1 and pkl[:2] == b"\x80\x02"
    repl, _ = VARIANTS[variant]
    if variant == "inst":  # INST calls eval(code) itself; POP its result, NONE for the REDUCE that follows
        repl = b"(" + _u(f"open({marker!r}, 'w').close()") + b"ibuiltins\neval\n0N"
    return b"\x80\x04" + pkl[2:].replace(_HOOK, repl)


def _payload(path: str, variant: str, marker: str, zipped: bool, obj: dict | None = None) -> None:
    """Write the rewritten checkpoint (``obj``: other entries holding one ``_Eval``) as a zip or legacy
    torch.save file."""
    buf = io.BytesIO()
    torch.save(obj or _checkpoint(marker), buf, _use_new_zipfile_serialization=zipped)
    raw = buf.getvalue()
    if not zipped:  # legacy: the object's pickle is the 4th of the file's pickles; rewrite it in place
        f = io.BytesIO(raw)
        for _ in range(3):
            pickle.load(f)  # magic number, protocol, sys info: plain values
        start = f.tell()
        for _ in pickletools.genops(f):  # past the object's pickle without running it
            pass
        end = f.tell()
        with open(path, "wb") as out:
            out.write(raw[:start] + _rewrite(raw[start:end], variant, marker) + raw[end:])
        return
    src = zipfile.ZipFile(io.BytesIO(raw))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info, _rewrite(data, variant, marker) if info.filename.endswith("/data.pkl") else data)


def _one_line(msg: str) -> str:
    assert "\n" not in msg.strip() and msg.strip(), msg
    return msg


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_payloads_are_live_under_plain_pickle(tmp_path, zipped):
    """The reference: each payload marked live runs its code when loaded without restriction."""
    for variant, (_, live) in VARIANTS.items():
        if not live:
            continue
        marker, path = tmp_path / f"ran_{variant}", str(tmp_path / f"{variant}.pt")
        _payload(path, variant, str(marker), zipped)
        try:
            torch.load(path, weights_only=False)
        except Exception:  # the INST variant fails after running (its REDUCE calls None)
            pass
        assert marker.exists(), f"{variant} is not a live payload"


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_megatron_import_refuses_payload(tmp_path, capsys, variant, zipped):
    """``omnitron checkpoint import-megatron`` of each payload: exit 2, one line naming the file, no marker."""
    marker = tmp_path / "pwned"
    it = tmp_path / "meg" / "iter_0000003" / "mp_rank_00"
    it.mkdir(parents=True)
    (tmp_path / "meg" / "latest_checkpointed_iteration.txt").write_text("3")
    _payload(str(it / "model_optim_rng.pt"), variant, str(marker), zipped)
    assert cli(["checkpoint", "import-megatron", "--load", str(tmp_path / "meg"), "--save", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "model_optim_rng.pt: refused as unsafe" in _one_line(err) and "weights_only=False" not in err
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("protocol,named", [(2, "names '__builtin__.eval'"), (5, "uses opcode STACK_GLOBAL")])
def test_raw_pickle_megatron_import_runs_no_code(tmp_path, protocol, named):
    """A bare pickle (not a torch.save file) placed as ``model_optim_rng.pt``."""
    marker = tmp_path / "pwned"
    src = tmp_path / "megatron" / "iter_0000001" / "mp_rank_00"
    src.mkdir(parents=True)
    (tmp_path / "megatron" / "latest_checkpointed_iteration.txt").write_text("1")
    payload = pickle.dumps(_Eval(f"open({str(marker)!r}, 'w').close()"), protocol=protocol)
    (src / "model_optim_rng.pt").write_bytes(payload)
    with pytest.raises(MegatronConversionError) as err:
        import_megatron(str(tmp_path / "megatron"), str(tmp_path / "out"), Layout())
    assert not marker.exists()
    assert f"model_optim_rng.pt: refused as unsafe: its pickle {named}" in _one_line(str(err.value))
    pickle.loads(payload)  # the reference: unrestricted, it runs
    assert marker.exists()


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_megatron_enums_become_placeholders(tmp_path, zipped, monkeypatch):
    """A ``megatron.*`` enum in ``args`` (megatron-core not installed) reads as an inert :class:`Opaque`;
    tensors, numpy RNG state, dtypes and the ``exit_signal`` every Megatron run's args hold read back equal."""
    import enum
    import sys
    import types

    for name in ("megatron", "megatron.core", "megatron.core.transformer", "megatron.core.transformer.enums"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    AttnBackend = enum.Enum("AttnBackend", {"flash": 1, "auto": 5}, module="megatron.core.transformer.enums")
    sys.modules["megatron.core.transformer.enums"].AttnBackend = AttnBackend
    w, rng = torch.randn(5, 3), np.random.RandomState(7).get_state()
    sig = random.choice([signal.SIGTERM, signal.SIGINT, signal.SIGUSR1])  # Megatron's --exit-signal (SIGTERM default)
    ckpt = {"args": argparse.Namespace(tp=1, attention_backend=AttnBackend.auto, params_dtype=torch.bfloat16,
                                       exit_signal=sig),
            "model": {"w": w}, "rng_state": [{"np_rng_state": rng}], "scalar": np.float64(0.25),
            "np": np.arange(4, dtype=np.int32)}
    torch.save(ckpt, tmp_path / "f.pt", _use_new_zipfile_serialization=zipped)
    for name in ("megatron", "megatron.core", "megatron.core.transformer", "megatron.core.transformer.enums"):
        monkeypatch.delitem(sys.modules, name)
    got = load_file(str(tmp_path / "f.pt"))
    assert torch.equal(got["model"]["w"], w) and got["args"].tp == 1 and got["args"].params_dtype == torch.bfloat16
    assert got["args"].exit_signal is sig
    backend = got["args"].attention_backend
    assert isinstance(backend, Opaque) and backend.args == (5,) and type(backend).__module__.startswith("megatron.")
    assert got["rng_state"][0]["np_rng_state"][0] == rng[0] and (got["rng_state"][0]["np_rng_state"][1] == rng[1]).all()
    assert got["scalar"] == 0.25 and got["np"].dtype == np.int32 and (got["np"] == np.arange(4)).all()


def test_foreign_class_in_args_is_refused(tmp_path):
    """A class outside the allow-list and outside ``megatron.*`` (here ``posix.getcwd``) is refused by name."""

    class Foreign:
        def __reduce__(self):
            return (os.getcwd, ())

    torch.save({"args": argparse.Namespace(x=Foreign()), "x": torch.arange(3)}, str(tmp_path / "f.pt"))
    with pytest.raises(MegatronConversionError, match=r"refused as unsafe: its pickle names '(posix|nt)\.getcwd'"):
        load_file(str(tmp_path / "f.pt"))


_PIECES = ["__builtins__", "__globals__", "__class__", "__init__", "__dict__", "__subclasses__", "__self__", "__call__",
           "get", "eval", "system", "_rebuild_tensor", "_rebuild_tensor_v2", "Namespace", "AttnBackend", "float32",
           "OrderedDict", "_reconstruct", "ndarray"]
_MODULES = ["torch", "torch._utils", "torch._tensor", "builtins", "argparse", "numpy", "numpy._core.multiarray",
            "collections", "megatron", "megatron.core.transformer.enums", "os", "posix", "_codecs"]


def _fuzz_pickle(rng: random.Random, marker: str) -> tuple[bytes, str]:
    """A pickle naming one random (often dotted / nested / dunder) global, calling it with 'eval' and then
    calling the result with code that creates ``marker``."""
    module = rng.choice(_MODULES) + "".join("." + rng.choice(_PIECES) for _ in range(rng.choice([0, 0, 0, 1])))
    name = ".".join(rng.choice(_PIECES) for _ in range(rng.choice([1, 1, 2, 3, 4])))
    proto = rng.choice([2, 4])
    lookup = (_u(module) + _u(name) + b"\x93" if proto == 4 and rng.random() < 0.5
              else b"c" + module.encode() + b"\n" + name.encode() + b"\n")
    body = lookup + _call("eval") + _call(f"open({marker!r}, 'w').close()")
    return bytes([0x80, proto]) + body + b".", f"{module} {name} proto {proto}"


def test_fuzz_dotted_and_nested_names(tmp_path):
    """300 random names, raw and inside a zip torch.save record: each is refused in one line (or reads as
    inert data) and no marker is ever created."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng, marker = random.Random(seed), tmp_path / "pwned"
    template = io.BytesIO()
    torch.save({"x": torch.ones(1)}, template)
    for i in range(300):
        pkl, what = _fuzz_pickle(rng, str(marker))
        path = tmp_path / f"f{i}.pt"
        if i % 2:
            path.write_bytes(pkl)
        else:
            src = zipfile.ZipFile(io.BytesIO(template.getvalue()))
            with zipfile.ZipFile(path, "w") as dst:
                for info in src.infolist():
                    dst.writestr(info, pkl if info.filename.endswith("/data.pkl") else src.read(info))
        try:
            load_file(str(path))
        except CheckpointError as err:
            _one_line(str(err))
        assert not marker.exists(), f"seed {seed}: {what} ran code"


@pytest.mark.parametrize("variant", ["global_eval", "dotted_builtins_get", "stack_global"])
def test_hf_import_refuses_pytorch_model_bin(tmp_path, capsys, variant):
    """``import-hf`` of a ``pytorch_model.bin`` holding a payload: one line naming the file, refused as
    unsafe, pointing to safetensors, never torch's advice to load with ``weights_only=False``."""
    marker, hf = tmp_path / "pwned", tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "gpt2", "n_layer": 1, "n_embd": 8, "n_head": 2, '
                                    '"vocab_size": 16, "n_positions": 8}')
    weights = {"wte.weight": torch.randn(16, 8), "h.0.hook": _Eval(f"open({str(marker)!r}, 'w').close()")}
    _payload(str(hf / "pytorch_model.bin"), variant, str(marker), True, obj=weights)
    assert cli(["checkpoint", "import-hf", "--hf-dir", str(hf), "--save", str(tmp_path / "out")]) == 2
    err = _one_line(capsys.readouterr().err)
    assert "pytorch_model.bin: refused as unsafe" in err and "safetensors" in err and "weights_only" not in err
    assert not marker.exists()


def test_torchs_own_refusal_is_one_line(tmp_path, monkeypatch):
    """Were the allow-list to admit a name (here ``builtins.eval``), torch's weights-only loader still refuses
    it; that refusal is one line too, without its advice to load unsafely."""
    monkeypatch.setattr(safe_load, "torch_save_names", lambda: frozenset({"builtins.eval"}) | _TORCH_NAMES)
    marker = tmp_path / "pwned"
    _payload(str(tmp_path / "f.pt"), "global_eval", str(marker), True,
             obj={"w": torch.ones(2), "x": _Eval(f"open({str(marker)!r}, 'w').close()")})
    with pytest.raises(CheckpointError) as err:
        load_file(str(tmp_path / "f.pt"))
    msg = _one_line(str(err.value))
    assert "refused as unsafe by torch's weights-only loader (" in msg and "eval" in msg.split("loader")[1], msg
    assert "weights_only=False" not in msg and not marker.exists()


_TORCH_NAMES = safe_load.torch_save_names()


def test_crafted_omnitron_shard_is_one_line(tmp_path):
    """An omnitron shard replaced by a payload, its checksum in metadata.json rewritten to match: torch's
    weights-only loader refuses it, and the error is one line without torch's advice to load unsafely."""
    import json

    from omnitron.core.checkpoint.integrity import file_digest
    from omnitron.core.checkpoint.io import read_shard, save_checkpoint

    marker = tmp_path / "pwned"
    path = save_checkpoint(str(tmp_path / "ck"), 1, {"w": torch.randn(4)}, {"model": {}, "layout": {}},
                           rank=0, world_size=1, barrier=lambda: None)
    shard = os.path.join(path, "rank_00000.pt")
    _payload(shard, "global_eval", str(marker), True,
             obj={"w": torch.ones(2), "x": _Eval(f"open({str(marker)!r}, 'w').close()")})
    meta = json.load(open(os.path.join(path, "metadata.json")))
    meta["checksums"]["rank_00000.pt"] = file_digest(shard)
    json.dump(meta, open(os.path.join(path, "metadata.json"), "w"))
    with pytest.raises(CheckpointError) as err:
        read_shard(path, 0)
    msg = _one_line(str(err.value))
    assert "rank_00000.pt: refused as unsafe by torch's weights-only loader (" in msg, msg
    assert "weights_only" not in msg and "corrupt" not in msg, msg
    assert not marker.exists()


def _deflated(path: str) -> None:
    """Rewrite torch.save file ``path`` with every record deflate-compressed (torch.load still reads it)."""
    with zipfile.ZipFile(path) as src:
        records = [(n, src.read(n)) for n in src.namelist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as dst:
        for name, data in records:
            dst.writestr(name, data)


@pytest.mark.parametrize("where", ["megatron", "hf_bin", "omnitron_shard"])
def test_compressed_records_are_refused_before_loading(tmp_path, where):
    """torch.save stores records uncompressed, but torch.load also inflates deflated ones, allocating the size
    each declares: a file of a few megabytes can claim gigabytes. A deflated file (which plain
    ``torch.load(weights_only=True)`` reads back, so it would otherwise be accepted) is refused in one line
    naming the file, by every reader of untrusted torch.save files and by an omnitron shard's reader (its
    checksum rewritten to match)."""
    import json

    from omnitron.core.checkpoint.integrity import file_digest
    from omnitron.core.checkpoint.io import read_shard, save_checkpoint

    w = torch.randn(int.from_bytes(os.urandom(2), "little") % 1000 + 1)
    if where == "omnitron_shard":
        ck = save_checkpoint(str(tmp_path / "ck"), 1, {"w": w}, {"model": {}, "layout": {}}, rank=0, world_size=1,
                             barrier=lambda: None)
        path = os.path.join(ck, "rank_00000.pt")
    else:
        path = str(tmp_path / "file.pt")
        torch.save({"w": w, "args": argparse.Namespace(hidden_size=8)} if where == "megatron" else {"w": w}, path)
    _deflated(path)
    with torch.serialization.safe_globals([argparse.Namespace]):  # live: torch reads the deflated file
        assert torch.equal(torch.load(path, weights_only=True)["w"], w)
    if where == "omnitron_shard":
        meta = json.load(open(os.path.join(ck, "metadata.json")))
        meta["checksums"]["rank_00000.pt"] = file_digest(path)
        json.dump(meta, open(os.path.join(ck, "metadata.json"), "w"))
    with pytest.raises(CheckpointError) as err:
        if where == "megatron":
            load_file(path)
        elif where == "hf_bin":
            safe_load.load_untrusted(path, what="a Hugging Face weights file", fix="use safetensors")
        else:
            read_shard(ck, 0)
    msg = _one_line(str(err.value))
    assert msg.startswith(path) and "is compressed (method 8), which torch.save never writes" in msg, msg


@pytest.mark.parametrize("module, name", [("megatron", "__builtins__"), ("megatron.core", "__class__"),
                                          ("megatron.__init__", "AttnBackend"), ("megatron.__main__", "x")])
def test_a_dunder_part_under_a_vouched_module_is_refused(tmp_path, module, name):
    """Megatron's names are vouched for as inert placeholders, but not one with a dunder part (an attribute walk
    toward ``__builtins__`` or a module's own ``__init__``): refused in one line as a dotted or dunder name before
    anything is unpickled (reference: the rule the module states)."""
    path = tmp_path / "model_optim_rng.pt"
    path.write_bytes(b"\x80\x02c" + module.encode() + b"\n" + name.encode() + b"\n)R.")
    with pytest.raises(CheckpointError, match=f"names '{module}.{name}' \\(a dotted or dunder name"):
        load_file(str(path))
