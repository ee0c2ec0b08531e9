"""Sharded loading for inference: a rank's stage built without weights, then filled from its own slices.

A tp x pp inference rank needs ``1 / tp`` of its stage's weights. Building the stage normally draws every full
tensor for the layout-independent initialisation and cuts it (the whole model in host memory at 70B), and the
reshard reader assembles full tensors before slicing. Here instead:

1. :func:`meta_parameters`: the stage is built with every parameter moved to the ``meta`` device as it is
   registered (buffers such as RoPE's frequencies stay real; the initialisation skips meta parameters), then
   :func:`materialize` gives each parameter uninitialised storage of its local shape -- the rank's shard only;
2. the stage's pieces (:func:`~omnitron.core.checkpoint.dist.model_pieces`: views of the local shards as boxes
   of the layout-independent global tensors) are filled from a ``torch_dist`` checkpoint through DCP, whose
   reader reads only the blocks holding each box (:mod:`~omnitron.core.checkpoint.dist_slices`), or from a
   safetensors file (``checkpoint export``) through ``safe_open(...).get_slice``, which maps each box's rows
   and copies only them.
"""
from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

import torch

from omnitron.core.checkpoint import CheckpointError, dist


@contextlib.contextmanager
def meta_parameters():
    """Every parameter registered inside the block lives on ``meta`` (its attributes kept); buffers do not."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:
            attrs = dict(vars(param))
            param = torch.nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            vars(param).update(attrs)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def materialize(module: torch.nn.Module, device) -> torch.nn.Module:
    """Give every meta parameter of ``module`` zeroed storage on ``device`` (same Parameter per shared object,
    attributes kept; zero: the vocabulary padding rows no checkpoint holds); returns ``module``."""
    made: dict[int, torch.nn.Parameter] = {}
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in made:
                new = torch.nn.Parameter(torch.zeros_like(p, device=device), requires_grad=p.requires_grad)
                vars(new).update(vars(p))
                made[id(p)] = new
            sub._parameters[name] = made[id(p)]
    return module


def stage_pieces(stage, groups) -> dict:
    """The piece table (``model/<global name>``) of ``stage``'s local weights: views to read into."""
    from omnitron.core.checkpoint.dist import model_pieces

    return model_pieces(SimpleNamespace(modules=[stage], groups=groups), save=False)


def read_dist(path: str, meta: dict, pieces: dict) -> int:
    """Fill ``pieces`` from the torch_dist checkpoint ``path`` (this process alone: no collective); returns
    the bytes of tensor data read."""
    return dist.read(pieces, path, meta.get("checksums") or {}, collective=False).read_bytes


def safetensors_meta(file: str) -> dict:
    """The checkpoint metadata ``checkpoint export`` records in a safetensors file (``model``, ``config``,
    ``iteration``; ``layout`` tp1)."""
    from safetensors import safe_open

    try:
        with safe_open(file, framework="pt") as f:
            raw = f.metadata() or {}
    except Exception as err:  # SafetensorError (truncated, bad header), OSError
        raise CheckpointError(f"--load {file}: not a readable safetensors file ({type(err).__name__}: {err}); "
                              f"export it again") from None
    if "model" not in raw:
        raise CheckpointError(f"--load {file}: a safetensors file without omnitron's model config in its metadata; "
                              f"write it with `omnitron checkpoint export`")
    try:
        out = {"model": json.loads(raw["model"]), "config": json.loads(raw.get("config", "{}")),
               "iteration": int(raw.get("iteration", 0)), "layout": {}}
    except ValueError as err:
        raise CheckpointError(f"--load {file}: its metadata is not what `checkpoint export` writes ({err}); export it "
                              f"again") from None
    if not isinstance(out["model"], dict) or not isinstance(out["config"], dict):
        raise CheckpointError(f"--load {file}: its metadata's model / config are not JSON objects; export it again")
    return out


def read_safetensors(file: str, stage, pieces: dict) -> int:
    """Fill ``pieces`` from ``file`` (full tensors by global name, as ``checkpoint export`` writes them), each
    box through ``get_slice`` (only its rows are read); returns the bytes copied."""
    from safetensors import safe_open

    params = {_global(n, p): p for n, p in stage.named_parameters()}
    done = 0
    with safe_open(file, framework="pt") as f:
        names = set(f.keys())
        for key, (shape, boxes) in pieces.items():
            name = key.split("/", 1)[1]
            if name not in names:
                raise CheckpointError(f"--load {file}: no tensor {name!r}; the file was exported from another model")
            sl, p = f.get_slice(name), params[name]
            for off, view in boxes:
                part = sl[_full_index(p, shape, off, tuple(view.shape), sl.get_shape())]
                view.copy_(part.reshape(view.shape))
                done += part.numel() * part.element_size()
    return done


def _global(name: str, p) -> str:
    from omnitron.core.checkpoint.dist_layout import global_name

    return global_name(name, p)


def _full_index(p, shape: tuple, off: tuple, size: tuple, full: list) -> tuple:
    """The index into the exported full tensor (``full``: its shape) of the box ``off`` / ``size`` of global
    tensor ``shape``: a partition stride's leading block axis is folded back into ``partition_dim``."""
    if len(shape) == len(full):
        return tuple(slice(o, o + n) for o, n in zip(off, size))
    block, d = off[0], p.partition_dim  # stacked global tensor [s, ...]: block i is rows i*F.. of dim d
    rest, sz = list(off[1:]), list(size[1:])
    rest[d] += block * shape[1 + d]
    return tuple(slice(o, o + n) for o, n in zip(rest, sz))
