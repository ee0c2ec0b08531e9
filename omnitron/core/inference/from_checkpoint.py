"""Generate from a training checkpoint: rebuild the saved layout, load the weights, gather, sample.

The checkpoint's own flat config gives the model, tokenizer and parallel layout; every rank of
that layout loads its shard into the same model chunks training used, and the model's own
gather assembles the single-process copy that samples (no assumptions about shard layouts).
"""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from omnitron.core.checkpoint import CheckpointError, find_latest, load_checkpoint, read_metadata


def settings_from_checkpoint(load: str, prompt: str, max_new_tokens: int, top_k: int, backend: str | None):
    """Validated Settings of the run that wrote the checkpoint under ``load`` (its latest)."""
    from omnitron.core.training.arguments import build_settings

    path = find_latest(load)
    if path is None:
        raise CheckpointError(f"--load {load}: no checkpoint there (no 'latest' and no iter_* directory)")
    meta = read_metadata(path)
    flat = dict(meta["config"])
    # the complete model shape as saved (not today's defaults); the vocabulary comes from the tokenizer
    flat.update({k: v for k, v in meta["model"].items() if k not in ("vocab_size", "params_dtype")})
    for key in ("load", "save", "finetune", "log_dir", "prompt"):
        flat.pop(key, None)
    world = meta["world_size"]
    flat.update(load=load, prompt=prompt, sample_tokens=max_new_tokens, sample_top_k=top_k, nproc_per_node=world)
    if backend:
        flat["backend"] = backend
    return build_settings(flat, world_size=world)


def generate_entry(settings, backend) -> None:
    """Per rank: build the chunks, load this rank's weights, print a sample on rank 0 (collective)."""
    from omnitron.core.data import build_tokenizer
    from omnitron.core.inference.sample import print_sample
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.training.checkpointing import model_dict
    from omnitron.core.training.components import build_model_chunks

    groups = ParallelGroups.build(settings.parallel, backend.collectives)
    d = settings.data
    tokenizer = build_tokenizer(d.tokenizer_type, vocab_file=d.vocab_file, merge_file=d.merge_file,
                                tokenizer_model=d.tokenizer_model, vocab_size=d.vocab_size)
    cfg = replace(settings.model, vocab_size=tokenizer.vocab_size)
    modules = build_model_chunks(cfg, groups, settings.training.seed, backend)
    meta, shard = load_checkpoint(find_latest(settings.checkpoint.load), groups.rank)
    if meta["model"]["vocab_size"] != model_dict(cfg)["vocab_size"]:
        raise CheckpointError("the checkpoint's vocabulary differs from its tokenizer's; pass the same tokenizer files")
    for m, sd in zip(modules, shard["model"]):
        m.load_state_dict(sd)
    c = SimpleNamespace(modules=modules, groups=groups, model=cfg, settings=settings, backend=backend,
                        tokenizer=tokenizer)
    print_sample(c, settings.prompt, settings.sample_tokens, top_k=settings.sample_top_k)
