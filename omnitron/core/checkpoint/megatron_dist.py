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
  ``GPTModel``, local spec, on CPU: tests/checkpoint/test_megatron_core_interop.py).
- MoE / MLA / MTP names: :mod:`omnitron.core.checkpoint.megatron_names`; experts are one key with an expert
  axis (``mlp.experts.experts.*``), a ``--moe-layer-freq`` pattern makes the layers per-layer keys, norms that
  the TE and the local spec key differently are written under both.

Optimizer (``optimizer.*``) and RNG state are neither read nor written: an import is weights only, and an
export loads in Megatron with ``--finetune`` or ``--no-load-optim --no-load-rng``.
"""
from __future__ import annotations

import io
import itertools
import json
import math
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
from omnitron.core.checkpoint.megatron_base import (_VOCAB, CHECKPOINT_VERSION,
                                               MegatronConversionError, _check_state, _tp_dim, check_weights,
                                               commit_iteration, load_file, run_args)
from omnitron.core.checkpoint.megatron_names import (STACKED_EXPERTS, dist_rests, extra_state_modules, homogeneous,
                                                     is_moe, layer_of, omnitron_rest)

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
_MTP_LAYER = re.compile(r"^(mtp\.layers\.\d+\.transformer_layer\.)(.+)$")
_MTP_OWN = re.compile(r"^mtp\.layers\.\d+\.((?:eh_proj|enorm|hnorm|final_layernorm)\..+)$")
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
    tensors = _read_tensors(iter_dir, md)
    check_weights(tensors, iter_dir)
    return args, tensors


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
        path = os.path.join(iter_dir, info.relative_path)
        size = os.path.getsize(path) if os.path.isfile(path) else 0
        if not (isinstance(info.offset, int) and isinstance(info.length, int) and 0 <= info.offset
                and 0 <= info.length <= size - info.offset):  # a crafted length would be allocated by read()
            raise MegatronConversionError(f"{iter_dir}/.metadata: {COMMON_STATE} is bytes {info.offset!r} + "
                                          f"{info.length!r} of {info.relative_path}, which has {size} bytes; {_FIX}")
        with open(path, "rb") as f:
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
    keys = [k for k, m in md.state_dict_metadata.items()
            if isinstance(m, dcp_meta.TensorStorageMetadata) and not _OPTIMIZER.match(k)]
    _check_declared_bytes(iter_dir, md, keys)
    pieces = {}
    for key in keys:
        m = md.state_dict_metadata[key]
        t = torch.empty(tuple(m.size), dtype=m.properties.dtype)
        pieces[key] = (tuple(t.shape), [((0,) * t.dim(), t)])
    if not pieces:
        raise MegatronConversionError(f"{iter_dir}: no model tensors in the checkpoint")
    reader = ForeignReader(iter_dir, {})
    reader.metadata = md
    dcp_read(pieces, iter_dir, {}, collective=False, reader=reader)
    return {key: t for key, (_, [(_, t)]) in pieces.items()}


def _check_declared_bytes(iter_dir: str, md, keys: list[str]) -> None:
    """The model tensors ``keys`` that ``.metadata`` declares fit in the data files that hold them, checked before
    any is allocated: a crafted ``.metadata`` may declare any size, and each tensor's bytes are stored at least
    once, uncompressed (Megatron never uses DCP's stream transforms, so a transformed tensor is refused)."""
    declared, files = 0, set()
    for key in keys:
        m = md.state_dict_metadata[key]
        if not (isinstance(m.properties.dtype, torch.dtype) and all(isinstance(n, int) and n >= 0 for n in m.size)):
            raise MegatronConversionError(f"{iter_dir}/.metadata: {key} is declared as {m.properties.dtype} "
                                          f"{tuple(m.size)}, not a tensor; {_FIX}")
        declared += math.prod(m.size) * m.properties.dtype.itemsize
    wanted = set(keys)
    for index, info in (md.storage_data or {}).items():
        if index.fqn in wanted:
            if getattr(info, "transform_descriptors", None):
                raise MegatronConversionError(f"{iter_dir}: {index.fqn} is stored transformed "
                                              f"({info.transform_descriptors}); re-save without DCP extensions")
            files.add(info.relative_path)
    held = sum(os.path.getsize(os.path.join(iter_dir, f)) for f in files if os.path.isfile(os.path.join(iter_dir, f)))
    if declared > held:
        raise MegatronConversionError(f"{iter_dir}/.metadata declares {declared} bytes of model tensors, but the data "
                                      f"files holding them have {held} bytes: the checkpoint is damaged or crafted; "
                                      f"{_FIX}")


def state_from_tensors(tensors: dict[str, torch.Tensor], cfg, path: str) -> dict:
    """omnitron's full state (global names, real vocabulary rows; routers' ``expert_bias`` buffers kept) of
    :func:`read`'s Megatron tensors: stacked or per-layer keys, experts on their axis, any spec's norm names."""
    full = {}
    for key, t in tensors.items():
        if key.endswith(".inv_freq"):
            continue  # RoPE frequencies are recomputed
        for prefix, rest, x in _layers_of(key, t, cfg, path):
            if prefix is None:
                full[key] = t
            elif rest.startswith(STACKED_EXPERTS) and not rest[len(STACKED_EXPERTS)].isdigit():
                for e in range(x.shape[0]):  # the expert axis of SequentialMLP's / TEGroupedMLP's one key
                    _put(full, f"{prefix}mlp.experts.{e}.{rest[len(STACKED_EXPERTS):]}", x[e], path)
            else:
                _put(full, prefix + omnitron_rest(rest), x, path)
    for name in [n for n in full if n.endswith(("linear_fc1.weight_w", "linear_fc1.bias_w"))]:
        full[name[:-2]] = torch.cat([full.pop(name), full.pop(name[:-2] + "_v")])  # singleton SwiGLU halves
    for name in _VOCAB:
        if name in full:
            full[name] = full[name][:cfg.vocab_size].clone()
    if not cfg.untie_embeddings_and_output_weights:
        full.pop("output_layer.weight", None)
    _check_state(full, cfg, path)
    return full


def _layers_of(key: str, t: torch.Tensor, cfg, path: str):
    """``(omnitron layer prefix, Megatron layer rest, tensor)`` of each layer key ``key`` holds (a stacked key:
    one per layer); ``(None, None, t)`` for a key outside the layers."""
    m, mtp, stacked = _PER_LAYER.match(key), _MTP_LAYER.match(key), _STACKED.match(key)
    if m:
        return [(f"decoder.layers.{m.group(1)}.", m.group(2), t)]
    if mtp:
        return [(mtp.group(1), mtp.group(2), t)]
    if stacked:
        if t.dim() == 0 or t.shape[0] != cfg.num_layers:
            raise MegatronConversionError(f"{path}: {key} stacks {tuple(t.shape)[:1]} layers, the args' model "
                                          f"{cfg.num_layers}; the checkpoint and its args do not match")
        return [(f"decoder.layers.{i}.", stacked.group(1), t[i]) for i in range(cfg.num_layers)]
    return [(None, None, t)]


def _put(full: dict, name: str, t: torch.Tensor, path: str) -> None:
    """``full[name] = t`` (a copy: not a view of a stack); a second spelling of a name (the TE and the local
    spec's norm keys, both in omnitron's exports) must hold the same tensor."""
    if name in full:
        if not torch.equal(full[name], t):
            raise MegatronConversionError(f"{path}: two keys of {name} (the TE and the local layer spec's names) "
                                          f"hold different tensors; the checkpoint is inconsistent")
        return
    full[name] = t.clone()


# ---- writing ---------------------------------------------------------------------------------
def megatron_tensors(full: dict, cfg, tp: int) -> dict[str, torch.Tensor]:
    """``{Megatron key: global tensor}`` of omnitron full state ``full``: layers stacked when Megatron stacks them
    (:func:`~omnitron.core.checkpoint.megatron_names.homogeneous`), experts stacked on their axis, the TE and
    the local spec's norm keys (:func:`~omnitron.core.checkpoint.megatron_names.dist_rests`), a zero
    ``expert_bias`` where the router has one and ``full`` does not, vocabulary rows zero-padded for ``tp``."""
    from omnitron.core.models.gpt.config import padded_vocab_size

    mla, out, per, experts = bool(cfg.multi_latent_attention), {}, {}, {}
    for name, t in {**_zero_router_extras(cfg), **full}.items():
        layer = layer_of(name)
        if layer is None:
            pad = padded_vocab_size(cfg, tp) - t.shape[0] if name in _VOCAB else 0
            out[name] = torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t
            continue
        prefix, i, _, rest = layer
        for mrest in dist_rests(rest, mla=mla, moe=is_moe(cfg, i)):
            if mrest.startswith(STACKED_EXPERTS):
                experts.setdefault((prefix, mrest), {})[int(rest.split(".")[2])] = t
            else:
                per[(prefix, mrest)] = t
    for (prefix, mrest), ts in experts.items():
        per[(prefix, mrest)] = torch.stack([ts[e] for e in range(cfg.num_experts)])
    stack = homogeneous(cfg)
    for mrest in sorted({r for p, r in per if stack and p.startswith("decoder.")}):
        out[f"decoder.layers.{mrest}"] = torch.stack([per.pop((f"decoder.layers.{i}.", mrest))
                                                      for i in range(cfg.num_layers)])
    out.update({prefix + mrest: t for (prefix, mrest), t in per.items()})
    return out


def _zero_router_extras(cfg) -> dict[str, torch.Tensor]:
    """Zero router tensors Megatron's model holds where omnitron's may not (the state's own, when present, replace
    them): ``mlp.router.expert_bias`` (float32, as Megatron's buffer) of every MoE layer whose router has one, and
    with --add-bias-linear Megatron's ``mlp.router.bias`` (a model of ``moe_router_bias`` False has none: zero is
    the same function)."""
    if not cfg.num_experts:
        return {}
    prefixes = [f"decoder.layers.{i}." for i in range(cfg.num_layers) if is_moe(cfg, i)]
    prefixes += [f"mtp.layers.{k}.transformer_layer." for k in range(cfg.mtp_num_layers or 0) if is_moe(cfg, None)]
    out = {}
    if cfg.moe_router_enable_expert_bias:
        out.update({f"{p}mlp.router.expert_bias": torch.zeros(cfg.num_experts) for p in prefixes})
    if cfg.add_bias_linear:
        out.update({f"{p}mlp.router.bias": torch.zeros(cfg.num_experts, dtype=cfg.params_dtype) for p in prefixes})
    return out


def pieces_of(key: str, g: torch.Tensor, tp: int, swiglu: bool) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """The pieces Megatron's ranks write of global tensor ``g``: one per layer (stacked keys), expert (the
    experts' keys) and tensor rank (SwiGLU's fc1: 2 tp, gate and up fragments), each ``(offsets, copy)``."""
    lead = bool(_STACKED.match(key)) + (STACKED_EXPERTS in key)
    dim = _tp_dim(key)
    parts = 1 if dim is None else 2 * tp if swiglu and ".linear_fc1." in key else tp
    dim = (dim or 0) + lead
    out = []
    for idx in itertools.product(*(range(n) for n in g.shape[:lead])):
        base = g[tuple(slice(i, i + 1) for i in idx)]
        n = base.shape[dim] // parts if dim < g.dim() else 0
        for j in range(parts if n else 1):
            off = list(idx) + [0] * (g.dim() - lead)
            if n:
                off[dim] += j * n
            out.append((tuple(off), (base.narrow(dim, j * n, n) if n else base).contiguous()))
    return out


def _extra_states(tensors: dict[str, torch.Tensor], cfg) -> dict[str, io.BytesIO]:
    """Every linear's (and TE's core attention's) ``_extra_state`` ShardedObject of the Megatron keys ``tensors``,
    empty (``[None]``, no FP8 state): bytes items ``<module>._extra_state/shard_<offsets>_<shape>`` as Megatron
    names them (stacked: one per layer; experts: one per expert)."""
    groups: dict[str, set[str]] = {}
    for key in tensors:
        m = _STACKED.match(key) or _PER_LAYER.match(key) or _MTP_LAYER.match(key) or _MTP_OWN.match(key)
        if m:  # the layer's rest is the last group, its prefix what precedes it
            rest = m.group(m.lastindex)
            groups.setdefault(key[:len(key) - len(rest)], set()).add(rest)
    out, L, E = {}, cfg.num_layers, cfg.num_experts
    for prefix, rests in groups.items():
        stacked = prefix == "decoder.layers."
        for mod in extra_state_modules(rests):
            expert = mod.startswith(STACKED_EXPERTS)
            for i in range(L) if stacked else [0]:
                for e in range(E) if expert else [None]:
                    off = ([i] if stacked else []) + ([e] if expert else [])
                    shape = ([L] if stacked else []) + ([E] if expert else [])
                    if not off:
                        off, shape = [0], [1]
                    buf = io.BytesIO()
                    torch.save([None], buf)
                    name = f"{prefix}{mod}._extra_state/shard_{'.'.join(map(str, off))}_{'.'.join(map(str, shape))}"
                    out[name] = buf
    return out


def write(full: dict, cfg, args, out_dir: str, iteration: int, tp: int) -> str:
    """Write ``full`` as a Megatron-Core torch_dist checkpoint (args ``args``; vocabulary padded for
    ``tp``) under ``out_dir``: DCP files, ``common.pt``, ``metadata.json`` into ``iter_N.tmp``, renamed,
    then the tracker file. The same files serve the TE and the local layer spec. Returns the
    iteration directory."""
    final = os.path.join(out_dir, f"iter_{iteration:07d}")
    tmp = final + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    tensors = megatron_tensors(full, cfg, tp)
    pieces = {k: (tuple(g.shape), pieces_of(k, g, tp, cfg.swiglu)) for k, g in tensors.items()}
    planner = MegatronSavePlanner(_extra_states(tensors, cfg))
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
