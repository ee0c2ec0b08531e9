"""``python -m omnitron.train ...`` (and ``torchrun -m omnitron.train ...``): same as ``omnitron train``."""
from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    from omnitron.core.training import lifeline

    lifeline.hold()  # first, as ``omnitron train`` does (omnitron.cli.main)
    from omnitron.core.config.parser import Parser
    from omnitron.commands.train import main_from_dict
    from omnitron.core.training.arguments import add_arguments

    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the header, saves and resumes are log lines
    parser = Parser(prog="python -m omnitron.train", argument_default=argparse.SUPPRESS)
    add_arguments(parser)
    return main_from_dict(vars(parser.parse_args(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
