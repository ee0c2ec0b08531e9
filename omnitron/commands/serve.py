"""``omnitron serve --load DIR [--port 5000]``: Megatron's text generation server API over HTTP (PUT /api)."""
from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a checkpoint over HTTP: PUT /api {\"prompts\": [...], "
                       "\"tokens_to_generate\": N, ...} (Megatron's text generation server API)")
    p.add_argument("--load", required=True, metavar="DIR", help="checkpoint directory (its 'latest'; any layout)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=5000, help="port (default: 5000; 0 picks a free one)")
    p.add_argument("--backend", default=None, help="backend (default: $OMNITRON_BACKEND, else auto)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from omnitron.backends import get_backend
    from omnitron.core.checkpoint import CheckpointError
    from omnitron.core.inference.loader import load_for_inference
    from omnitron.core.inference.server import make_server

    try:
        loaded = load_for_inference(args.load, get_backend(args.backend))
        server = make_server(loaded, args.host, args.port)
    except (CheckpointError, ValueError, OSError) as err:
        print(f"omnitron serve: error: {err}", file=sys.stderr)
        return 2
    print(f"serving {loaded.family} checkpoint {args.load} on http://{args.host}:{server.server_port}/api (PUT)",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
