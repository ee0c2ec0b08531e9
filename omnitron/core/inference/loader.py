"""Load a training checkpoint of any parallel layout for inference: into ONE process, or into this rank's
stage of a tensor x pipeline parallel job (:func:`load_sharded`).

:func:`~omnitron.core.checkpoint.reshard.read_full_state` reads the shards into full tensors by global
name (undoing tensor / pipeline / virtual-pipeline / expert splits, no process group; a sharded job's
rank keeps only the tensors its stage owns), and the family's model is built at the serving dtype (fp32, or
``--bf16`` / ``--fp16`` as Megatron's text generation server takes them: weights, activations and KV cache in
that dtype) and loaded from them. The tokenizer is the one the run trained with (its flags are in the
checkpoint's metadata); its vocabulary must match the model's.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from omnitron.core.checkpoint import CheckpointError, find_latest
from omnitron.core.checkpoint.io import read_metadata
from omnitron.core.inference import shard_load
from omnitron.core.inference.stage import ShardedStage, build_stage
from omnitron.core.models.gpt.state import shard_full_state
from omnitron.core.parallel.groups import ParallelGroups, resolve_backend
from omnitron.core.parallel.tensor.sharding import to_device


@dataclass
class Loaded:
    """A model ready to generate, with what it needs around it."""

    model: torch.nn.Module
    tokenizer: object
    family: str
    """The model family's name (``gpt``, ``t5``, ``multimodal``, ...)."""
    meta: dict
    """The checkpoint's metadata (``config`` holds the run's flat settings)."""
    sharded: object | None = None
    """A tp x pp job's :class:`~omnitron.core.inference.sharded.ShardedStage` (``model`` is then this rank's
    stage); None in one process."""
    read_bytes: int | None = None
    """Weight bytes this rank read (sliced reads: torch_dist and safetensors; None: the torch format's whole
    shards)."""

    @property
    def spec(self):
        """The :class:`~omnitron.core.models.family.ModelFamily` (its generation entry point and rules)."""
        from omnitron.core.models.family import get_family

        return get_family(self.family)

    @property
    def seed(self) -> int:
        """The run's ``--seed`` (default sampling seed; the synthetic image data's seed)."""
        return int(self.meta.get("config", {}).get("seed", 1234))


def _build(cfg, backend):
    """The single-process model of ``cfg``'s family, and the family's name (CheckpointError: a family
    that does not generate)."""
    from omnitron.core.models.family import family_of

    family = family_of(cfg)
    if family.generate is None:
        raise CheckpointError(family.generate_refusal or f"a {family.name} checkpoint has no text to generate")
    return family.build_stage(cfg, ParallelGroups.single(), backend=backend, seed=0), family.name


SERVING_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The serving dtypes by flag name (``--bf16``, ``--fp16``; neither: fp32, Megatron's default)."""


def _checkpoint(load: str, quiet: bool = False, dtype: torch.dtype = torch.float32) -> tuple[str, dict, object]:
    """(path, metadata, model config at ``dtype``) of the latest checkpoint under ``load``, or of the safetensors
    file ``load`` (``checkpoint export``'s)."""
    from omnitron.core.checkpoint.reshard import check_declared_size, model_config, recorded_family
    from omnitron.core.inference.shard_load import safetensors_meta

    if load.endswith(".safetensors"):
        path, meta = load, safetensors_meta(load)
    else:
        path = find_latest(load, quiet=quiet)
        if path is None:
            raise CheckpointError(f"--load {load}: no checkpoint there (no 'latest' and no iter_* directory)")
        meta = read_metadata(path)
    cfg = model_config(meta["model"], recorded_family(meta, path))
    files = [path] if os.path.isfile(path) else [os.path.join(path, n) for n in os.listdir(path)]
    check_declared_size(cfg, files, path)
    return path, meta, replace(cfg, params_dtype=dtype)


def _tokenizer(path: str, meta: dict, cfg):
    from omnitron.core.data import build_tokenizer
    from omnitron.core.data.tokenizers import tokenizer_kwargs
    from omnitron.core.models.family import family_of

    flat = meta.get("config", {})
    tokenizer = build_tokenizer(**tokenizer_kwargs(flat), **family_of(cfg).tokenizer_kwargs(cfg))
    if tokenizer.vocab_size != cfg.vocab_size:
        raise CheckpointError(f"{path}: the model's vocabulary ({cfg.vocab_size}) differs from its tokenizer's "
                              f"({tokenizer.vocab_size}); the tokenizer files named in the checkpoint changed")
    return tokenizer


def load_for_inference(load: str, backend=None, dtype: torch.dtype = torch.float32) -> Loaded:
    """The latest checkpoint under ``load`` as one eval-mode model in ``dtype`` on ``backend``'s device."""
    from omnitron.core.checkpoint.reshard import read_full_state

    backend = resolve_backend(backend, None)  # the entry points pass the chosen one
    path, meta, cfg = _checkpoint(load, dtype=dtype)
    tokenizer = _tokenizer(path, meta, cfg)
    if path.endswith(".safetensors"):
        return _load_sliced(path, meta, cfg, ParallelGroups.single(), backend, tokenizer)
    full = read_full_state(path, with_optimizer=False)
    state = torch.random.get_rng_state()
    model, family = _build(cfg, backend)
    torch.random.set_rng_state(state)  # building initialises weights: leave the caller's RNG as it was
    shard_full_state(model, full.model, ParallelGroups.single())
    _copy_expert_biases(model, full.model)
    return Loaded(model=to_device(model, backend.current_device()).eval(), tokenizer=tokenizer, family=family,
                  meta=full.meta)


def load_sharded(load: str, groups, backend, dtype: torch.dtype = torch.float32) -> Loaded:
    """This rank's eval-mode stage in ``dtype`` of the latest checkpoint under ``load`` (or safetensors file) over
    ``groups`` (tp x pp, or tp x ep x pp for MoE models: every rank runs the same prompts; built with sequence
    parallelism off); GPT-family checkpoints. The stage is built
    without weights and filled with its own slices (:mod:`~omnitron.core.inference.shard_load`): from a
    torch_dist checkpoint or a safetensors file only the bytes of its slices are read; the torch format's
    shards are read whole for the tensors the stage owns."""
    path, meta, cfg = _checkpoint(load, quiet=groups.rank != 0, dtype=dtype)
    _check_sharded_family(cfg)
    loaded = _load_sliced(path, meta, cfg, groups, backend, _tokenizer(path, meta, cfg))
    loaded.sharded = ShardedStage(loaded.model, groups, backend.collectives)
    if groups.ep.size > 1:  # the ep ranks are replicas running the same prompts (omnitron.core.inference.sharded)
        for m in loaded.model.modules():
            if hasattr(m, "ep_replicated"):
                m.ep_replicated = True
    return loaded


def _check_sharded_family(cfg) -> None:
    from omnitron.core.models.family import family_of

    family = family_of(cfg)
    if family.generate is None or not family.pipelined or family.takes_images:
        raise CheckpointError(f"a {family.name} checkpoint generates in one process only; drop "
                              "--tensor-model-parallel-size / --pipeline-model-parallel-size")


@torch.no_grad()
def _copy_expert_biases(model, full: dict) -> None:
    """The routers' ``expert_bias`` buffers (DeepSeek-V3's routing bias, --moe-router-enable-expert-bias) held in
    ``full`` by global name into ``model``: buffers, not parameters, so the weight copy leaves them at zero, and
    routing would pick other experts than the model trained or imported with."""
    from omnitron.core.checkpoint.reshard import expert_bias_buffers

    buffers = dict(model.named_buffers())
    for name, t in expert_bias_buffers(model, full).items():
        buffers[name].copy_(t)


def _saved_expert_biases(path: str, meta: dict) -> dict:
    """The routers' ``expert_bias`` buffers by global name of a torch_dist checkpoint (its per-rank files) or an
    exported safetensors file (full tensors); {} when the routers have none."""
    from omnitron.core.checkpoint.reshard import expert_biases

    if not meta["model"].get("moe_router_enable_expert_bias"):
        return {}
    if not path.endswith(".safetensors"):
        return expert_biases(path, meta)
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return {n: f.get_tensor(n) for n in f.keys() if n.endswith(".mlp.router.expert_bias")}


def check_sharded_layout(load: str, parallel) -> None:
    """Refuse, before any rank starts, a tp x pp layout (``parallel``, a ParallelConfig) that the latest checkpoint
    under ``load`` cannot be sampled at: CheckpointError (no checkpoint, a family generated in one process) or
    ConfigError (heads, groups, FFN width or layers that the layout does not divide), as each rank would."""
    from omnitron.core.models.family import family_of
    from omnitron.core.models.gpt.config import validate_model

    _, _, cfg = _checkpoint(load, quiet=True)
    _check_sharded_family(cfg)
    family = family_of(cfg)
    if family.validate is not None:
        family.validate(cfg, parallel)
    validate_model(cfg, parallel)


def _load_sliced(path: str, meta: dict, cfg, groups, backend, tokenizer) -> Loaded:
    """This rank's stage over ``groups``, built on ``meta``, given storage for its shards only and filled from
    ``path`` (torch_dist, safetensors or torch format), on the backend's device, in eval mode."""
    from omnitron.core.checkpoint.reshard import needed_owners, read_full_state
    from omnitron.core.models.family import family_of

    if not family_of(cfg).pipelined:
        raise CheckpointError(f"--load {path}: sliced loading reads GPT-family models; load a {family_of(cfg).name} "
                              f"checkpoint directory (torch or torch_dist) instead")
    with shard_load.meta_parameters():
        stage = build_stage(cfg, groups, backend, on_device=False)
    stage = shard_load.materialize(stage, "cpu")
    read = None
    if path.endswith(".safetensors"):
        read = shard_load.read_safetensors(path, stage, shard_load.stage_pieces(stage, groups))
    elif meta.get("ckpt_format") == "torch_dist":
        read = shard_load.read_dist(path, meta, shard_load.stage_pieces(stage, groups))
    else:
        full = read_full_state(path, owners=needed_owners([stage]), with_optimizer=False)
        shard_full_state(stage, full.model, groups)
    if read is not None:
        _copy_expert_biases(stage, _saved_expert_biases(path, meta))
    else:
        _copy_expert_biases(stage, full.model)
    stage = to_device(stage, backend.current_device()).eval()
    return Loaded(model=stage, tokenizer=tokenizer, family=family_of(cfg).name, meta=meta, read_bytes=read)
