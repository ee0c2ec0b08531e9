"""The :class:`ModelFamily` contract itself (see :mod:`omnitron.core.models.family`, which registers and looks
up families): apart from the registry so a family's package can build its value without importing the
module that imports the built-in families.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from omnitron.core.parallel.pipeline.runtime import default_loss_fn
from omnitron.core.parallel.pipeline.schedules import virtual_stage
from omnitron.core.parallel.tensor.random import reseed_chunk_stream

log = logging.getLogger(__name__)
LATER_DATASET_KEYWORDS = ("is_node_builder",)
"""Keywords ``build_datasets`` gained after the contract was published: given only to a function that takes them."""


def _takes(fn: Callable[..., Any], keyword: str) -> bool:
    """Whether ``fn`` accepts ``keyword`` (by name or ``**kwargs``); True when its signature cannot be read."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or extension callable: pass everything, as before
        return True
    return any(p.kind is p.VAR_KEYWORD or (p.name == keyword and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
               for p in params)


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
    """``(settings, tokenizer, *, train_samples, valid_samples, test_samples, is_builder_rank, barrier,
    [is_node_builder]) -> (train, valid, test)``: the builder's common keywords (see
    :func:`omnitron.core.data.cache.build_in_turn`). ``is_node_builder`` (each node's first rank, for index
    caches on each node's own disk) came later: the engine calls :meth:`datasets`, which passes it only to a
    function that names it or takes ``**kwargs``, so a family written before it keeps working (its caches are
    then built by rank 0 alone: ``--data-cache-path`` must be shared by every node)."""
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

    def datasets(self, settings, tokenizer, **sizes) -> tuple:
        """``build_datasets(settings, tokenizer, **sizes)``, less the :data:`LATER_DATASET_KEYWORDS` that it does
        not take; a node's first rank (not rank 0) that drops ``is_node_builder`` says so once."""
        dropped = [k for k in LATER_DATASET_KEYWORDS if k in sizes and not _takes(self.build_datasets, k)]
        if sizes.get("is_node_builder") and not sizes.get("is_builder_rank") and "is_node_builder" in dropped:
            log.warning("model family %r: its build_datasets takes no is_node_builder keyword, so this node "
                        "loads rank 0's index caches and builds none: give --data-cache-path a directory every "
                        "node shares (or let build_datasets take is_node_builder)", self.name)
        return self.build_datasets(settings, tokenizer, **{k: v for k, v in sizes.items() if k not in dropped})

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
