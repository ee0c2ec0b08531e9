"""Command-line and config-file settings -> validated dataclasses, before any process group exists.

How a flag comes to exist (no flag is written out by hand except the launch options):

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

Precedence: dataclass default < ``--model PRESET`` < ``--config FILE`` < command line
(:func:`merge_settings`); :func:`build_settings` then builds and cross-checks the configs.
"""
from __future__ import annotations

import argparse
import ast
import functools
import inspect
import json
import logging
import os
import time
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from omnitron.core.config.parallel import ConfigError, ParallelConfig, data_parallel_size
from omnitron.core.config.training import (CheckpointConfig, LoggingConfig, OptimizerConfig, PrecisionConfig,
                                           TrainingConfig)
from omnitron.core.training import megatron_flags as MF

log = logging.getLogger("omnitron.train")

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


def _help(opt: Option) -> str:
    text = opt.help
    for prefix in (f"``{opt.flag}``:", f"{opt.flag}:", f"{opt.flag} "):
        if text.startswith(prefix):
            text = text[len(prefix):].strip()
    if opt.default not in (None, False, [], "") and opt.kind != "bool":
        text += f" (default: {opt.default})"
    return text.replace("%", "%%")


@functools.lru_cache(maxsize=1)
def megatron_flag_names() -> frozenset[str]:
    """Every flag of Megatron-LM's argument parser (megatron_flags.txt: d98e8a6)."""
    with open(os.path.join(os.path.dirname(__file__), "megatron_flags.txt")) as f:
        return frozenset(line.strip() for line in f if line.startswith("--"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every training flag; defaults are suppressed so that given flags can be told apart. A Megatron flag
    omnitron lacks is named as Megatron's when given (``parser.foreign_flags``, read by the parser's error)."""
    parser.foreign_flags = ("Megatron-LM", megatron_flag_names())
    launch = parser.add_argument_group("launch")
    launch.add_argument("--config", metavar="FILE", help="YAML or JSON file of settings (keys = flag names); "
                        "flags on the command line win")
    from omnitron.core.models.family import families

    fams = families().values()
    launch.add_argument("--model", metavar="PRESET", help="start from a model preset: " + ", ".join(
        p for fam in fams for p in fam.presets) + " (a preset implies its --model-type)")
    launch.add_argument("--model-type", choices=[fam.name for fam in fams], help="model family: " + ", ".join(
        fam.description for fam in fams))
    launch.add_argument("--entry", metavar="SCRIPT", help="the Megatron training script these flags were written "
                        "for: " + ", ".join(MEGATRON_ENTRIES) + " (a path or .py is fine); sets --model-type, since "
                        "a script's flags alone do not tell BERT from GPT")
    launch.add_argument("--model-family-module", action="append", metavar="MODULE", help="import MODULE first (a "
                        "dotted module name on the Python path); it registers a model family of its own with "
                        "omnitron.core.models.family.register_family (repeatable)")
    launch.add_argument("--nproc-per-node", type=int, metavar="N", help="spawn N local worker processes "
                        "(each with its share of the cores); not needed under torchrun (default: 1)")
    launch.add_argument("--backend", help="cpu, cuda, musa, sim, an installed plug-in's name or auto (default: a "
                        "--config file's backend, else $OMNITRON_BACKEND, else auto)")
    launch.add_argument("--threads-per-process", type=int, metavar="T",
                        help="torch threads per worker (default: $OMP_NUM_THREADS, else the cores shared "
                        "among the node's workers)")
    launch.add_argument("--prompt", help="after training, print a sampled continuation of this text")
    launch.add_argument("--sample-tokens", type=int, metavar="N", help="tokens to sample for --prompt (default: 40)")
    launch.add_argument("--sample-top-k", type=int, metavar="K", help="sample among the K likeliest tokens; "
                        "1 is greedy (default: 20)")
    launch.add_argument("--sample-temperature", type=float, metavar="T",
                        help="divide the logits by T before sampling for --prompt (default: 0.8)")
    opts = options()
    seen_groups: dict[str, argparse._ArgumentGroup] = {}
    owner = {}
    for title, cls in _config_classes():
        for f in fields(cls):
            if not _skip(cls, f.name):
                owner.setdefault(f.name, title)
    for dest, opt in opts.items():
        title = owner[dest]
        group = seen_groups.get(title) or seen_groups.setdefault(title, parser.add_argument_group(title))
        if opt.kind == "bool":
            # flags that default to on (or to "auto") also get a --no- form
            action = argparse.BooleanOptionalAction if opt.default is not False else "store_true"
            group.add_argument(opt.flag, dest=dest, action=action, help=_help(opt))
        elif opt.kind == "list":
            group.add_argument(opt.flag, dest=dest, nargs="+", metavar="X", help=_help(opt))
        else:
            group.add_argument(opt.flag, dest=dest, type={"int": int, "float": float, "str": str}[opt.kind],
                               metavar=dest.split("_")[-1].upper(), help=_help(opt))
    seen_groups["parallelism"].add_argument("--num-layers-per-virtual-pipeline-stage", type=int, metavar="N",
                                            help="layers per model chunk (the --account-for-...-in-pipeline-"
                                            "split slots included): interleaved pipeline schedule")
    seen_groups["parallelism"].add_argument("--num-virtual-stages-per-pipeline-rank", type=int, metavar="V",
                                            help="model chunks per pipeline rank: interleaved pipeline schedule "
                                            "(the form uneven --decoder-first/last-pipeline-num-layers take)")
    seen_groups["model"].add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false",
                                      help="no biases in linear layers (same as --no-add-bias-linear)")
    seen_groups[owner["bert_binary_head"]].add_argument("--bert-no-binary-head", dest="bert_binary_head",
                                                        action="store_false",
                                                        help="Megatron's spelling of --no-bert-binary-head")
    seen_groups[owner["log_loss_scale_to_tensorboard"]].add_argument(
        "--disable-log-loss-scale-to-tensorboard", dest="log_loss_scale_to_tensorboard", action="store_false",
        help="same as --no-log-loss-scale-to-tensorboard (Megatron's other spelling)")
    seen_groups["optimizer"].add_argument("--muon-no-split-qkv", dest="muon_split_qkv", action="store_false",
                                          help="orthogonalise the fused QKV weight whole (same as --no-muon-split-qkv)")
    from omnitron.core.training.megatron_flags import add_megatron_flags

    add_megatron_flags(parser)


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


def _sample_temperature(value) -> float:
    """--sample-temperature, default 0.8; it must be positive (top-k 1 is the greedy choice)."""
    t = 0.8 if value is None else float(value)
    if not t > 0:
        raise ConfigError(f"--sample-temperature {value} must be positive; for greedy sampling give --sample-top-k 1")
    return t


_str_list.__name__ = "list"
_LAUNCH_KEYS = {"config": str, "model": str, "model_type": str, "entry": str, "model_family_module": _str_list, "nproc_per_node": int, "backend": str, "threads_per_process": int,
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
    preset = given.get("model", file_values.get("model"))
    if preset:
        merged.update(_preset_fields(preset))
    file_values, file_notes = MF.translate(file_values)
    given, notes = MF.translate({k: v for k, v in given.items() if v is not None})
    merged.update(file_values)
    merged.update(given)
    for line in dict.fromkeys(file_notes + notes + _backend_notes(file_values, given)):
        log.info("%s", line)
    from omnitron.core.training.checkpoint_args import apply_checkpoint_args

    return apply_checkpoint_args(MF.resolve(merged))


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


@dataclass
class Settings:
    """Every validated config of one training run, plus launch options."""

    model: Any
    parallel: ParallelConfig
    data: Any
    training: TrainingConfig
    optim: OptimizerConfig
    precision: PrecisionConfig
    ddp: Any
    """DataParallelConfig (gradient buckets, overlap), when the data-parallel package is present."""
    fp8: Any
    """FP8Config when --fp8-format was given, else None."""
    logging: LoggingConfig
    checkpoint: CheckpointConfig
    world_size: int
    nproc_per_node: int
    backend: str | None
    threads: int | None
    prompt: str | None
    sample_tokens: int
    sample_top_k: int
    sample_temperature: float
    flat: dict[str, Any]
    """The merged flat settings: what was given (preset, file, flags)."""
    model_type: str = "gpt"
    """``--model-type``: the model family's registered name (``gpt``, ``bert``, ``t5``, ``multimodal``, ...)."""
    started_at: float = field(default_factory=time.time, compare=False)
    """When the job started (``time.time()`` as the settings were built; spawned workers get the launcher's):
    --exit-duration-in-mins counts from here, so the startup (model build, data indexes, checkpoint load) counts
    towards the limit, as Megatron counts from its program's start."""

    @property
    def dp(self) -> int:
        return data_parallel_size(self.parallel, self.world_size)

    @property
    def num_microbatches(self) -> int:
        return self.training.global_batch_size // (self.training.micro_batch_size * self.dp)

    @property
    def eval_microbatches(self) -> int:
        """Micro-batches a rank runs for one evaluation batch (--eval-global-batch-size)."""
        return self.training.eval_batch // (self.training.micro_batch_size * self.dp)


def resolved_config(settings: Settings) -> dict[str, Any]:
    """What a checkpoint records as the run's config: every setting's value, defaults included (an export or
    a later reader must not guess a default, e.g. the default tokenizer), the given ones over them, and the
    values the configs resolved (the global batch size, the iterations of a --train-samples run)."""
    from omnitron.core.models.family import families

    others = {k for name, fam in families().items() if name != settings.model_type for k in fam.own_fields()}
    out = {dest: opt.default for dest, opt in options().items() if dest not in others}  # not other families' own
    # NOTE: not the model's vocab_size (the tokenizer's, padded rows excluded): --vocab-size is NullTokenizer's V
    out.update({f.name: getattr(settings.model, f.name) for f in fields(settings.model)
                if f.name in out and f.name != "vocab_size"})
    for cfg in (settings.data, settings.training, settings.optim, settings.logging, settings.checkpoint):
        out.update({f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name in out})
    out.update(settings.flat)
    for key in _TOKENIZER_FILES:  # a reader (generate, serve, export) may run from another directory
        if isinstance(out.get(key), str) and not os.path.isabs(out[key]) and os.path.exists(out[key]):
            out[key] = os.path.abspath(out[key])
    return out


_TOKENIZER_FILES = ("vocab_file", "merge_file", "tokenizer_model")
"""Settings naming the tokenizer's files, recorded as absolute paths (a hub name that is no file stays as given)."""


def _build(cls, merged: dict[str, Any], **extra):
    kwargs = {f.name: merged[f.name] for f in fields(cls) if f.name in merged and f.name not in _HIDDEN}
    kwargs.update(extra)
    return cls(**kwargs)


def build_settings(merged: dict[str, Any], world_size: int | None = None) -> Settings:
    """Construct and cross-validate every config; raises ConfigError naming the flag and fix. One helper per
    concern below builds its configs and checks what it alone can, in this order."""
    if "num_layers" not in merged and merged.get("encoder_num_layers"):  # Megatron's T5: --num-layers is the encoder's
        merged = {**merged, "num_layers": merged["encoder_num_layers"]}
    missing = [o for o in ("num_layers", "hidden_size", "num_attention_heads") if o not in merged]
    if missing:
        flags = ", ".join("--" + m.replace("_", "-") for m in missing)
        raise ConfigError(f"the model is not defined: give {flags}, or start from a preset with --model gpt2_tiny")
    given_nproc = merged.get("nproc_per_node")
    nproc = 1 if given_nproc is None else int(given_nproc)  # NOTE: not ``or 1``: 0 is a setting to refuse
    if nproc < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1 (worker processes on this node), got {nproc}")
    world = world_size or int(os.environ.get("WORLD_SIZE", nproc))
    precision = _build(PrecisionConfig, merged)
    merged = _nan_check_default(merged, precision)
    family, model, parallel = _model_settings(merged, precision)
    training = _training_settings(merged, data_parallel_size(parallel, world), model.seq_length)
    if training.calculate_per_token_loss and getattr(model, "num_experts", None):
        raise ConfigError("--calculate-per-token-loss with MoE: the load-balancing loss is weighted per micro-batch, "
                          "not per token, yet; drop --calculate-per-token-loss (or train a dense model)")
    if getattr(model, "num_experts", None):
        from omnitron.core.transformer.moe.validate import check_router_trains

        check_router_trains(model)
    _check_mtp(merged, family.name, training)
    if parallel.overlap_moe_expert_parallel_comm:
        from omnitron.core.parallel.pipeline.combined import check_schedule

        check_schedule(training.pipeline_schedule)
    _check_schedules(training, parallel, data_parallel_size(parallel, world), model.seq_length)
    data = _data_settings(merged, model, parallel, training)
    _check_t5_corruption(family.name, model, data)
    fp8 = _fp8_settings(merged)
    if fp8 is not None:
        fp8.check_layers(model.num_layers, parallel.pipeline_model_parallel_size)
    logging_cfg = _build(LoggingConfig, merged)
    logging_cfg.check_world(world)
    checkpoint = _build(CheckpointConfig, merged, **({"no_load_optim": True} if training.skip_train else {}))
    optim = _build(OptimizerConfig, merged)
    ddp = _ddp_settings(merged, precision)
    if ddp is not None:
        from omnitron.core.parallel.data.config import check_fsdp2

        check_fsdp2(ddp, family=family.name, model=model, parallel=parallel, dp=data_parallel_size(parallel, world),
                    fp8=fp8, checkpoint=checkpoint, training=training)
    _check_onebit(optim, ddp, precision, parallel, model)
    if optim.optimizer == "muon" and ddp is not None and getattr(ddp, "use_torch_fsdp2", False):
        raise ConfigError("--optimizer muon orthogonalises whole matrices, which --use-torch-fsdp2 shards by rows "
                          "without a gather step yet; use --use-distributed-optimizer or drop --use-torch-fsdp2")
    _check_muon_whole_qkv(optim, model, parallel)
    _check_run(training, data, checkpoint)
    from omnitron.core.capture import check_settings

    check_settings(training, model, parallel, fp8, ddp)
    model_type = family.name
    return Settings(model=model, parallel=parallel, data=data, training=training, optim=optim, precision=precision,
                    ddp=ddp, fp8=fp8, logging=logging_cfg, checkpoint=checkpoint, world_size=world, nproc_per_node=nproc,
                    backend=merged.get("backend"), threads=merged.get("threads_per_process"),
                    prompt=merged.get("prompt"), sample_tokens=int(merged.get("sample_tokens") or 40),
                    sample_top_k=int(merged.get("sample_top_k") or 20),
                    sample_temperature=_sample_temperature(merged.get("sample_temperature")),
                    flat={k: v for k, v in merged.items() if k not in ("config", "nproc_per_node")}, model_type=model_type)




def _model_settings(merged: dict[str, Any], precision: PrecisionConfig):
    """(family, model config, parallel config): the family's config class, the virtual pipeline size from
    ``--num-layers-per-virtual-pipeline-stage`` or ``--num-virtual-stages-per-pipeline-rank``, the family's and the
    shared model checks."""
    from omnitron.core.models.gpt.config import validate_model
    from omnitron.core.parallel.pipeline.layout import config_layer_ranges, virtual_pipeline_size
    from omnitron.core.precision import params_dtype

    # the model's vocabulary comes from the tokenizer (--vocab-size is NullTokenizer's setting)
    family = _model_family(merged)
    model = _build(family.config_cls, {k: v for k, v in merged.items() if k != "vocab_size"},
                   params_dtype=params_dtype(precision))
    pp = int(merged.get("pipeline_model_parallel_size", 1))
    vp = virtual_pipeline_size(model.num_layers, pp, merged.get("num_layers_per_virtual_pipeline_stage"),
                               merged.get("num_virtual_stages_per_pipeline_rank"),
                               merged.get("decoder_first_pipeline_num_layers"),
                               merged.get("decoder_last_pipeline_num_layers"),
                               bool(merged.get("account_for_embedding_in_pipeline_split")),
                               bool(merged.get("account_for_loss_in_pipeline_split")))
    parallel = _build(ParallelConfig, merged, virtual_pipeline_model_parallel_size=vp)
    if family.validate is not None:
        family.validate(model, parallel)
    validate_model(model, parallel, check_layers=not parallel.uneven_pipeline)
    if parallel.uneven_pipeline:  # the layer split itself is checked here, naming the flags
        from omnitron.core.parallel.pipeline.schedules import schedule_style

        config_layer_ranges(model.num_layers, parallel, schedule_style(merged.get("pipeline_schedule")))
    return family, model, parallel


def _check_mtp(merged: dict[str, Any], family: str, training: TrainingConfig) -> None:
    """Multi-token prediction runs in the GPT family, weighted per micro-batch, on unpacked documents."""
    if not merged.get("mtp_num_layers"):
        return
    if family != "gpt":
        raise ConfigError(f"--mtp-num-layers: multi-token prediction is built for the gpt family only, not "
                          f"{family}; drop the flag")
    if training.calculate_per_token_loss:
        raise ConfigError("--mtp-num-layers with --calculate-per-token-loss: the MTP loss is weighted per "
                          "micro-batch, not per token, yet; drop --calculate-per-token-loss")
    if merged.get("reset_attention_mask"):
        raise ConfigError("--mtp-num-layers with --reset-attention-mask: the shifted tokens would cross document "
                          "boundaries; drop --reset-attention-mask")


def _nan_check_default(merged: dict[str, Any], precision: PrecisionConfig) -> dict[str, Any]:
    """``merged`` with --check-for-nan-in-loss-and-grad off under --fp16 with dynamic loss scaling, as Megatron's
    validate_args sets it whatever was asked: there a non-finite loss or gradient is the scaler's signal (the step
    is skipped, counted in nan_iters, and the scale backs off), not a reason to stop; kept on, the check would stop
    the run at the first overflow (iteration 1 at the initial scale 2^32). A run that names the flag is told."""
    if not (precision.fp16 and precision.loss_scale is None):
        return merged
    if merged.get("check_for_nan_in_loss_and_grad", False):  # named (a flag, a file): it cannot hold here
        log.warning("--check-for-nan-in-loss-and-grad is off: --fp16 with dynamic loss scaling skips non-finite steps "
                    "and backs off the scale (Megatron's validate_args turns the check off the same way); for the "
                    "check under fp16 give a constant --loss-scale")
    else:
        log.info("--check-for-nan-in-loss-and-grad is off: --fp16 with dynamic loss scaling skips non-finite steps "
                 "(as Megatron)")
    return {**merged, "check_for_nan_in_loss_and_grad": False}


def _training_settings(merged: dict[str, Any], dp: int, seq_length: int) -> TrainingConfig:
    """The training config; ``--global-batch-size`` defaults to one micro-batch per data-parallel rank, or with
    ``--step-batch-size-schedule`` to the schedule's last batch size."""
    from dataclasses import replace

    training = _build(TrainingConfig, merged)
    mbs = training.micro_batch_size
    if training.step_batch_size_schedule is not None:
        training = replace(training, global_batch_size=_schedule_final_batch(training, seq_length))
    if training.global_batch_size is None:
        training = replace(training, global_batch_size=mbs * dp)
    if training.global_batch_size % (mbs * dp):
        raise ConfigError(f"--global-batch-size {training.global_batch_size} is not a multiple of --micro-batch-size "
                          f"{mbs} x data-parallel size {dp} = {mbs * dp}; change one of them")
    if training.eval_batch % (mbs * dp):
        raise ConfigError(f"--eval-global-batch-size {training.eval_batch} is not a multiple of --micro-batch-size "
                          f"{mbs} x data-parallel size {dp} = {mbs * dp}; change it")
    _check_schedule_units(merged, training)
    if training.train_samples is None:
        return training
    iters = batch_ramp(training, dp, seq_length).iterations(training.train_samples)
    if iters < 1:
        raise ConfigError(f"--train-samples {training.train_samples} is less than one global batch "
                          f"({training.global_batch_size}); give more samples")
    return replace(training, train_iters=iters)


def batch_ramp(training: TrainingConfig, dp: int, seq_length: int):
    """The run's :class:`~omnitron.core.training.batches.BatchRamp` (batch size per step)."""
    from omnitron.core.training.batches import BatchRamp, parse_step_schedule

    ramp = tuple(training.rampup_batch_size) if training.rampup_batch_size else None
    text = training.step_batch_size_schedule
    steps = parse_step_schedule(text, seq_length) if text else None
    return BatchRamp(training.global_batch_size, training.micro_batch_size * dp, ramp, steps)


def _schedule_final_batch(training: TrainingConfig, seq_length: int) -> int:
    """The schedule's last batch size (the run's --global-batch-size); a different --global-batch-size is refused.
    NOTE: Megatron at d98e8a6 refuses any --global-batch-size beside the schedule, though its GPT-3 175B script
    passes the schedule's last size; that one agrees with the schedule, so it is accepted here."""
    from omnitron.core.training.batches import parse_step_schedule

    steps = parse_step_schedule(training.step_batch_size_schedule, seq_length)
    final = steps[-1][1]
    if training.global_batch_size not in (None, final):
        raise ConfigError(f"--global-batch-size {training.global_batch_size} with --step-batch-size-schedule: the "
                          f"schedule ends at {final}; drop --global-batch-size (the schedule sets every step's)")
    return final


def _check_schedules(training: TrainingConfig, parallel: ParallelConfig, dp: int, seq_length: int) -> None:
    """Every micro-batch count the run takes (one, or each of a ramp's, and an evaluation's) has a pipeline
    schedule: a schedule's own limits (interleaving needs multiples of pp, DualPipeV 2 pp micro-batches) stop the
    command line, not the ranks after they started (an evaluation's count, from --eval-global-batch-size, would
    stop them at the first evaluation, before that iteration's checkpoint)."""
    from omnitron.core.parallel.pipeline.schedules import cached_schedule

    ramp = "--rampup-batch-size" if training.rampup_batch_size else \
        "--step-batch-size-schedule" if training.step_batch_size_schedule else None
    counts = [(n, f"{ramp}: a step of {n} micro-batches: " if ramp else "")
              for n in batch_ramp(training, dp, seq_length).sizes()]
    if training.eval_iters:  # evaluations run the same schedule's forwards
        n = training.eval_batch // (training.micro_batch_size * dp)
        counts.append((n, f"--eval-global-batch-size {training.eval_batch}: an evaluation of {n} micro-batches "
                          f"(change --eval-global-batch-size, or --eval-iters 0 for none): "))
    for n, where in counts:
        try:
            cached_schedule(training.pipeline_schedule, parallel.pipeline_model_parallel_size,
                            parallel.virtual_pipeline_model_parallel_size, n,
                            parallel.microbatch_group_size_per_vp_stage)
        except ConfigError as err:
            raise ConfigError(f"{where}{err}") from None


_ITER_LR = ("lr_decay_iters", "lr_warmup_iters", "lr_wsd_decay_iters")
_SAMPLE_LR = ("lr_decay_samples", "lr_warmup_samples", "lr_wsd_decay_samples")


def _check_schedule_units(merged: dict[str, Any], training: TrainingConfig) -> None:
    """Megatron's rule: a run counts iterations or samples, and its learning-rate schedule the same unit."""
    samples = training.train_samples is not None
    if samples and "train_iters" in merged:
        raise ConfigError("give --train-iters or --train-samples, not both")
    wrong, unit, other = (_ITER_LR, "samples", "iters") if samples else (_SAMPLE_LR, "iters", "samples")
    for key in wrong:
        if merged.get(key):
            flag, fix = (k.replace("_", "-") for k in (key, key.replace(other, unit)))
            run = "--train-samples" if samples else "--train-iters (no --train-samples)"
            counts = "samples" if samples else "iterations"
            raise ConfigError(f"--{flag} does not apply to a run of {run}: the schedule counts {counts}; use --{fix}")


def _data_settings(merged: dict[str, Any], model, parallel: ParallelConfig, training: TrainingConfig):
    """The data config, at the model's sequence length and the run's seed."""
    from omnitron.core.data.config import DataConfig

    data = _build(DataConfig, merged, seq_length=model.seq_length, seed=training.seed)
    _check_data_sources(merged, data)
    if data.reset_attention_mask and parallel.context_parallel_size > 1:
        raise ConfigError(f"--reset-attention-mask with --context-parallel-size {parallel.context_parallel_size}: "
                          "ring attention has no per-document mask; use --context-parallel-size 1 or drop "
                          "--reset-attention-mask")
    return data


def _check_data_sources(merged: dict[str, Any], data) -> None:
    """Megatron's rules for where the data comes from: one source (``--mock-data``, ``--data-path`` or the per-split
    paths; validate_args asserts it), and ``--split`` only with ``--data-path`` (BlendedMegatronDatasetConfig: "split
    and blend_per_split are incompatible"; a per-split file is read whole)."""
    given = [flag for flag, _ in data.path_flags()]
    if data.mock_data and given:
        raise ConfigError(f"--mock-data with {' '.join(given)}: give one data source (Megatron refuses both: synthetic "
                          "tokens or the files); drop --mock-data or the paths")
    if data.per_split and merged.get("split") is not None:
        raise ConfigError(f"--split {merged['split']} with {' '.join(given)}: each split reads all of its own files, "
                          "so there is nothing to cut (Megatron refuses both); drop --split, or give --data-path")


def _fp8_settings(merged: dict[str, Any]):
    """FP8Config when ``--fp8-format`` switches FP8 on, else None (other ``--fp8-*`` flags alone are errors)."""
    fp8_cls = _fp8_config_class()
    fp8_on = merged.get("fp8_format") is not None  # as Megatron: --fp8-format switches FP8 on
    fp8 = _build(fp8_cls, merged) if (fp8_cls is not None and fp8_on) else None
    if fp8_on and fp8_cls is None:
        raise ConfigError("--fp8-format needs omnitron.core.precision.fp8, which this build lacks; drop the FP8 flags")
    if fp8 is None and any(k.startswith("fp8_") for k in merged):
        raise ConfigError("--fp8-recipe and the other --fp8-* settings need --fp8-format e4m3|hybrid to switch FP8 on")
    return fp8


def _ddp_settings(merged: dict[str, Any], precision: PrecisionConfig):
    """The data-parallel config, as Megatron's validate_args sets it: with --bf16 gradients are accumulated and
    all-reduced in fp32 unless --grad-reduce-in-bf16, which wins over --accumulate-allreduce-grads-in-fp32 (Megatron
    drops the latter without a word; here a warning says so). Without --bf16 both flags stay as given (there
    --grad-reduce-in-bf16 changes nothing, as in Megatron)."""
    from dataclasses import replace

    ddp = _build(_ddp_config_class(), merged) if _ddp_config_class() else None
    if ddp is None or not precision.bf16:
        return ddp
    if ddp.grad_reduce_in_bf16:
        if ddp.accumulate_allreduce_grads_in_fp32:
            log.warning("--accumulate-allreduce-grads-in-fp32 is off: --grad-reduce-in-bf16 with --bf16 accumulates "
                        "and reduces gradients in bf16 (Megatron lets it win the same way); drop one of the two flags")
        return replace(ddp, accumulate_allreduce_grads_in_fp32=False)
    # as Megatron: bf16 training accumulates and all-reduces gradients in fp32 (bf16 sums of
    # many micro-batches lose the small contributions) unless --grad-reduce-in-bf16 asks for bf16
    return replace(ddp, accumulate_allreduce_grads_in_fp32=True)


def _check_onebit(optim: OptimizerConfig, ddp, precision: PrecisionConfig, parallel: ParallelConfig, model) -> None:
    """What --optimizer onebit_adam cannot combine with, each refused with the reason and the fix."""
    if optim.optimizer != "onebit_adam":
        if optim.onebit_freeze_step is not None:
            raise ConfigError("--onebit-freeze-step applies to --optimizer onebit_adam only; add it or drop the flag")
        return
    why = "--optimizer onebit_adam"
    if ddp is not None and ddp.use_distributed_optimizer:
        raise ConfigError(f"{why} all-reduces the full momentum on every data-parallel rank, which "
                          "--use-distributed-optimizer shards; drop --use-distributed-optimizer or use --optimizer adam")
    if ddp is not None and getattr(ddp, "use_torch_fsdp2", False):
        raise ConfigError(f"{why} all-reduces the full momentum on every data-parallel rank, which "
                          "--use-torch-fsdp2 shards; drop --use-torch-fsdp2 or use --optimizer adam")
    if precision.fp16:
        raise ConfigError(f"{why} has no fp16 loss-scale skipping over local gradients; use --bf16 (or fp32)")
    if precision.loss_scale is not None and precision.bf16:
        raise ConfigError(f"{why} has no loss-scale skipping over local gradients; drop --loss-scale")
    if parallel.context_parallel_size > 1:
        raise ConfigError(f"{why} is not implemented with context parallelism; use --context-parallel-size 1")
    if getattr(model, "num_experts", None):
        raise ConfigError(f"{why} is not implemented for MoE experts (reduced over expert-data-parallel ranks); "
                          "drop --num-experts or use --optimizer adam")


def _check_muon_whole_qkv(optim: OptimizerConfig, model, parallel: ParallelConfig) -> None:
    """--muon-no-split-qkv orthogonalises the fused QKV weight whole; with fewer query groups than tp ranks the
    attention keeps it as two parameters (linear_q sharded, linear_kv replicated), so no rank holds it."""
    if (optim.optimizer != "muon" or optim.muon_split_qkv or not getattr(model, "num_attention_heads", None)
            or getattr(model, "multi_latent_attention", False)):
        return
    from omnitron.core.transformer.shapes import query_groups

    groups, tp = query_groups(model), parallel.tensor_model_parallel_size
    if groups < tp:
        raise ConfigError(f"--muon-no-split-qkv orthogonalises the fused QKV weight whole, but --num-query-groups "
                          f"{groups} < --tensor-model-parallel-size {tp} keeps it as a sharded query and a replicated "
                          "key/value weight; drop --muon-no-split-qkv or use a tensor-parallel size <= the groups")


def _check_t5_corruption(family: str, model, data) -> None:
    """T5: the decoder and the sentinels hold the most a sample's span corruption can make at --mask-prob (the
    dataset's own check, here before any work)."""
    if family != "t5" or not getattr(model, "vocab_extra_ids", 0):
        return
    from omnitron.core.data.t5_dataset import corruption_problem
    from omnitron.core.models.t5.config import decoder_length

    problem = corruption_problem(model.seq_length, decoder_length(model), model.vocab_extra_ids, data.mask_prob)
    if problem:
        raise ConfigError(problem)


def _check_run(training: TrainingConfig, data, checkpoint: CheckpointConfig) -> None:
    """Cross-checks between the run's configs: validation needs a validation split; --finetune needs --load."""
    if training.eval_interval and data.per_split and not data.valid_data_path:
        raise ConfigError(f"--eval-interval {training.eval_interval} needs --valid-data-path when the splits have "
                          "their own files; add it or use --eval-interval 0")
    if data.split and not data.mock_data and not data.per_split:
        from omnitron.core.data.config import split_weights

        weights = split_weights(data.split)
        if weights[0] == 0:
            raise ConfigError(f"--split {data.split} gives training no documents; give the first (training) share a "
                              f"weight, e.g. --split 969,30,1")
        if training.eval_interval and weights[1] == 0:
            raise ConfigError(f"--eval-interval {training.eval_interval} needs a validation split, but --split "
                              f"{data.split} gives it none; use e.g. --split 969,30,1 or --eval-interval 0")
    if training.skip_train and not training.eval_iters:
        raise ConfigError("--skip-train with --eval-iters 0 evaluates nothing; give --eval-iters N (batches of the "
                          "validation and test splits to evaluate)")
    if checkpoint.finetune and not checkpoint.load:
        raise ConfigError("--finetune needs --load DIR (the checkpoint whose weights to start from)")
    if checkpoint.override_opt_param_scheduler and checkpoint.use_checkpoint_opt_param_scheduler:
        raise ConfigError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler contradict each "
                          "other (the command line's schedule, or the checkpoint's): give one")


MEGATRON_ENTRIES = {"pretrain_gpt": "gpt", "pretrain_bert": "bert", "pretrain_t5": "t5", "pretrain_vlm": "multimodal"}
"""Megatron-LM's training scripts -> the model family each trains (``--entry``)."""


def _entry_model_type(merged: dict[str, Any]) -> None:
    """``--entry pretrain_bert`` (or ``path/to/pretrain_bert.py``): set ``model_type`` to the script's family;
    ConfigError naming both when ``--model-type`` or a preset says otherwise."""
    entry = merged.get("entry")
    if entry is None:
        return
    name = os.path.basename(str(entry)).removesuffix(".py")
    if name not in MEGATRON_ENTRIES:
        raise ConfigError(f"--entry {entry}: not a Megatron training script omnitron runs; use one of "
                          f"{', '.join(MEGATRON_ENTRIES)}")
    want, have = MEGATRON_ENTRIES[name], merged.get("model_type")
    if have not in (None, want):
        raise ConfigError(f"--entry {name} trains {want}, but --model-type (or the --model preset) says {have}; "
                          f"drop one of them")
    merged["model_type"] = want


def _model_family(merged: dict[str, Any]):
    """The ``--model-type`` family (a preset implies its own); another family's own flags without it are
    errors, then the family's ``check_flags`` refuses what does not apply to it and sets its defaults (BERT
    and T5: the BertWordPieceLowerCase tokenizer; T5's ``--encoder-seq-length`` sets ``--seq-length``)."""
    from omnitron.core.models.family import families, get_family

    _entry_model_type(merged)
    family = get_family(merged.get("model_type") or "gpt")
    for other in families().values():
        only = [k for k in other.own_fields() if k in merged and k not in family.own_fields()]
        if other is not family and only:
            raise ConfigError(f"--{only[0].replace('_', '-')} only applies to {other.name.upper()}; add --model-type "
                              f"{other.name}")
    if family.check_flags is not None:
        family.check_flags(merged)
    return family


def preload_family_modules(argv: list[str]) -> None:
    """Import the ``--model-family-module`` modules named in ``argv`` or in its ``--config`` file, before the
    parser is built: their families' presets, ``--model-type`` and own flags become known (ConfigError when
    one cannot be imported)."""
    from omnitron.core.models.family import import_family_modules

    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    pre.add_argument("--model-family-module", action="append", default=[])
    known, _ = pre.parse_known_args(argv)
    modules = list(known.model_family_module)
    if known.config and os.path.exists(known.config):
        modules += _str_list(load_config_file(known.config).get("model_family_module") or [])
    import_family_modules(modules)


def parse_settings(argv: list[str], world_size: int | None = None) -> Settings:
    """argv -> Settings (argparse exits with code 2 on unknown flags; ConfigError on bad values)."""
    preload_family_modules(argv)
    given = vars(train_parser().parse_args(argv))
    return build_settings(merge_settings(given), world_size)


def train_parser() -> argparse.ArgumentParser:
    """``omnitron train``'s parser: every flag, defaults suppressed (so that the given flags can be told apart)."""
    from omnitron.core.config.parser import Parser

    parser = Parser(prog="omnitron train", argument_default=argparse.SUPPRESS)
    add_arguments(parser)
    return parser


def model_words(model: dict[str, Any]) -> list[str]:
    """The ``omnitron train`` flags (as command-line words) that build the model config recorded as ``model`` (a
    checkpoint's metadata ``model``): :func:`setting_words` of its fields that are flags. Not the vocabulary (the
    tokenizer's) nor the fields no flag sets (``params_dtype``: --bf16 / --fp16 are the run's choice)."""
    from omnitron.core.models.gpt.config import GPTConfig

    opts = options()
    return setting_words({k: v for k, v in model.items() if k in opts and not _skip(GPTConfig, k)})


def setting_words(values: dict[str, Any]) -> list[str]:
    """The command-line words that give each setting of ``values`` (dest -> value) that is not its flag's default,
    spelled as :func:`train_parser` reads them (the inverse of parsing: a switch, Megatron's negative spelling such
    as ``--disable-bias-linear`` or the ``--no-`` form, a list as several words); ``shlex.join`` makes them one
    shell line. ConfigError for a value no flag gives (None where the default is not None)."""
    opts, actions = options(), {}
    for action in train_parser()._actions:
        actions.setdefault(action.dest, []).append(action)
    words: list[str] = []
    for dest, value in values.items():
        opt = opts[dest]
        if value == opt.default:
            continue
        if value is None:
            raise ConfigError(f"{opt.flag}: no flag sets it to none (its default is {opt.default}); set it in a "
                              f"--config file instead")
        words += _setting_words(opt, value, actions[dest])
    return words


def _setting_words(opt: Option, value: Any, actions: list[argparse.Action]) -> list[str]:
    """The words of one setting ``opt`` = ``value`` (not its default, not None)."""
    if opt.kind == "bool":
        for action in actions:  # a switch storing exactly this value (--disable-bias-linear) before --no-X
            if action.nargs == 0 and getattr(action, "const", None) is bool(value):
                return [action.option_strings[0]]
        pair = next(a for a in actions if isinstance(a, argparse.BooleanOptionalAction))
        return [pair.option_strings[0 if value else 1]]
    if opt.kind == "list":
        return [opt.flag, *(str(v) for v in (value if isinstance(value, (list, tuple)) else [value]))]
    return [opt.flag, str(value)]
