"""``omnitron train``'s argparse parser, made from the flag table (:mod:`omnitron.core.training.flag_table`)
plus the launch options, the hand-written Megatron spellings and Megatron's own flags
(:mod:`omnitron.core.training.megatron_flags`); and its inverse, settings back to command-line words
(:func:`setting_words`, :func:`model_words`)."""
from __future__ import annotations

import argparse
import functools
import os
from dataclasses import fields
from typing import Any

from omnitron.core.config.parallel import ConfigError
from omnitron.core.training.flag_merge import _str_list, load_config_file
from omnitron.core.training.flag_table import Option, _config_classes, _skip, options


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
    launch.add_argument("--sample-tokens", type=int, metavar="N", help="tokens to sample for --prompt; 0: no sample "
                        "(default: 40)")
    launch.add_argument("--sample-top-k", type=int, metavar="K", help="sample among the K likeliest tokens; "
                        "1 is greedy, 0 the whole vocabulary (default: 20)")
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


MEGATRON_ENTRIES = {"pretrain_gpt": "gpt", "pretrain_bert": "bert", "pretrain_t5": "t5", "pretrain_vlm": "multimodal"}
"""Megatron-LM's training scripts -> the model family each trains (``--entry``)."""


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
    values = {k: v for k, v in model.items() if k in opts and not _skip(GPTConfig, k)}
    if values.get("quick_geglu"):  # it implies the gated MLP; Megatron refuses --swiglu beside it
        values.pop("swiglu", None)
    scaled = values.get("rope_scaling_factor", 1.0) != 1.0  # Megatron's factor acts only with --use-rope-scaling
    return (["--use-rope-scaling"] if scaled else []) + setting_words(values)


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
