"""The files of a Hugging Face ``save_pretrained`` directory, read as untrusted input.

A downloaded directory may be truncated, hand-edited or crafted, so every file is checked before it is used
and a bad one is refused in one line that names it (:class:`HFConversionError`):

- ``config.json`` and a shard index (``*.index.json``) must be JSON objects; the index's ``weight_map`` maps
  tensor names to shard files named as ``save_pretrained`` writes them: a bare file name in the directory
  (no ``..``, no separator, no absolute path), so an index cannot make the importer read a file elsewhere.
- A ``.safetensors`` file must parse (safetensors checks its header against the file's size); a truncated or
  empty download is named, not a traceback.
- A pickled ``pytorch_model.bin`` is read by :func:`~omnitron.core.checkpoint.safe_load.load_untrusted`
  (tensors only, anything else refused).
- Every tensor but the buffers the importer drops (``IGNORED``) must be a finite floating-point weight
  (:mod:`~omnitron.core.checkpoint.weight_values`): a NaN / inf or an integer tensor is named with its file.
"""
from __future__ import annotations

import json
import os

import torch

from omnitron.core.checkpoint.hf_llama import HFConversionError
from omnitron.core.checkpoint.io import bare_file_name
from omnitron.core.checkpoint.safe_load import load_untrusted
from omnitron.core.checkpoint.weight_values import first_bad_weight, fix_for

_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SINGLE = ("model.safetensors", "pytorch_model.bin")
IGNORED = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
"""Buffers older HF checkpoints saved (causal masks, RoPE frequencies): recomputed, not weights."""


def read_hf_dir(hf_dir: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, state dict) of a ``save_pretrained`` directory: ``model.safetensors``, sharded
    safetensors (``model.safetensors.index.json``), or ``pytorch_model.bin`` (module docstring)."""
    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise HFConversionError(f"--hf-dir {hf_dir}: no config.json there; pass a directory written by "
                                f"save_pretrained (or downloaded from the Hugging Face Hub)")
    config = json_object(cfg_path)
    index = next((os.path.join(hf_dir, n) for n in _INDEXES if os.path.isfile(os.path.join(hf_dir, n))), None)
    files = shard_files(index) if index else [n for n in _SINGLE if os.path.isfile(os.path.join(hf_dir, n))][:1]
    if not files:
        raise HFConversionError(f"--hf-dir {hf_dir}: no model.safetensors, pytorch_model.bin or their *.index.json; "
                                f"the weights are missing")
    state = {}
    for name in files:
        path = os.path.join(hf_dir, name)
        tensors = read_weights(path)
        bad = first_bad_weight((n, t) for n, t in tensors.items() if not n.endswith(IGNORED))
        if bad is not None:
            raise HFConversionError(f"{path}: tensor {bad[0]!r} {bad[1]}; {fix_for(bad[1])}")
        state.update(tensors)
    return config, state


def json_object(path: str) -> dict:
    """The JSON object in file ``path``; one line naming the file when it is unreadable, not JSON or not an object."""
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read())
    except (OSError, ValueError) as err:  # ValueError: JSONDecodeError and UnicodeDecodeError
        raise HFConversionError(f"{path}: not valid JSON ({type(err).__name__}: {err}); re-download or re-save "
                                f"the checkpoint") from None
    if not isinstance(value, dict):
        raise HFConversionError(f"{path}: holds a JSON {type(value).__name__}, not an object; re-download or "
                                f"re-save the checkpoint")
    return value


def shard_files(index: str) -> list[str]:
    """The shard files an ``*.index.json`` names (sorted, each once), each a bare file name in its directory."""
    weight_map = json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise HFConversionError(f"{index}: no 'weight_map' object of tensor name -> shard file name; re-download "
                                f"or re-save the checkpoint")
    for name in weight_map.values():
        if not bare_file_name(name):
            raise HFConversionError(f"{index}: shard {name[:200]!r} is not a file name in the checkpoint's "
                                    f"directory (save_pretrained writes bare names); refusing to read it")
    return sorted(set(weight_map.values()))


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """The tensors of one weights file: safetensors, else a pickle (tensors only, exact names, refused in one
    line otherwise)."""
    if not path.endswith(".safetensors"):
        return load_untrusted(path, what="a Hugging Face weights file", fix="use the repository's model.safetensors "
                              "(safetensors holds no code) or re-save it as safetensors from a trusted copy")
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except Exception as err:  # SafetensorError (truncated, bad header), OSError (missing shard, unreadable)
        raise HFConversionError(f"{path}: not a readable safetensors file ({type(err).__name__}: {err}); "
                                f"re-download it") from None
