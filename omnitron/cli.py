"""``omnitron`` console script: one sub-command per module in ``omnitron.commands``.

Each command module exposes ``register(subparsers)``, which adds its parser and sets
``func`` (called with the parsed namespace, returning an exit code).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from omnitron.core.config.parser import Parser  # noqa: F401 - here for `from omnitron.cli import Parser`

COMMANDS = ("info", "train", "plan", "preprocess", "tokenizer", "bench", "plot", "generate", "serve", "checkpoint")


def build_parser() -> argparse.ArgumentParser:
    from omnitron import __version__

    parser = Parser(prog="omnitron", description="3D-parallel FP8 Transformer training on any backend")
    parser.add_argument("--version", action="version", version=f"omnitron {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"omnitron.commands.{name}")
        except ModuleNotFoundError as err:
            if err.name == f"omnitron.commands.{name}":
                continue  # command not part of this build yet
            raise
        module.register(sub)
    return parser


JOBS = ("train", "generate", "serve")
"""The commands whose torchrun ranks join a job: each holds its lifeline from here (:func:`main`)."""


def main(argv: list[str] | None = None) -> int:
    early = argv is None and sys.argv[1:2] == ["train"]  # the program itself (not a caller's in-process call)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in JOBS:
        from omnitron.core.training import lifeline

        # NOTE: first, before the parser imports every command (torch among them): a rank killed from here on is
        # named on every node within a poll (lifeline.py); one killed before waits out its peers' join wait
        lifeline.hold()
    if not early:
        return _main(argv)
    from omnitron.core.training import signals

    signals.install_early(argv)  # before the imports and checks (seconds): a stop signal then is not lost
    try:
        return _main(argv)
    except signals.StopNow as err:  # a second signal before any rank took over: what happened, in one line
        print(f"omnitron train: error: {err}", file=sys.stderr)
        return 1
    finally:
        signals.early_signal()  # the handlers back, when no rank or relay took them over


def _main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if "--model-family-module" in " ".join(argv) or "--config" in argv:  # a family of the user's own
        from omnitron.core.config.parallel import ConfigError
        from omnitron.core.training.arguments import preload_family_modules

        try:
            preload_family_modules(argv)
        except ConfigError as err:
            print(f"omnitron: error: {err}", file=sys.stderr)
            return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except Exception as err:
        if not _setting_error(err):
            raise
        print(f"omnitron {argv[0]}: error: {err}", file=sys.stderr)
        return 2


def _setting_error(err: Exception) -> bool:
    """A backend that cannot run here, or a plug-in whose kernels break the registry's contract: the user's choice of
    backend, said in a line (every command, not only ``train``'s precheck). Looked up where loaded, so the command
    line does not import torch for the check."""
    for module, name in (("omnitron.backends.registry", "BackendUnavailableError"),
                         ("omnitron.kernels.registry", "KernelContractError")):
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(err, cls):
            return True
    return False


if __name__ == "__main__":
    sys.exit(main())
