"""The flag table: every settable field of the config dataclasses as an :class:`Option`, and flat settings back
into those dataclasses.

1. :func:`_config_classes` lists ``(help-group title, config dataclass)`` for every concern, then each
   model family's config (only the fields that family adds to GPTConfig: ``--bert-binary-head``, ...).
2. :func:`options` turns every field of those classes into an :class:`Option`: field
   ``tensor_model_parallel_size: int = 1`` with the docstring under it becomes
   ``--tensor-model-parallel-size N`` (Megatron's spelling), type ``int``, default 1, help = the
   docstring. ``bool`` fields become switches (``--no-X`` too when the default is on), ``list``
   fields take several values. Exceptions: ``_FLAG_NAMES`` (a different spelling), ``_HIDDEN`` and
   :func:`_skip` (fields that are not user settings).
3. A value fans out to every dataclass with a field of that name (``--seq-length`` sets both the
   model and the data config): :func:`_build` picks each class's fields from the merged dict.

The argparse parser made from the table is :mod:`omnitron.core.training.flag_parser`.
"""
from __future__ import annotations

import ast
import functools
import inspect
from dataclasses import MISSING, dataclass, fields
from typing import Any

from omnitron.core.config.parallel import ConfigError, ParallelConfig
from omnitron.core.config.training import (CheckpointConfig, LoggingConfig, OptimizerConfig, PrecisionConfig,
                                           TrainingConfig)

# fields that are not flags: derived elsewhere, or not user settings
# Megatron's spelling where it differs from the field name
_FLAG_NAMES = {"bucket_size": "--ddp-bucket-size", "override_opt_param_scheduler": "--override-opt_param-scheduler",
               "use_checkpoint_opt_param_scheduler": "--use-checkpoint-opt_param-scheduler",
               "microbatch_group_size_per_vp_stage": "--microbatch-group-size-per-virtual-pipeline-stage"}
_HIDDEN = {"params_dtype", "reduce_scatter", "apply_scaled_init", "virtual_pipeline_model_parallel_size"}


def _config_classes() -> list[tuple[str, type]]:
    """(group title, dataclass) for every concern, model and data first."""
    from omnitron.core.data.config import DataConfig
    from omnitron.core.models.gpt.config import GPTConfig

    classes = [("model", GPTConfig), ("parallelism", ParallelConfig), ("data", DataConfig),
               ("training", TrainingConfig), ("optimizer", OptimizerConfig), ("precision", PrecisionConfig)]
    try:
        from omnitron.core.parallel.data.config import DataParallelConfig

        classes.insert(2, ("data parallelism", DataParallelConfig))
    except ImportError:
        pass
    fp8 = _fp8_config_class()
    if fp8 is not None:
        classes.append(("fp8", fp8))
    from omnitron.core.models.family import families

    # last: only each family's own fields (those GPTConfig lacks) become flags
    return classes + [("logging", LoggingConfig), ("checkpointing", CheckpointConfig)] + [
        (f"{fam.name} model", fam.config_cls) for fam in families().values() if fam.own_fields()]


def _ddp_config_class():
    try:
        from omnitron.core.parallel.data.config import DataParallelConfig
    except ImportError:
        return None
    return DataParallelConfig


def _fp8_config_class():
    try:
        from omnitron.core.precision.fp8.config import FP8Config
    except ImportError:
        return None
    return FP8Config


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass (the string literal after each field)."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for prev, node in zip(body, body[1:]):
        if isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name) and isinstance(node, ast.Expr) \
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


@dataclass(frozen=True)
class Option:
    """One flag: its dest (= field name), value kind and default."""

    dest: str
    kind: str
    """``int``, ``float``, ``str``, ``bool`` or ``list``."""
    default: Any
    help: str
    optional: bool

    @property
    def flag(self) -> str:
        return _FLAG_NAMES.get(self.dest) or "--" + self.dest.replace("_", "-")

    def coerce(self, value: Any, origin: str) -> Any:
        """Check/convert a config-file value, naming the key when it does not fit."""
        if value is None and self.optional:
            return None
        try:
            if self.kind == "bool":
                if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
                    return value.lower() in ("true", "1", "yes")
                if not isinstance(value, bool):
                    raise TypeError
                return value
            if self.kind == "list":  # one value (a number too) is a list of one
                return value.split() if isinstance(value, str) else \
                    [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
            if self.kind == "int" and isinstance(value, float) and not value.is_integer():
                raise TypeError
            return {"int": int, "float": float, "str": str}[self.kind](value)
        except (TypeError, ValueError):
            raise ConfigError(f"{origin}: {self.flag} expects {self.kind}, got {value!r}") from None


def _kind(annotation: str) -> tuple[str, bool]:
    parts = [p.strip() for p in str(annotation).split("|")]
    optional = "None" in parts
    base = [p for p in parts if p != "None"][0]
    if base.startswith("list"):
        return "list", optional
    return (base if base in ("int", "float", "str", "bool") else "str"), optional


def _skip(cls: type, name: str) -> bool:
    """Fields that are not flags of this class (the model's vocabulary comes from the tokenizer)."""
    return name in _HIDDEN or (cls.__name__ == "GPTConfig" and name == "vocab_size")


def options() -> dict[str, Option]:
    """Every settable field of every config class, keyed by dest (first definition wins); a default factory's
    value made anew on each call (a caller may change it)."""
    built, factories = _options()
    out = dict(built)
    for name, factory in factories:
        out[name] = Option(name, built[name].kind, factory(), built[name].help, built[name].optional)
    return out


@functools.lru_cache(maxsize=1)
def _options() -> tuple[dict[str, Option], tuple]:
    """(:func:`options` with the factories' defaults unset, (dest, default factory) pairs): the classes are fixed,
    and a plan's search merges flags thousands of times."""
    out: dict[str, Option] = {}
    factories = []
    for _, cls in _config_classes():
        docs = field_docs(cls)
        for f in fields(cls):
            if _skip(cls, f.name) or f.name in out:
                continue
            kind, optional = _kind(f.type)
            if f.default is MISSING and f.default_factory is not MISSING:
                factories.append((f.name, f.default_factory))
            default = f.default if f.default is not MISSING else None
            out[f.name] = Option(f.name, kind, default, docs.get(f.name, ""), optional)
    return out, tuple(factories)


def _build(cls, merged: dict[str, Any], **extra):
    kwargs = {f.name: merged[f.name] for f in fields(cls) if f.name in merged and f.name not in _HIDDEN}
    kwargs.update(extra)
    return cls(**kwargs)
