"""``omnitron generate --load DIR --prompt TEXT``: sample a continuation from a training checkpoint."""
from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    p = sub.add_parser("generate", help="continue a prompt with a trained checkpoint (greedy or top-k, KV cache)")
    p.add_argument("--load", required=True, metavar="DIR", help="checkpoint directory (its 'latest' is used)")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=40, metavar="N", help="tokens to generate (default: 40)")
    p.add_argument("--top-k", type=int, default=20, metavar="K", help="sample among the K likeliest; 1 = greedy "
                   "(default: 20)")
    p.add_argument("--backend", default=None, help="backend (default: $OMNITRON_BACKEND, else auto)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from omnitron.core.checkpoint import CheckpointError
    from omnitron.core.config.parallel import ConfigError
    from omnitron.core.inference.from_checkpoint import generate_entry, settings_from_checkpoint
    from omnitron.core.training.launch import launch

    if args.max_new_tokens < 1 or args.top_k < 1:
        print("omnitron generate: error: --max-new-tokens and --top-k must be >= 1", file=sys.stderr)
        return 2
    try:
        settings = settings_from_checkpoint(args.load, args.prompt, args.max_new_tokens, args.top_k, args.backend)
    except (ConfigError, CheckpointError, OSError) as err:
        print(f"omnitron generate: error: {err}", file=sys.stderr)
        return 2
    return launch(settings, entry=generate_entry)
