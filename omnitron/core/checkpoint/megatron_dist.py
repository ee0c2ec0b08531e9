"""Megatron-Core ``--ckpt-format torch_dist`` checkpoints (Megatron's default) to and from omnitron's full state.

The layout (``megatron/core/dist_checkpointing`` and ``megatron/training/checkpointing.py`` at d98e8a6)::

    DIR/latest_checkpointed_iteration.txt   "1000"
    DIR/iter_0001000/metadata.json          {"sharded_backend": "torch_dist", ...}
    DIR/iter_0001000/.metadata              DCP's global index (a pickle: read by a restricted unpickler)
    DIR/iter_0001000/__R_I.distcp           the ranks' pieces (DCP's files)
    DIR/iter_0001000/common.pt              torch.save of the unsharded state: args, iteration,
                                            checkpoint_version, content_metadata

Newer Megatron keeps the unsharded state inside DCP instead, as the bytes item ``common_state/shard_0_1``
(a torch.save'd one-element list); both are read, through
:func:`omnitron.core.checkpoint.megatron.load_file` (exact-name allow-list, no code runs). DCP's other
bytes items (TE's ``_extra_state``, RNG state) are never read: DCP would unpickle them unrestricted.

Keys are Megatron-Core's ShardedTensor keys, the model's own parameter names, and each DCP tensor is the
global one (whole over tensor and pipeline parallelism; DCP reshards on load):

- Transformer layers of a homogeneous model share one key per parameter, ``decoder.layers.<rest>``, the
  layers stacked on a leading axis of size num_layers (``TransformerBlock.sharded_state_dict``:
  offset ``(0, global layer, num_layers)``). With ``singleton_local_shards`` or non-homogeneous layers
  each layer has a key of its own, ``decoder.layers.<global layer>.<rest>``; both are read.
- SwiGLU's ``linear_fc1`` is [all gate rows; all up rows] (the swiglu factory writes tp rank r's gate
  at fragment r and its up at fragment tp + r of 2 tp), as omnitron's full fc1; under
  ``singleton_local_shards`` the halves are keys ``<key>_w`` / ``<key>_v``.
- ``linear_qkv`` is per query group, as in :mod:`omnitron.core.checkpoint.megatron`; the pre-attention
  and pre-MLP norms carry the TE spec's fused names (``self_attention.linear_qkv.layer_norm_weight``)
  under either spec: the local spec maps its ``input_layernorm.`` / ``pre_mlp_layernorm.`` to them
  (``sharded_state_dict_keys_map``), so one checkpoint loads under both; vocabulary tensors have the
  padded rows (``make_vocab_size_divisible_by`` x tp); a tied output layer is stored under the
  embedding's key only.
- The linears' ``_extra_state`` (and TE's core attention's) are ShardedObjects: bytes items
  ``<key>/shard_<layer>_<num_layers>``. Megatron's load asks DCP for every key its model has, the local
  spec's linears' extra state too, so an export writes them all as ``[None]`` (no FP8 state) under
  either spec; keys a checkpoint holds beyond a model's (the core attention's, for the local spec)
  are skipped by Megatron's default ``--dist-ckpt-strictness assume_ok_unexpected``. Hence one export
  loads under both specs (checked against megatron-core 0.16.1's ``dist_checkpointing.load`` and
  ``GPTModel``, local spec, on CPU: see docs/megatron.md).

Optimizer (``optimizer.*``) and RNG state are neither read nor written: an import is weights only, and an
export loads in Megatron with ``--finetune`` or ``--no-load-optim --no-load-rng``.
"""
from __future__ import annotations

import io
import json
import os
import re
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import metadata as dcp_meta
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from omnitron.core.checkpoint.dist import read as dcp_read
from omnitron.core.checkpoint.dist_planner import ForeignReader, PieceSavePlanner, read_dcp_metadata
from omnitron.core.checkpoint.io import _write_file
from omnitron.core.checkpoint.megatron_base import (_TE_EXTRA, _TE_NORMS, _VOCAB, CHECKPOINT_VERSION,
                                               MegatronConversionError, _check_state, _tp_dim, commit_iteration,
                                               load_file, run_args)

CONFIG = "metadata.json"
COMMON = "common.pt"
COMMON_STATE = "common_state/shard_0_1"
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
           "common_backend_version": 1}
# what megatron/training/checkpointing.py records (_build_sharded_state_dict_metadata); only
# singleton_local_shards changes a model's keys
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
_STACKED = re.compile(r"^decoder\.layers\.([A-Za-z_].*)$")
_PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_OPTIMIZER = re.compile(r"^(chained_\d+\.)?optimizer\.")
_FIX = "import only checkpoints from a trusted Megatron run"


def is_torch_dist(path: str) -> bool:
    """Whether directory ``path`` is a Megatron-Core distributed checkpoint (its ``metadata.json``
    names a ``sharded_backend``; omnitron's own metadata.json does not)."""
    try:
        with open(os.path.join(path, CONFIG)) as f:
            conf = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(conf, dict) and "sharded_backend" in conf


# ---- reading ---------------------------------------------------------------------------------
def read(iter_dir: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(args, ``{Megatron key: global tensor}`` of every model tensor) of a torch_dist iteration directory."""
    with open(os.path.join(iter_dir, CONFIG)) as f:
        backend = json.load(f).get("sharded_backend")
    if backend != "torch_dist":
        raise MegatronConversionError(f"{iter_dir}/{CONFIG}: sharded_backend {backend!r}; the importer reads "
                                      f"torch_dist (re-save with --ckpt-format torch_dist)")
    md = read_dcp_metadata(iter_dir, _FIX)
    common = _read_common(iter_dir, md)
    args = run_args(common, iter_dir)
    if common.get("iteration") is not None:
        args = {**args, "iteration": common["iteration"]}
    if (common.get("content_metadata") or {}).get("distrib_optim_sharding_type") == "fsdp_dtensor":
        raise MegatronConversionError(f"{iter_dir}: an fsdp_dtensor checkpoint (--ckpt-format fsdp_dtensor); "
                                      f"re-save it with --ckpt-format torch_dist")
    return args, _read_tensors(iter_dir, md)


def _read_common(iter_dir: str, md) -> dict:
    """The unsharded state: ``common.pt``, else DCP's ``common_state`` bytes item, both read safely."""
    path = os.path.join(iter_dir, COMMON)
    if os.path.isfile(path):
        common = load_file(path)
    else:
        info = next((v for k, v in (md.storage_data or {}).items() if k.fqn == COMMON_STATE), None)
        if info is None:
            raise MegatronConversionError(f"{iter_dir}: neither {COMMON} nor a {COMMON_STATE} item; copy the "
                                          f"whole Megatron iteration directory")
        if getattr(info, "transform_descriptors", None):
            raise MegatronConversionError(f"{iter_dir}: {COMMON_STATE} is stored transformed "
                                          f"({info.transform_descriptors}); re-save without DCP extensions")
        with open(os.path.join(iter_dir, info.relative_path), "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        common = load_file(f"{iter_dir}/{info.relative_path} ({COMMON_STATE})", data=data)
        common = common[0] if isinstance(common, list) and common else common
    if not isinstance(common, dict):
        raise MegatronConversionError(f"{iter_dir}: the common state is a {type(common).__name__}, not a dict; "
                                      f"the checkpoint is not Megatron's")
    return common


def _read_tensors(iter_dir: str, md) -> dict[str, torch.Tensor]:
    """Every tensor of ``md`` but the optimizer's, read whole (DCP assembles the saved pieces)."""
    pieces = {}
    for key, m in md.state_dict_metadata.items():
        if isinstance(m, dcp_meta.TensorStorageMetadata) and not _OPTIMIZER.match(key):
            t = torch.empty(tuple(m.size), dtype=m.properties.dtype)
            pieces[key] = (tuple(t.shape), [((0,) * t.dim(), t)])
    if not pieces:
        raise MegatronConversionError(f"{iter_dir}: no model tensors in the checkpoint")
    reader = ForeignReader(iter_dir, {})
    reader.metadata = md
    dcp_read(pieces, iter_dir, {}, collective=False, reader=reader)
    return {key: t for key, (_, [(_, t)]) in pieces.items()}


def state_from_tensors(tensors: dict[str, torch.Tensor], cfg, path: str) -> dict:
    """omnitron's full state (global names, real vocabulary rows) of :func:`read`'s Megatron tensors."""
    back = {v: k for k, v in _TE_NORMS.items()}
    full = {}
    for key, t in tensors.items():
        if key.endswith(".inv_freq"):
            continue  # RoPE frequencies are recomputed
        m, stacked = _PER_LAYER.match(key), _STACKED.match(key)
        if m:
            layers = [(int(m.group(1)), m.group(2), t)]
        elif stacked:
            if t.dim() == 0 or t.shape[0] != cfg.num_layers:
                raise MegatronConversionError(f"{path}: {key} stacks {tuple(t.shape)[:1]} layers, the args' model "
                                              f"{cfg.num_layers}; the checkpoint and its args do not match")
            layers = [(i, stacked.group(1), t[i]) for i in range(cfg.num_layers)]
        else:
            full[key] = t
            continue
        for i, rest, x in layers:
            full[f"decoder.layers.{i}.{back.get(rest, rest)}"] = x.clone()  # a copy: not a view of the stack
    for name in [n for n in full if n.endswith(("linear_fc1.weight_w", "linear_fc1.bias_w"))]:
        full[name[:-2]] = torch.cat([full.pop(name), full.pop(name[:-2] + "_v")])  # singleton SwiGLU halves
    for name in _VOCAB:
        if name in full:
            full[name] = full[name][:cfg.vocab_size].clone()
    if not cfg.untie_embeddings_and_output_weights:
        full.pop("output_layer.weight", None)
    _check_state(full, cfg, path)
    return full


# ---- writing ---------------------------------------------------------------------------------
def megatron_tensors(full: dict, cfg, tp: int) -> dict[str, torch.Tensor]:
    """``{Megatron key: global tensor}`` of omnitron full state ``full``: layers stacked, TE-fused norm
    names (under either layer spec), vocabulary rows zero-padded for tensor-parallel size ``tp``."""
    from omnitron.core.models.gpt.config import padded_vocab_size

    out, layers = {}, {}
    for name, t in full.items():
        m = _PER_LAYER.match(name)
        if m:
            rest = _TE_NORMS.get(m.group(2), m.group(2))
            layers.setdefault(rest, {})[int(m.group(1))] = t
        elif name in _VOCAB:
            out[name] = torch.cat([t, t.new_zeros(padded_vocab_size(cfg, tp) - t.shape[0], *t.shape[1:])])
        else:
            out[name] = t
    for rest, per in layers.items():
        out[f"decoder.layers.{rest}"] = torch.stack([per[i] for i in range(cfg.num_layers)])
    return out


def pieces_of(key: str, g: torch.Tensor, tp: int, swiglu: bool) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """The pieces Megatron's ranks write of global tensor ``g``: one per layer (stacked keys) and tensor
    rank (SwiGLU's fc1: 2 tp, gate and up fragments), each ``(offsets, contiguous copy)``."""
    dim = _tp_dim(key)
    stacked = bool(_STACKED.match(key))
    parts = 1 if dim is None else 2 * tp if swiglu and ".linear_fc1." in key else tp
    dim = (dim or 0) + stacked
    out = []
    for layer in range(g.shape[0]) if stacked else [None]:
        base = g[layer:layer + 1] if stacked else g
        n = base.shape[dim] // parts
        for j in range(parts):
            off = [0] * g.dim()
            off[0] = layer if stacked else off[0]
            off[dim] += j * n
            out.append((tuple(off), base.narrow(dim, j * n, n).contiguous()))
    return out


def _extra_states(num_layers: int) -> dict[str, io.BytesIO]:
    """TE modules' ``_extra_state`` ShardedObjects of every layer, empty: bytes items as Megatron names them."""
    out = {}
    for mod in _TE_EXTRA:
        for i in range(num_layers):
            buf = io.BytesIO()
            torch.save([None], buf)
            out[f"decoder.layers.{mod}/shard_{i}_{num_layers}"] = buf  # mod ends in ._extra_state
    return out


def write(full: dict, cfg, args, out_dir: str, iteration: int, tp: int) -> str:
    """Write ``full`` as a Megatron-Core torch_dist checkpoint (args ``args``; vocabulary padded for
    ``tp``) under ``out_dir``: DCP files, ``common.pt``, ``metadata.json`` into ``iter_N.tmp``, renamed,
    then the tracker file. The same files serve the TE and the local layer spec. Returns the
    iteration directory."""
    final = os.path.join(out_dir, f"iter_{iteration:07d}")
    tmp = final + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    pieces = {k: (tuple(g.shape), pieces_of(k, g, tp, cfg.swiglu)) for k, g in megatron_tensors(full, cfg, tp).items()}
    planner = MegatronSavePlanner(_extra_states(cfg.num_layers))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: intended
        dcp.save(pieces, storage_writer=FileSystemWriter(tmp, single_file_per_rank=True, thread_count=1),
                 planner=planner, no_dist=True)
    common = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
              "content_metadata": dict(CONTENT_METADATA), "num_floating_point_operations_so_far": 0}
    _write_file(os.path.join(tmp, COMMON), lambda f: torch.save(common, f))
    _write_file(os.path.join(tmp, CONFIG), lambda f: f.write(json.dumps(BACKEND).encode()))
    return commit_iteration(out_dir, iteration)


class MegatronSavePlanner(PieceSavePlanner):
    """Writes a piece table and the bytes items ``objects`` (Megatron's ShardedObjects)."""

    def __init__(self, objects: dict[str, io.BytesIO]) -> None:
        super().__init__()
        self.objects = objects

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        plan.items.extend(WriteItem(index=dcp_meta.MetadataIndex(k), type=WriteItemType.BYTE_IO)
                          for k in self.objects)
        return plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            return self.objects[write_item.index.fqn]
        return super().resolve_data(write_item)
