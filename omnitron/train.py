"""``python -m omnitron.train ...`` (and ``torchrun -m omnitron.train ...``): same as ``omnitron train``."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from omnitron.commands.train import main_from_dict
    from omnitron.core.training.arguments import add_arguments

    parser = argparse.ArgumentParser(prog="python -m omnitron.train", argument_default=argparse.SUPPRESS)
    add_arguments(parser)
    return main_from_dict(vars(parser.parse_args(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
