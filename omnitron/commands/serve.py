"""``omnitron serve --load DIR [--port 5000]``: Megatron's text generation server API over HTTP (PUT /api).

With ``--tensor-model-parallel-size`` / ``--pipeline-model-parallel-size`` (and, for MoE checkpoints,
``--expert-model-parallel-size``) a GPT checkpoint is served by tp x ep x pp processes (rank 0 answers HTTP;
see :mod:`omnitron.core.inference.sharded_server`)."""
from __future__ import annotations

import argparse
import sys

from omnitron.commands.checkpoint_args import add_family_module_flag


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a checkpoint over HTTP: PUT /api {\"prompts\": [...], "
                       "\"tokens_to_generate\": N, ...} (Megatron's text generation server API)")
    p.add_argument("--load", required=True, metavar="DIR", help="checkpoint directory (its 'latest'; any layout)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=5000, help="port (default: 5000; 0 picks a free one)")
    p.add_argument("--backend", default=None, help="backend (default: $OMNITRON_BACKEND, else auto)")
    add_layout_flags(p)
    add_family_module_flag(p)
    p.set_defaults(func=run)


def add_dtype_flags(p) -> None:
    """The serving dtype of the inference commands (Megatron's ``--bf16`` / ``--fp16``; neither: fp32)."""
    dtype = p.add_mutually_exclusive_group()
    dtype.add_argument("--bf16", action="store_const", const="bf16", dest="serving_dtype", default="fp32",
                       help="serve in bfloat16: weights, activations and KV cache (half fp32's memory)")
    dtype.add_argument("--fp16", action="store_const", const="fp16", dest="serving_dtype",
                       help="serve in float16 (half fp32's memory; bf16's range is fp32's, fp16's is not)")


def add_layout_flags(p) -> None:
    """The tp x pp flags of the inference commands (``generate``, ``serve``), and the serving dtype's."""
    add_dtype_flags(p)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, metavar="TP",
                   help="shard the model over TP processes (GPT checkpoints; any layout loads)")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1, metavar="PP",
                   help="split the layers over PP pipeline stages (GPT checkpoints)")
    p.add_argument("--expert-model-parallel-size", type=int, default=1, metavar="EP",
                   help="MoE checkpoints: spread each MoE layer's experts over EP ranks (E / EP each; the dense layers "
                        "replicated EP times, tokens exchanged as in training)")
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="local processes to spawn (default: TP x EP x PP; under torchrun, its world)")


def sharded_world(args, command: str) -> int | None:
    """The job's world size when ``args`` ask for tp x ep x pp processes, None for one process; exits 2 (SystemExit)
    with one line when the process count does not match, or the checkpoint's model does not split over the
    layout (an expert layout on a dense model, experts that ep does not divide, ...). A torchrun rank holds its
    lifeline already (:data:`omnitron.cli.JOBS`): killed in these checks, it is named on every node."""
    import os

    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.inference.sharded import describe_serving, serving_world

    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    if tp * pp * ep == 1 and (args.nproc_per_node or 1) == 1:
        return None
    if min(tp, pp, ep) < 1:
        print(f"omnitron {command}: error: --tensor-model-parallel-size, --pipeline-model-parallel-size and "
              f"--expert-model-parallel-size must be >= 1, got {tp}, {pp} and {ep}", file=sys.stderr)
        raise SystemExit(2)
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              expert_model_parallel_size=ep)
    want = serving_world(parallel)
    world = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ else (args.nproc_per_node or want)
    if world != want:
        print(f"omnitron {command}: error: sharded inference needs {describe_serving(parallel)} processes, "
              f"got {world}; set --nproc-per-node {want}", file=sys.stderr)
        raise SystemExit(2)
    from omnitron.core.checkpoint import CheckpointError
    from omnitron.core.inference.loader import check_sharded_layout

    try:  # the checkpoint's model against the layout, before any rank starts
        check_sharded_layout(args.load, parallel)
    except (CheckpointError, ValueError, OSError) as err:
        print(f"omnitron {command}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    return world


def run(args: argparse.Namespace) -> int:
    from omnitron.backends import get_backend
    from omnitron.core.checkpoint import CheckpointError
    from omnitron.core.inference.loader import SERVING_DTYPES, load_for_inference
    from omnitron.core.inference.server import make_server, serve_until_stopped

    world = sharded_world(args, "serve")
    if world is not None:
        from omnitron.core.inference.sharded_server import ServeJob, run_serve_job
        from omnitron.core.training.launch import launch

        return launch(ServeJob(load=args.load, tensor_model_parallel_size=args.tensor_model_parallel_size,
                               pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                               expert_model_parallel_size=args.expert_model_parallel_size, backend=args.backend,
                               host=args.host, port=args.port, nproc_per_node=world, world_size=world,
                               serving_dtype=args.serving_dtype),
                      run_serve_job)
    try:
        loaded = load_for_inference(args.load, get_backend(args.backend), SERVING_DTYPES[args.serving_dtype])
        server = make_server(loaded, args.host, args.port)
    except (CheckpointError, ValueError, OSError) as err:
        print(f"omnitron serve: error: {err}", file=sys.stderr)
        return 2
    print(f"serving {loaded.family} checkpoint {args.load} on http://{args.host}:{server.server_port}/api (PUT)",
          flush=True)
    serve_until_stopped(server)
    return 0
