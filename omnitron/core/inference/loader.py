"""Load a training checkpoint of any parallel layout for inference: into ONE process, or into this rank's
stage of a tensor x pipeline parallel job (:func:`load_sharded`).

:func:`~omnitron.core.checkpoint.reshard.read_full_state` reads the shards into full tensors by global
name (undoing tensor / pipeline / virtual-pipeline / expert splits, no process group; a sharded job's
rank keeps only the tensors its stage owns), and the family's model is built in fp32 and loaded from
them. The tokenizer is the one the run trained with (its flags are in the checkpoint's metadata); its
vocabulary must match the model's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from omnitron.core.checkpoint import CheckpointError, find_latest
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
    from omnitron.core.parallel.groups import ParallelGroups

    family = family_of(cfg)
    if family.generate is None:
        raise CheckpointError(family.generate_refusal or f"a {family.name} checkpoint has no text to generate")
    return family.build_stage(cfg, ParallelGroups.single(), backend=backend, seed=0), family.name


def _checkpoint(load: str, quiet: bool = False) -> tuple[str, dict, object]:
    """(path, metadata, fp32 model config) of the latest checkpoint under ``load``."""
    from omnitron.core.checkpoint.io import read_metadata
    from omnitron.core.checkpoint.reshard import model_config, recorded_family

    path = find_latest(load, quiet=quiet)
    if path is None:
        raise CheckpointError(f"--load {load}: no checkpoint there (no 'latest' and no iter_* directory)")
    meta = read_metadata(path)
    return path, meta, replace(model_config(meta["model"], recorded_family(meta, path)), params_dtype=torch.float32)


def _tokenizer(path: str, meta: dict, cfg):
    from omnitron.core.data import build_tokenizer
    from omnitron.core.models.family import family_of

    flat = meta.get("config", {})
    tokenizer = build_tokenizer(flat.get("tokenizer_type") or "GPT2BPETokenizer", vocab_file=flat.get("vocab_file"),
                                merge_file=flat.get("merge_file"), tokenizer_model=flat.get("tokenizer_model"),
                                vocab_size=flat.get("vocab_size"), **family_of(cfg).tokenizer_kwargs(cfg))
    if tokenizer.vocab_size != cfg.vocab_size:
        raise CheckpointError(f"{path}: the model's vocabulary ({cfg.vocab_size}) differs from its tokenizer's "
                              f"({tokenizer.vocab_size}); the tokenizer files named in the checkpoint changed")
    return tokenizer


def load_for_inference(load: str, backend=None) -> Loaded:
    """The latest checkpoint under ``load`` as one fp32, eval-mode model on ``backend``'s device."""
    from omnitron.core.checkpoint.reshard import read_full_state
    from omnitron.core.models.gpt.state import shard_full_state
    from omnitron.core.parallel.groups import ParallelGroups, resolve_backend

    backend = resolve_backend(backend, None)  # the entry points pass the chosen one
    path, meta, cfg = _checkpoint(load)
    tokenizer = _tokenizer(path, meta, cfg)
    full = read_full_state(path, with_optimizer=False)
    state = torch.random.get_rng_state()
    model, family = _build(cfg, backend)
    torch.random.set_rng_state(state)  # building initialises weights: leave the caller's RNG as it was
    shard_full_state(model, full.model, ParallelGroups.single())
    return Loaded(model=to_device(model, backend.current_device()).eval(), tokenizer=tokenizer, family=family,
                  meta=full.meta)


def load_sharded(load: str, groups, backend) -> Loaded:
    """This rank's eval-mode fp32 stage of the latest checkpoint under ``load`` over ``groups`` (tp x pp; built
    with sequence parallelism off), reading only the tensors the stage owns; GPT-family checkpoints."""
    from omnitron.core.checkpoint.reshard import needed_owners, read_full_state
    from omnitron.core.inference.sharded import ShardedStage, build_stage
    from omnitron.core.models.family import family_of
    from omnitron.core.models.gpt.state import shard_full_state

    path, meta, cfg = _checkpoint(load, quiet=groups.rank != 0)
    family = family_of(cfg)
    if family.generate is None or not family.pipelined or family.takes_images:
        raise CheckpointError(f"a {family.name} checkpoint generates in one process only; drop "
                              "--tensor-model-parallel-size / --pipeline-model-parallel-size")
    tokenizer = _tokenizer(path, meta, cfg)
    state = torch.random.get_rng_state()
    stage = build_stage(cfg, groups, backend)
    torch.random.set_rng_state(state)
    full = read_full_state(path, owners=needed_owners([stage]), with_optimizer=False)
    shard_full_state(stage, full.model, groups)
    stage = stage.eval()
    return Loaded(model=stage, tokenizer=tokenizer, family=family.name, meta=meta,
                  sharded=ShardedStage(stage, groups, backend.collectives))
