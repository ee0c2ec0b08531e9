"""Checkpoints under another parallel layout: full tensors by global name, and back.

A checkpoint of any layout (tensor, pipeline, virtual-pipeline, uneven first/last stages, data
and context parallel) reads into a :class:`FullState`: every model weight at its full, unpadded
shape under its global name (``decoder.layers.7.mlp.linear_fc1.weight``; a stage names its layers
by global index already) and every optimizer tensor (fp32 master, Adam moments, SGD momentum),
which is cut exactly like its parameter. :func:`rank_shard` cuts a FullState for one rank of any
other layout, in the format a training rank saves, so the same code converts offline
(:func:`convert`) and loads online (``--load`` under a new layout).

How each tensor is cut is the model's own knowledge: "skeleton" GPTModel chunks are built for the
layout (tensor-parallel rank 0, no process group) and their parameters' sharding attributes drive
:func:`~omnitron.core.parallel.tensor.sharding.merge_shards` (undo tp, drop vocab padding, the
SwiGLU stride), ``fuse_full_state`` (replicated-KV attention to the canonical fused QKV) and
:func:`~omnitron.core.models.gpt.state.full_state_shards` (the inverse). Weights are replicated
over data- and context-parallel ranks, so the dp = cp = 0 shards are read; MoE experts are whole
tensors, each on one expert-parallel rank, so every rank of a stage is read for them.

Not carried across layouts: RNG streams (one per rank; the resumed run draws fresh dropout
streams from ``--seed``) and FP8 amax histories (per-rank amaxes of tp-local shards; scaling
restarts from scratch). The optimizer step, loss scaler, scheduler, iteration and consumed
samples (so the data order) carry over.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import re
from dataclasses import dataclass, field

import torch

from omnitron.core.checkpoint.io import CheckpointError, read_metadata, read_shard, saved_expert_tp, write_checkpoint
from omnitron.core.config.parallel import ParallelConfig
from omnitron.core.optim.optimizer import keeps_master
from omnitron.core.parallel.grid import coord_of, rank_grid
from omnitron.core.parallel.groups import Group, ParallelGroups, host_backend

@dataclass(frozen=True, kw_only=True)
class Layout:
    """The parallel layout a checkpoint was written under (the metadata's ``layout``)."""

    tp: int = 1
    pp: int = 1
    vp: int | None = None
    """Model chunks per pipeline rank (None: not interleaved)."""
    dp: int = 1
    cp: int = 1
    first: int | None = None
    """--decoder-first-pipeline-num-layers."""
    last: int | None = None
    """--decoder-last-pipeline-num-layers."""
    embedding: bool = False
    """--account-for-embedding-in-pipeline-split (the embedding counts as a layer of the split)."""
    loss: bool = False
    """--account-for-loss-in-pipeline-split (the loss counts as a layer of the split)."""
    ep: int = 1
    """--expert-model-parallel-size (MoE experts are whole tensors spread over the ep ranks)."""
    etp: int = 1
    """Experts' tensor-parallel split as recorded (1 for dense models and for imported and converted checkpoints,
    which hold whole experts at any tp; reading etp > 1 in the torch format is refused)."""
    style: str = "loop"
    """Chunk placement: ``loop`` (Megatron's interleaving) or ``v`` (--pipeline-schedule zb-v / dualpipe-v)."""

    _KEYS = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
             "vp": "virtual_pipeline_model_parallel_size", "dp": "data_parallel_size", "cp": "context_parallel_size",
             "first": "decoder_first_pipeline_num_layers", "last": "decoder_last_pipeline_num_layers",
             "ep": "expert_model_parallel_size", "etp": "expert_tensor_parallel_size",
             "style": "pipeline_chunk_placement", "embedding": "account_for_embedding_in_pipeline_split",
             "loss": "account_for_loss_in_pipeline_split"}

    @classmethod
    def from_dict(cls, layout: dict) -> "Layout":
        """From a metadata ``layout`` dict (keys absent in older checkpoints take the defaults)."""
        return cls(**{k: layout[v] for k, v in cls._KEYS.items() if layout.get(v) is not None})

    def to_dict(self) -> dict:
        return {v: getattr(self, k) for k, v in self._KEYS.items()}

    @property
    def chunks(self) -> int:
        return self.vp or 1

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def parallel_config(self):
        return ParallelConfig(tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
                              virtual_pipeline_model_parallel_size=self.vp, context_parallel_size=self.cp,
                              decoder_first_pipeline_num_layers=self.first,
                              decoder_last_pipeline_num_layers=self.last, expert_model_parallel_size=self.ep,
                              expert_tensor_parallel_size=1, account_for_embedding_in_pipeline_split=self.embedding,
                              account_for_loss_in_pipeline_split=self.loss)

    def __str__(self) -> str:
        s = f"tp{self.tp} pp{self.pp}" + (f" vp{self.vp}" if self.vp else "") + f" dp{self.dp}"
        s += (f" cp{self.cp}" if self.cp > 1 else "") + (f" ep{self.ep}" if self.ep > 1 else "")
        return s + (f" first{self.first}" if self.first is not None else "") + \
            (f" last{self.last}" if self.last is not None else "") + (" +embedding" if self.embedding else "") + \
            (" +loss" if self.loss else "") + (" V" if self.style == "v" else "")


@dataclass
class FullState:
    """A checkpoint's layout-independent content (see the module docstring)."""

    model: dict[str, torch.Tensor]
    """Global parameter name -> full tensor (at the parameters' dtype)."""
    optimizer: dict[str, dict[str, torch.Tensor]]
    """Optimizer tensor kind (``master``, ``exp_avg``, ...) -> global name -> full tensor."""
    optimizer_meta: dict
    """The optimizer state dict without its tensors: step, optimizer name, loss scaler."""
    scheduler: dict
    meta: dict
    """The source checkpoint's metadata."""
    dropped: list[str] = field(default_factory=list)
    """What the source held that does not carry over (``fp8``)."""


def model_config(model: dict, family: str | None = None):
    """The model config in a checkpoint's metadata ``model`` dict, of its family's config class: ``family``
    (the run's recorded ``--model-type``) when given, else the family whose config holds its fields."""
    from omnitron.core.models.family import family_of_fields

    cls = family_of_fields(model, family).config_cls
    known = {f.name for f in dataclasses.fields(cls)}
    kw = {k: v for k, v in model.items() if k in known}
    if isinstance(kw.get("params_dtype"), str):  # saved as "torch.bfloat16"
        kw["params_dtype"] = getattr(torch, kw["params_dtype"].rsplit(".", 1)[-1])
    return cls(**kw)


def recorded_family(meta: dict, path: str = "the checkpoint") -> str | None:
    """The ``--model-type`` a checkpoint's run recorded (None: older checkpoints; told by the fields).
    Nothing the checkpoint names is imported: its family must be registered already (built in, an installed
    entry point, or ``--model-family-module`` on this command line); one that is not is refused in one line."""
    from omnitron.core.models.family import ENTRY_POINT_GROUP, families

    flat = meta.get("config", {})
    name = flat.get("model_type")
    if name is not None and (not isinstance(name, str) or name not in families()):
        mods = flat.get("model_family_module") or []
        ran = f" (its run imported {', '.join(map(str, mods)) if isinstance(mods, list) else mods})" if mods else ""
        raise CheckpointError(f"{path}: model family {str(name)[:80]!r}{ran[:200]} is not registered here and a "
                              f"checkpoint never imports code; if you trust the family's module, pass "
                              f"--model-family-module MODULE (or install it under the {ENTRY_POINT_GROUP} entry point)")
    return name


RUNTIME_ONLY = ("recompute_granularity", "recompute_method", "recompute_num_layers", "cpu_offloading",
                "cpu_offloading_num_layers", "fine_grained_activation_offloading", "offload_modules",
                "min_offloaded_tensor_size", "cpu_offloading_activations", "cpu_offloading_weights",
                "cpu_offloading_retain_pinned_cpu_buffers", "moe_shared_expert_overlap")
"""Model settings a checkpoint records but that change no tensor and that a resume sets again from its own flags
(recomputation, activation offloading, the shared expert's overlap): convert has no flags for them."""


def layout_only(cfg):
    """``cfg`` with :data:`RUNTIME_ONLY` at their defaults, for skeletons that read or write a checkpoint: a layout is
    checked for what it needs (heads, query groups, the MLP and the experts over tp / ep, the layers over pp), not
    for how the recorded run executed (``checkpoint convert`` refused ``--cpu-offloading-num-layers 1`` at pp2, a
    flag it has not). The memory plan's skeletons keep them (recomputation changes what a probe saves)."""
    from dataclasses import MISSING, fields, replace

    reset = {}
    for f in fields(cfg):
        if f.name in RUNTIME_ONLY:
            reset[f.name] = f.default_factory() if f.default is MISSING else f.default
    return replace(cfg, **reset)


def skeleton_chunks(cfg, layout: Layout, ep_rank: int = 0, etp: int = 1) -> dict[tuple[int, int], torch.nn.Module]:
    """``{(pp_rank, chunk): GPTModel}`` for tensor-parallel rank 0 (and expert-parallel rank
    ``ep_rank``) of ``layout``, built in this process without communication: their parameters
    carry the sharding attributes (the same on every tp rank) and their modules the fuse/split logic.
    ``etp``: the experts' tensor-parallel split (the memory plan's; checkpoints hold whole experts)."""
    from omnitron.core.models.family import family_of
    from omnitron.core.parallel.pipeline.layout import config_layer_ranges

    groups = ParallelGroups.single()
    groups.config = layout.parallel_config()
    groups.groups.update(tp=_Seen("tp", tuple(range(layout.tp)), None), pp=_Seen("pp", tuple(range(layout.pp)), None),
                         ep=_Seen("ep", tuple(range(layout.ep)), None, me=ep_rank))
    if etp > 1:
        groups.groups["etp"] = _Seen("etp", tuple(range(etp)), None)
    family = family_of(cfg)  # a family that is not pipelined (T5, LLaVA): one stage, one chunk
    ranges = config_layer_ranges(cfg.num_layers, groups.config, layout.style) if family.pipelined else {}
    # NOTE: host-memory skeletons on the host CPU backend whatever the run's backend (no communication)
    return family.build_chunks(cfg, groups, ranges, None, layout.pp, layout.chunks,
                               backend=host_backend(), seed=0, style=layout.style)


def full_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Global name -> full (unpadded) shape of every parameter of ``cfg``'s model but a tied output layer's (it
    reads the word embedding). Built on the meta device: an importer's config comes from a file that may declare
    any size, so its shapes are compared with the file's tensors before anything of that size is allocated."""
    with torch.device("meta"):
        chunk = skeleton_chunks(cfg, Layout())[(0, 0)]
    out = {}
    for name, p in chunk.named_parameters():
        if getattr(p, "shared_embedding", False):
            continue
        rows = getattr(p, "valid_rows", None)
        out[name] = ((rows,) if rows is not None else tuple(p.shape[:1])) + tuple(p.shape[1:])
    return out


def check_declared_size(cfg, files: list[str], where: str) -> None:
    """The model a checkpoint records is no larger than the files holding its weights (at least one byte a
    parameter, fp8 included), checked on the meta device before a model of that size is built: ``where``'s
    metadata (metadata.json, a safetensors header) is read from a file that may declare any size."""
    params = sum(math.prod(shape) for shape in full_shapes(cfg).values())
    held = sum(os.path.getsize(f) for f in files if os.path.isfile(f))
    if params > held:
        raise CheckpointError(f"{where}: its metadata records a model of {params:,} parameters, but the files holding "
                              f"its weights have {held:,} bytes: the metadata is corrupt or crafted; load an earlier "
                              f"iteration, or re-save")


@dataclass(frozen=True)
class _Seen(Group):
    """A group seen from member ``me``, whatever this process's world rank (skeletons only)."""

    me: int = 0

    @property
    def rank(self) -> int:
        return self.me


def owner(name: str) -> str:
    """What a tensor belongs to for filtering: its transformer layer (``decoder.layers.7``; the
    fused and split attention names of one layer agree on it), else the name itself."""
    m = re.match(r"^(decoder\.layers\.\d+)\.", name)
    return m.group(1) if m else name


def needed_owners(chunks) -> set[str]:
    """:func:`owner` of every parameter of ``chunks`` (a tied output copy needs the embedding)."""
    return {owner(getattr(p, "init_name", n)) for m in chunks for n, p in m.named_parameters()}


def _merge_chunk(skel, c: int, shards: list[dict], with_optimizer: bool, path: str) -> tuple[dict, dict]:
    """(full model tensors, {kind: full optimizer tensors}) of chunk ``c``'s dense parameters from
    its tp shards (in tp-rank order); not yet fused, without the (whole) expert tensors."""
    from omnitron.core.parallel.tensor.sharding import merge_shards

    model, optim = {}, {}
    models = [s["model"][c] for s in shards]
    optims = [s["optimizer"]["tensors"] for s in shards] if with_optimizer else []
    for name, p in skel.named_parameters():
        if getattr(p, "shared_embedding", False) or getattr(p, "expert", False):
            continue  # the last stage's copy of a tied embedding equals the first stage's
        key = f"chunk{c}.{name}"  # the optimizer's naming (training/components.py)
        # NOTE: frozen parameters (requires_grad False, e.g. a frozen vision tower) have no optimizer state
        if any(name not in sd for sd in models) or (p.requires_grad and any(key not in o for o in optims)):
            raise CheckpointError(f"{path}: no tensor for {name} (chunk {c}) in the shards; the checkpoint does "
                                  f"not match its own metadata (model or layout): it is corrupt")
        model[name] = merge_shards([sd[name] for sd in models], p)
        for kind in optims[0][key] if optims and p.requires_grad else ():
            optim.setdefault(kind, {})[name] = merge_shards([o[key][kind] for o in optims], p)
    return model, optim


def _take_experts(skel, c: int, shard: dict, model: dict, optim: dict, with_optimizer: bool) -> None:
    """Add the expert tensors ``shard`` holds for chunk ``c`` (each expert is whole on its ep rank)."""
    sd, tensors = shard["model"][c], shard["optimizer"].get("tensors", {})
    for name, p in skel.named_parameters():
        # NOTE: an expert's optimizer state is in its expert-data-parallel rank 0's shard only
        if getattr(p, "expert", False) and name not in model and name in sd and (
                not with_optimizer or f"chunk{c}.{name}" in tensors):
            model[name] = sd[name]
            for kind, t in tensors[f"chunk{c}.{name}"].items() if with_optimizer else ():
                optim.setdefault(kind, {})[name] = t


def _finish_chunk(skel, c: int, model: dict, optim: dict, path: str) -> None:
    """Check every tensor was found, then fuse attention's split tensors (the model's own logic)."""
    for name, p in skel.named_parameters():
        if name not in model and not getattr(p, "shared_embedding", False):
            raise CheckpointError(f"{path}: no shard holds {name} (chunk {c}); the checkpoint is corrupt")
    for prefix, mod in skel.named_modules():
        if hasattr(mod, "fuse_full_state"):
            for d in (model, *optim.values()):
                mod.fuse_full_state(prefix + ".", d)


def _stage_ranks(layout: Layout) -> dict[int, tuple[list[int], list[int]]]:
    """Per pipeline rank: (world ranks of tp ranks 0..tp-1 at dp = cp = 0, the stage's other ranks)."""
    cfg, out = layout.parallel_config(), {}
    for w in range(layout.world_size):
        co = coord_of(cfg, layout.world_size, w)
        first, others = out.setdefault(co.pp, ([None] * layout.tp, []))
        if co.dp == 0 and co.cp == 0:
            first[co.tp] = w
        else:
            others.append(w)
    return out


def _read_stage(path: str, ranks: list[int], layout: Layout) -> list[dict]:
    shards = [read_shard(path, w) for w in ranks]
    for w, s in zip(ranks, shards):
        if len(s.get("model", ())) != layout.chunks:
            raise CheckpointError(f"{path}: shard of rank {w} holds {len(s.get('model', ()))} model chunks, the "
                                  f"metadata's layout ({layout}) {layout.chunks}; the checkpoint is corrupt")
    return shards


def read_full_state(path: str, *, owners: set[str] | None = None, with_optimizer: bool = True) -> FullState:
    """The checkpoint directory ``path`` as full tensors; ``owners`` (see :func:`needed_owners`)
    keeps only those tensors and skips the pipeline stages holding none of them. One process, no
    communication; one stage's tp shards are in memory at a time (plus one more under expert
    parallelism, whose other ranks are read for their experts)."""
    meta = read_metadata(path)
    layout = Layout.from_dict(meta["layout"])
    etp = saved_expert_tp(meta)  # the layout the writer recorded (imports: 1 whatever their tp)
    dist = meta.get("ckpt_format") == "torch_dist"  # its experts are whole global tensors at any etp
    if meta["model"].get("num_experts") and etp > 1 and not dist:
        raise CheckpointError(f"{path}: saved with expert tensor parallelism {etp} (MoE experts split over tp) in "
                              f"the torch format; reading it under another layout is not supported: resume it with "
                              f"the same layout, or train with --expert-tensor-parallel-size 1 or --ckpt-format "
                              f"torch_dist (the default) to reshard later")
    cfg = model_config(meta["model"], recorded_family(meta, path))
    check_declared_size(cfg, [os.path.join(path, n) for n in os.listdir(path)], path)
    # every expert; and a layout the recorded run's offloading or recomputation would refuse (a converted one's)
    skeletons = skeleton_chunks(layout_only(cfg), dataclasses.replace(layout, ep=1))
    full = FullState(model={}, optimizer={}, optimizer_meta={}, scheduler={}, meta=meta)
    keep = (lambda n: owner(n) in owners) if owners is not None else (lambda n: True)
    biased = bool(meta["model"].get("moe_router_enable_expert_bias"))  # buffers, kept with each rank's state
    if dist:
        if biased:  # torch_dist keeps them in the small per-rank files
            full.model.update({n: b for n, b in expert_biases(path, meta).items() if keep(n)})
        return _read_dist(path, full, skeletons, layout, keep, with_optimizer)
    for pp_rank, (ranks, others) in sorted(_stage_ranks(layout).items()):
        stage = {c: m for (r, c), m in skeletons.items() if r == pp_rank}
        if pp_rank and owners is not None and not owners & needed_owners(stage.values()):
            continue
        shards = _read_stage(path, ranks, layout)
        if biased:  # the stage's model state holds them (the same on every rank of the stage): no second read
            full.model.update({n: t for chunk in shards[0].get("model", ()) for n, t in chunk.items()
                               if n.endswith(".mlp.router.expert_bias") and keep(n)})
        if pp_rank == 0:
            full.optimizer_meta = {k: v for k, v in shards[0]["optimizer"].items() if k != "tensors"}
            full.scheduler = shards[0]["scheduler"]
            full.dropped = ["fp8"] if "fp8" in shards[0] else []
        parts = {c: _merge_chunk(skel, c, shards, with_optimizer, path) for c, skel in stage.items()}
        if any(_experts(m) for m in stage.values()):
            more = (_read_stage(path, [w], layout)[0] for w in (others if layout.ep > 1 else ()))
            for shard in itertools.chain(shards, more):  # one extra shard in memory at a time
                for c, skel in stage.items():
                    _take_experts(skel, c, shard, *parts[c], with_optimizer)
        del shards
        for c, skel in stage.items():
            model, optim = parts[c]
            _finish_chunk(skel, c, model, optim, path)
            full.model.update({n: t for n, t in model.items() if keep(n)})
            for kind, d in optim.items():
                full.optimizer.setdefault(kind, {}).update({n: t for n, t in d.items() if keep(n)})
    return full


def expert_biases(path: str, meta: dict) -> dict[str, torch.Tensor]:
    """The routers' ``expert_bias`` buffers of omnitron checkpoint ``path`` (per-rank state, the same on every rank
    of a stage): each pipeline stage's first rank's, from its model state (torch format) or ``expert_bias``
    (torch_dist's rank file), under the global names."""
    from omnitron.core.checkpoint.io import read_shard

    out = {}
    for _, (ranks, _) in sorted(_stage_ranks(Layout.from_dict(meta["layout"])).items()):
        shard = read_shard(path, ranks[0], meta)
        for chunk in shard.get("expert_bias") or shard.get("model") or []:
            out.update({n: t for n, t in chunk.items() if n.endswith(".mlp.router.expert_bias")})
    return out


def _read_dist(path: str, full: FullState, skeletons: dict, layout: Layout, keep, with_optimizer: bool) -> FullState:
    """:func:`read_full_state` of a ``--ckpt-format torch_dist`` checkpoint: the global tensors through
    DCP in this process (:func:`omnitron.core.checkpoint.dist.read_full`); counters from metadata.json."""
    from omnitron.core.checkpoint import dist  # DCP and DTensor: 0.6 s, only for torch_dist checkpoints

    meta = full.meta
    model, optim = dist.read_full(path, meta, list(skeletons.values()), layout.tp, keep=keep,
                                  with_optimizer=with_optimizer)
    # NOTE: no fuse_full_state: torch_dist holds replicated KV as the canonical linear_qkv and every expert whole
    full.model, full.optimizer = model | full.model, optim  # the expert biases read above
    full.optimizer_meta, full.scheduler = dict(meta["optimizer"]), meta["scheduler"]
    full.dropped = ["fp8"] if "fp8" in read_shard(path, 0, meta) else []
    return full


def _experts(model) -> list:
    return [p for p in model.parameters() if getattr(p, "expert", False)]


def rank_shard(full: FullState, chunks, tp_size: int, tp_rank: int) -> dict:
    """One rank's checkpoint shard (``model``, ``optimizer``, ``scheduler``; no RNG) for ``chunks``
    (its skeleton or live model chunks) at tensor-parallel rank ``tp_rank`` of ``tp_size``.

    Masters are written for low-precision parameters only (as the optimizer does); when the source
    kept none (fp32 weights) the weights are the masters."""
    from omnitron.core.models.gpt.state import full_state_shards

    masters = {n: t.float() for n, t in full.model.items()}
    masters.update(full.optimizer.get("master", {}))
    # fp32 weights are their own masters: where the source kept separate ones (its weights bf16 / fp16), they
    # are the fp32 weights (a low-precision weight is the master rounded, the same either way)
    weights = {**full.model, **(full.optimizer.get("master", {}) if full.optimizer else {})}
    kinds = {k: d for k, d in full.optimizer.items() if k != "master"}
    models, tensors = [], {}
    for c, chunk in enumerate(chunks):
        local = full_state_shards(chunk, weights, tp_size, tp_rank)
        sd = chunk.state_dict()
        # buffers a full state may hold (imported routing biases: the routers' expert_bias), under the global
        # names the parameters carry, or under the chunk's own names
        local.update(expert_bias_buffers(chunk, full.model))
        models.append({k: _own(local[k]) if k in local else _own(full.model[k].to(v.dtype))
                       if k.endswith("expert_bias") and k in full.model else v for k, v in sd.items()})
        # frozen parameters (requires_grad False) have no optimizer state: not strict here
        per_kind = {k: full_state_shards(chunk, d, tp_size, tp_rank, keep_dtype=True, strict=False)
                    for k, d in kinds.items()}
        low = [n for n, p in chunk.named_parameters() if keeps_master(p.dtype)]
        if low:
            per_kind["master"] = full_state_shards(chunk, masters, tp_size, tp_rank, keep_dtype=True)
        for name, p in chunk.named_parameters():
            if p.requires_grad:
                # NOTE: a kind the optimizer keeps for some parameters only (Muon: exp_avg_sq) lacks the others
                entry = {k: _own(d[name]) for k, d in per_kind.items() if name in d and (k != "master" or name in low)}
                tensors[f"chunk{c}.{name}"] = entry
    return {"model": models, "optimizer": dict(full.optimizer_meta, tensors=tensors), "scheduler": full.scheduler}


def expert_bias_buffers(chunk, model: dict) -> dict[str, torch.Tensor]:
    """``{chunk's buffer name: tensor}`` of the routers' ``expert_bias`` buffers ``model`` holds under their global
    names (an imported checkpoint's; the router's ``weight`` parameter carries the global name)."""
    params, out = dict(chunk.named_parameters()), {}
    for name, b in chunk.named_buffers():
        weight = name[:-len("expert_bias")] + "weight"
        if not name.endswith("router.expert_bias") or weight not in params:
            continue
        key = getattr(params[weight], "init_name", weight)
        if key[:-len("weight")] + "expert_bias" in model:
            out[name] = model[key[:-len("weight")] + "expert_bias"].to(b.dtype)
    return out


def _own(t: torch.Tensor) -> torch.Tensor:
    """A tensor owning exactly its storage (torch.save writes a view's whole storage)."""
    return t.detach().clone() if t.untyped_storage().nbytes() != t.nbytes else t.detach()


_LAYOUT_FLAGS = ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
                 "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                 "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")


def _target_config(flat: dict, cfg, target: Layout) -> dict:
    """The source run's flat config with the layout flags of ``target`` (so ``omnitron generate``
    and a resume read the new layout)."""
    out = {k: v for k, v in flat.items() if k not in _LAYOUT_FLAGS}
    out.update(tensor_model_parallel_size=target.tp, pipeline_model_parallel_size=target.pp,
               context_parallel_size=target.cp, expert_model_parallel_size=target.ep)
    if cfg.num_experts:  # the written shards hold whole experts
        out["expert_tensor_parallel_size"] = 1
    if target.vp:  # the chunk count holds for every split (the layers per chunk only for even ones)
        out["num_virtual_stages_per_pipeline_rank"] = target.vp
    if target.embedding:
        out["account_for_embedding_in_pipeline_split"] = True
    if target.loss:
        out["account_for_loss_in_pipeline_split"] = True
    if target.first is not None:
        out["decoder_first_pipeline_num_layers"] = target.first
    if target.last is not None:
        out["decoder_last_pipeline_num_layers"] = target.last
    return out


def convert(path: str, save_dir: str, target: Layout, ckpt_format: str | None = None, *, say=None,
            progress=None) -> str:
    """Write checkpoint directory ``path`` (an ``iter_N``) under ``save_dir`` in layout ``target`` and
    ``ckpt_format`` (``torch`` or ``torch_dist``; None: the source's); returns the new ``iter_N``
    directory. Offline, one process. Shards hold no RNG state (a resume draws fresh streams, logged);
    metadata records ``resharded_from``. ``say(text)``: a line per phase; ``progress(iterable, total)``
    wraps the shards as they are written (a progress bar)."""
    say = say or (lambda text: None)
    progress = progress or (lambda it, total: it)
    say(f"reading {path} ...")
    full = read_full_state(path)
    meta = full.meta
    cfg = model_config(meta["model"], recorded_family(meta, path))
    shape = layout_only(cfg)  # the skeletons: a recorded run's offloading / recomputation do not refuse a layout
    new_meta = {"consumed_samples": meta["consumed_samples"], "model": meta["model"], "layout": target.to_dict(),
                "config": _target_config(meta.get("config", {}), cfg, target),
                "resharded_from": Layout.from_dict(meta["layout"]).to_dict()}
    if (ckpt_format or meta.get("ckpt_format", "torch")) == "torch_dist":
        skeleton_chunks(shape, target)  # raises ConfigError when the model does not split so
        whole = list(skeleton_chunks(shape, Layout()).values())  # every parameter, in its tp1 form
        new_meta["config"]["ckpt_format"] = "torch_dist"
        say(f"writing {target.world_size} ranks' pieces as torch_dist under {save_dir} ...")
        from omnitron.core.checkpoint import dist

        return dist.write_full(save_dir, full, whole, new_meta, target.world_size)
    new_meta["config"]["ckpt_format"] = "torch"
    pc = target.parallel_config()
    ep_rank = {w: g.index(w) for g in rank_grid(pc, target.world_size)["ep"] for w in g}
    skeletons = {0: skeleton_chunks(shape, target)}  # per ep rank; raises ConfigError when the model does not split

    def shards():
        cache = {}
        for w in range(target.world_size):
            co, e = coord_of(pc, target.world_size, w), ep_rank[w]
            if (co.pp, co.tp, e) not in cache:  # dp / cp replicas hold the same shard
                cache.clear()
                if e not in skeletons:
                    skeletons[e] = skeleton_chunks(shape, target, e)
                chunks = [skeletons[e][(co.pp, c)] for c in range(target.chunks)]
                cache[(co.pp, co.tp, e)] = rank_shard(full, chunks, target.tp, co.tp)
            yield w, cache[(co.pp, co.tp, e)]

    say(f"writing {target.world_size} shards under {save_dir} ...")
    return write_checkpoint(save_dir, int(meta["iteration"]), progress(shards(), target.world_size), new_meta,
                            world_size=target.world_size)


def export_safetensors(path: str, out_file: str) -> int:
    """Every full model weight of checkpoint directory ``path`` into one safetensors file, keyed by
    global parameter name (plus the metadata's model config as a JSON string); returns the number
    of parameters written."""
    import json

    from safetensors.torch import save_file

    full = read_full_state(path, with_optimizer=False)
    tensors = {n: t.contiguous() for n, t in full.model.items()}
    os.makedirs(os.path.dirname(os.path.abspath(out_file)), exist_ok=True)
    try:
        save_file(tensors, out_file, metadata={"model": json.dumps(full.meta["model"]),
                                               "config": json.dumps(full.meta.get("config", {})),
                                               "iteration": str(full.meta["iteration"])})
    except Exception as err:  # safetensors' own SafetensorError (an I/O error while writing) is no OSError
        if type(err).__name__ != "SafetensorError":
            raise
        raise CheckpointError(f"--out {out_file}: writing failed ({' '.join(str(err).split())[:200]}); give a "
                              f"file path in a directory this job can write, with space for the model") from None
    return sum(t.numel() for t in tensors.values())
