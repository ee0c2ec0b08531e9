"""The :class:`ModelFamily` contract itself (see :mod:`omnitron.core.models.family`, which registers and looks
up families): apart from the registry so a family's package can build its value without importing the
module that imports the built-in families.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from omnitron.core.parallel.pipeline.runtime import default_loss_fn
from omnitron.core.parallel.pipeline.schedules import virtual_stage
from omnitron.core.parallel.tensor.random import reseed_chunk_stream


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    """One model family, as the engine sees it (see the module docstring)."""

    name: str
    """The ``--model-type`` value (``gpt``, ``bert``, ...)."""
    description: str
    """One line for ``--model-type``'s help."""
    config_cls: type
    """The family's config dataclass; its fields that GPTConfig lacks become this family's own flags."""
    presets: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    """``--model`` preset name -> function returning a config (a preset implies its family)."""
    build_stage: Callable[..., Any]
    """``(cfg, groups, *, pre_process, post_process, layer_offset, num_layers, backend, seed) -> Module``:
    one pipeline stage (virtual chunk) over layers ``[layer_offset, layer_offset + num_layers)``. The engine
    reads the stage's ``config``, ``pre_process`` / ``post_process`` and ``rng_tracker`` (an
    :class:`~omnitron.core.parallel.tensor.random.RNGTracker`, whose streams checkpoints save)."""
    pipelined: bool = True
    """False: the whole model is one chunk, built with ``build_stage(cfg, groups, backend=, seed=)`` alone."""
    forward_step: Callable[..., Any]
    """``(chunk, module, batch, hidden) -> output``: one micro-batch through one chunk (``module``: the
    unwrapped chunk, which says ``pre_process`` / ``post_process``)."""
    loss_fn: Callable[..., Any] = default_loss_fn
    """``(last stage's output, batch) -> (loss sum, token count)``."""
    stages_read_batch: bool = False
    """Every pipeline stage reads the micro-batch (BERT's padding mask), not only the first and last."""
    build_datasets: Callable[..., Any]
    """``(settings, tokenizer, **sizes) -> (train, valid, test)``; ``sizes``: the builder's common keywords
    (``train_samples``, ``valid_samples``, ``test_samples``, ``is_builder_rank``, ``barrier``,
    ``is_node_builder``: see :func:`omnitron.core.data.cache.build_in_turn`)."""
    synthetic_data: bool = False
    """The family makes its own samples (LLaVA's synthetic captions): no ``--data-path`` files to check."""
    num_parameters: Callable[[Any], int]
    """Total parameter count of a config (the start-of-run log)."""
    validate: Callable[[Any, Any], None] | None = None
    """``(cfg, parallel config)``: the family's own refusals, run before the shared model checks."""
    check_flags: Callable[[dict], None] | None = None
    """``(merged flat settings)``: the family's refusals of flags and its defaults (e.g. its tokenizer);
    may set keys in the dict."""
    tokenizer_kwargs: Callable[[Any], dict] = lambda cfg: {}
    """Extra keywords for the tokenizer built for ``cfg`` (T5's sentinel tokens)."""
    generate: Callable[..., dict] | None = None
    """``(loaded, prompts, tokens, *, params, logprobs, images) -> dict`` (Megatron's text-generation
    response); None when the family has nothing to generate (see ``generate_refusal``)."""
    generate_refusal: str = ""
    """Why a checkpoint of this family cannot generate (with what to use instead)."""
    takes_images: bool = False
    """Generation reads one image per prompt."""
    default_prompt: str | None = None
    """``omnitron generate``'s prompt when none is given (LLaVA's captions start with "a")."""

    def own_fields(self) -> tuple[str, ...]:
        """The config fields this family adds to GPTConfig's: flags that only apply to it."""
        from omnitron.core.models.gpt.config import GPTConfig

        shared = {f.name for f in dataclasses.fields(GPTConfig)}
        return tuple(f.name for f in dataclasses.fields(self.config_cls) if f.name not in shared)

    def build_chunks(self, cfg, groups, ranges: Mapping[tuple[int, int], tuple[int, int]], pp_rank: int,
                     pp: int, chunks: int, *, backend, seed: int, style: str = "loop") -> dict[tuple[int, int], Any]:
        """``{(pp rank, chunk): stage}`` for ``pp_rank`` (None: every rank) from the layer ranges; a family
        that is not pipelined gets its one chunk ``(0, 0)``. ``style``: the chunks' placement (``v`` for the
        V-shaped schedules, see ``pipeline/schedules.py``), which decides the chunks holding the first and
        the last stage."""
        if not self.pipelined:
            return {(0, 0): self.build_stage(cfg, groups, backend=backend, seed=seed)}
        out = {}
        for (r, c), (offset, n) in sorted(ranges.items()):
            if pp_rank is not None and r != pp_rank:
                continue
            stage = virtual_stage(r, c, pp, style)
            out[(r, c)] = self.build_stage(cfg, groups, pre_process=stage == 0,
                                           post_process=stage == pp * chunks - 1, layer_offset=offset,
                                           num_layers=n, backend=backend, seed=seed)
            if c:  # a rank's later chunk: a dropout stream of its own, not a copy of its first chunk's
                reseed_chunk_stream(out[(r, c)].rng_tracker, seed, stage)
        return out
