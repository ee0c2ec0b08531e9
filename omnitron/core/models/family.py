"""The model-family contract: what the engine needs from a family, declared once in its package.

A family (GPT/Llama, BERT, T5, LLaVA, or one a user adds) is one :class:`ModelFamily` value: its
config class and presets, how to build one pipeline stage, what one micro-batch's forward reads and
how its loss is reduced, its datasets, its checkpoint and generation hooks, and what it refuses.
The training loop, the checkpoint tools and the inference commands look the family up here by
name (``--model-type``) or by config class, and never branch on a type or a family name.

Adding a family: write a package that builds a :class:`ModelFamily` and passes it to
:func:`register_family` when imported; then either list the package in the built-in table below, or
name it with ``omnitron train --model-family-module PACKAGE`` (torchtitan's ``--experimental.custom_import``
idea), or declare it under the ``omnitron.model_families`` entry-point group of an installed distribution.

Only those three sources import a family's code. A checkpoint records the modules its run imported,
but reading it imports none of them: a checkpoint whose family is not registered is refused
(:func:`omnitron.core.checkpoint.reshard.recorded_family`), and the command that reads it takes
``--model-family-module`` too. Modules given on a command line are passed to the processes it spawns
through ``$OMNITRON_MODEL_FAMILY_MODULES``.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
from typing import Any, Mapping

from omnitron.core.config.parallel import ConfigError
from omnitron.core.models.family_base import ModelFamily


_FAMILIES: dict[str, ModelFamily] = {}
ENTRY_POINT_GROUP = "omnitron.model_families"
MODULES_ENV = "OMNITRON_MODEL_FAMILY_MODULES"
"""The ``--model-family-module`` modules of the command line that started this process (comma-separated)."""


def register_family(family: ModelFamily) -> ModelFamily:
    """Add ``family`` to the registry (a family module calls this when imported); returns it."""
    old = _FAMILIES.get(family.name)
    if old is not None and old.config_cls is not family.config_cls:
        raise ConfigError(f"model family {family.name!r} is registered twice (by {old.config_cls.__module__} and "
                          f"{family.config_cls.__module__}); give the new family another name")
    taken = {p: f.name for f in _FAMILIES.values() if f.name != family.name for p in f.presets}
    clash = [p for p in family.presets if p in taken]
    if clash:
        raise ConfigError(f"model family {family.name!r}: preset {clash[0]!r} already belongs to the {taken[clash[0]]} "
                          "family; rename the preset")
    _FAMILIES[family.name] = family
    return family


def _load_builtins() -> None:
    """The families shipped with omnitron, and those installed under the entry-point group."""
    if _FAMILIES.get("gpt") is not None:
        return
    from omnitron.core.models.gpt.family import GPT_FAMILY
    from omnitron.core.models.bert.family import BERT_FAMILY
    from omnitron.core.models.t5.family import T5_FAMILY
    from omnitron.core.models.multimodal.family import MULTIMODAL_FAMILY

    for fam in (GPT_FAMILY, BERT_FAMILY, T5_FAMILY, MULTIMODAL_FAMILY):
        register_family(fam)
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        ep.load()  # the module registers its family on import
    import_family_modules([m for m in os.environ.get(MODULES_ENV, "").split(",") if m])  # a spawned rank


def import_family_modules(modules) -> None:
    """Import each ``--model-family-module`` given on the command line (or in its ``--config`` file): a
    dotted module name that registers a family on import. Never called with a name a checkpoint holds.
    The names are added to ``$OMNITRON_MODEL_FAMILY_MODULES`` for the processes this one spawns."""
    for name in modules or ():
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise ConfigError(f"--model-family-module {name}: cannot import it ({err}); give a dotted module name "
                              "on the Python path that calls omnitron.core.models.family.register_family") from None
        known = [m for m in os.environ.get(MODULES_ENV, "").split(",") if m]
        if name not in known:
            os.environ[MODULES_ENV] = ",".join(known + [name])


def families() -> dict[str, ModelFamily]:
    """Every registered family by name, the built-in ones first."""
    _load_builtins()
    return dict(_FAMILIES)


def get_family(name: str) -> ModelFamily:
    """The family called ``name``; a ConfigError lists the known ones."""
    fams = families()
    if name not in fams:
        raise ConfigError(f"--model-type {name!r} is not one of {', '.join(fams)}; a family of your own needs "
                          "--model-family-module MODULE (a module that registers it)")
    return fams[name]


def family_of(cfg) -> ModelFamily:
    """The family whose config class ``cfg`` is (exact class)."""
    for fam in families().values():
        if type(cfg) is fam.config_cls:
            return fam
    raise ConfigError(f"{type(cfg).__name__} belongs to no registered model family; register its family "
                      "(omnitron.core.models.family.register_family)")


def family_of_preset(preset: str) -> ModelFamily | None:
    """The family that declares ``--model preset``, or None."""
    for fam in families().values():
        if preset in fam.presets:
            return fam
    return None


def family_of_fields(model: Mapping[str, Any], name: str | None = None) -> ModelFamily:
    """The family of a checkpoint's recorded config fields: ``name`` when the checkpoint recorded it, else
    the family whose config holds the most of the recorded fields (ties: the smaller config, so a GPT
    checkpoint is not read as a family that extends GPT)."""
    if name:
        return get_family(name)

    def score(fam):
        names = {f.name for f in dataclasses.fields(fam.config_cls)}
        return (len(names & set(model)), -len(names))

    return max(families().values(), key=score)
