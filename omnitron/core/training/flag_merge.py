"""Where a run's flat settings come from, merged: dataclass default < ``--model PRESET`` < ``--config FILE`` <
command line (:func:`merge_settings`), each value type-checked, Megatron's own flags translated
(:mod:`omnitron.core.training.megatron_flags`) and ``--use-checkpoint-args`` applied."""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import fields
from typing import Any

from omnitron.core.config.parallel import ConfigError
from omnitron.core.training import megatron_flags as MF
from omnitron.core.training.flag_table import _HIDDEN, options

log = logging.getLogger("omnitron.train")


def load_config_file(path: str) -> dict[str, Any]:
    """Settings from YAML/JSON, keys spelled as flags (``tensor-model-parallel-size``) or fields."""
    if not os.path.exists(path):
        raise ConfigError(f"--config {path}: file not found")
    with open(path) as f:
        text = f.read()
    if path.endswith(".json"):
        def unique(kv):
            keys = [k for k, _ in kv]
            if len(set(keys)) < len(keys):
                raise ConfigError(f"--config {path}: {next(k for k in keys if keys.count(k) > 1)!r} is given twice; "
                                  f"keep one")
            return dict(kv)

        try:
            data = json.loads(text, object_pairs_hook=unique)
        except ValueError as err:
            if isinstance(err, ConfigError):
                raise
            raise ConfigError(f"--config {path}: not valid JSON ({err}); fix the file") from None
        pairs = list(data.items()) if isinstance(data, dict) else None
    else:
        pairs = _yaml_pairs(path, text)
    if pairs is None:
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values")
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for k, v in pairs:
        key = str(k).lstrip("-").replace("-", "_")
        if key in out:  # the same setting twice (perhaps spelled once as a flag, once as a field): which one?
            both = f"{k!r} is given twice" if spelled[key] == str(k) else f"{spelled[key]!r} and {k!r} both set {key}"
            raise ConfigError(f"--config {path}: {both}; keep one")
        out[key], spelled[key] = v, str(k)
    return out


def _yaml_pairs(path: str, text: str):
    """The top-level (key, value) pairs of a YAML mapping, in order, duplicates kept (PyYAML keeps the last)."""
    import yaml

    class Pairs(yaml.SafeLoader):
        pass

    def top(loader, node):
        loader.flatten_mapping(node)
        return [(loader.construct_object(k, deep=True), loader.construct_object(v, deep=True)) for k, v in node.value]

    try:
        node = Pairs(text).get_single_node()
        if node is None:
            return []
        return top(Pairs(""), node) if isinstance(node, yaml.MappingNode) else None
    except yaml.YAMLError as err:  # its str() spans several lines: keep the problem and where
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"--config {path}: not valid YAML{where} ({what}); fix the file") from None


# settings that are not config-dataclass fields, with their types
def _str_list(value) -> list[str]:
    """A config-file value that is one string or a list of them."""
    return [value] if isinstance(value, str) else [str(v) for v in value]


_str_list.__name__ = "list"
_LAUNCH_KEYS = {"config": str, "model": str, "model_type": str, "entry": str, "model_family_module": _str_list,
                "nproc_per_node": int, "backend": str, "threads_per_process": int,
                "prompt": str, "sample_tokens": int, "sample_top_k": int, "sample_temperature": float,
                "num_layers_per_virtual_pipeline_stage": int, "num_virtual_stages_per_pipeline_rank": int}


def merge_settings(given: dict[str, Any]) -> dict[str, Any]:
    """Preset < config file < command line, every value type-checked; unknown file keys rejected."""
    opts = options()
    merged: dict[str, Any] = {}
    file_values = load_config_file(given["config"]) if given.get("config") else {}
    for key, value in file_values.items():
        if key in MF.KEYS:
            continue  # Megatron's flags: translated below
        if key in opts:
            file_values[key] = opts[key].coerce(value, f"--config {given['config']}")
        elif key in _LAUNCH_KEYS:
            try:
                file_values[key] = _LAUNCH_KEYS[key](value)
            except (TypeError, ValueError):
                raise ConfigError(f"--config {given['config']}: {key.replace('_', '-')} expects "
                                  f"{_LAUNCH_KEYS[key].__name__}, got {value!r}") from None
        else:
            raise ConfigError(f"--config {given['config']}: unknown setting {key!r}; keys are the flag names "
                              "listed by `omnitron train --help`")
    _refuse_nan(file_values, f" (in --config {given.get('config')})")
    _refuse_nan(given, "")
    preset = given.get("model", file_values.get("model"))
    if preset:
        merged.update(_preset_fields(preset))
    MF.check_command_line(given, file_values)
    file_values, file_notes = MF.translate(file_values)
    given, notes = MF.translate({k: v for k, v in given.items() if v is not None})
    merged.update(file_values)
    merged.update(given)
    for line in dict.fromkeys(file_notes + notes + _backend_notes(file_values, given)):
        log.info("%s", line)
    from omnitron.core.training.checkpoint_args import apply_checkpoint_args

    return apply_checkpoint_args(MF.resolve(merged))


_NUMBER_LISTS = frozenset({"moe_aux_loss_coeff", "rampup_batch_size", "hierarchical_context_parallel_sizes",
                           "profile_ranks"})
"""List settings whose words are numbers (the parser keeps them as strings until their config reads them)."""


def _refuse_nan(values: dict[str, Any], where: str) -> None:
    """ConfigError for a NaN setting. No setting takes NaN, and it slips through every range check written as a
    comparison (``nan < 0`` is false): ``--min-loss-scale nan`` ran every fp16 step skipped, ``--moe-aux-loss-coeff
    nan`` turned the balancing loss off, ``--moe-router-bias-update-rate nan`` made the routing bias NaN, each
    without a word (Megatron's argparse reads NaN too; its loss scaler's ``> 0`` asserts then stop it)."""
    for key, value in values.items():
        items = value if isinstance(value, (list, tuple)) else [value]
        if key in _NUMBER_LISTS:
            items = [_number(v) for v in items]
        if any(isinstance(v, float) and math.isnan(v) for v in items):
            opt = options().get(key)
            flag = opt.flag if opt is not None else "--" + key.replace("_", "-")
            raise ConfigError(f"{flag} nan{where}: not a number, which no setting takes; give a number")


def _number(word: Any) -> Any:
    """``word`` as a float where it spells one, else as given (its config refuses it naming the flag)."""
    try:
        return float(word)
    except (TypeError, ValueError):
        return word


def _backend_notes(file_values: dict[str, Any], given: dict[str, Any]) -> list[str]:
    """A config file's ``backend:`` wins over ``$OMNITRON_BACKEND`` (``--backend`` over both), so
    ``OMNITRON_BACKEND=cuda omnitron train --config FILE`` runs on the file's backend: one line says so where the two
    differ and the command line does not decide."""
    env, chosen = os.environ.get("OMNITRON_BACKEND"), file_values.get("backend")
    if not env or not chosen or env == chosen or given.get("backend"):
        return []
    return [f"backend {chosen}: the config file's backend wins over OMNITRON_BACKEND={env}; give --backend {env} "
            f"to run on {env}"]


def _preset_fields(name: str) -> dict[str, Any]:
    """The flat settings of ``--model name``, with ``model_type`` its family's name."""
    from omnitron.core.models.family import families, family_of_preset

    family = family_of_preset(name)
    if family is None:
        presets = [p for fam in families().values() for p in fam.presets]
        raise ConfigError(f"--model {name!r} is not a preset; choose one of {', '.join(presets)}")
    cfg = family.presets[name]()
    out = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in _HIDDEN and f.name != "vocab_size"}
    out["model_type"] = family.name
    return out
