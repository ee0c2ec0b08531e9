"""``omnitron generate --load DIR --prompt TEXT [--prompt TEXT ...]``: generate from a training checkpoint.

The checkpoint (any parallel layout) is read into one process (:mod:`omnitron.core.inference.loader`);
several ``--prompt`` flags run as one batch. GPT continues the text, T5 decodes a target for it (its
encoder input), a multimodal (LLaVA) checkpoint captions ``--image-index N`` (a synthetic validation
image) or ``--image FILE.npy``, continuing ``--prompt`` (default "a", how the synthetic captions start).

With ``--tensor-model-parallel-size`` / ``--pipeline-model-parallel-size`` a GPT checkpoint is sampled by
tp x pp processes (``--nproc-per-node``, default their product, or torchrun), each holding its own stage
(:mod:`omnitron.core.inference.sharded`): the same tokens as one process. An MoE checkpoint's experts spread over
``--expert-model-parallel-size`` ranks too (tp x ep x pp processes).
"""
from __future__ import annotations

import argparse
import sys

from omnitron.commands.checkpoint_args import add_family_module_flag
from omnitron.commands.serve import add_layout_flags, sharded_world


def register(sub) -> None:
    p = sub.add_parser("generate", help="continue prompts with a trained checkpoint (batched, KV cache; GPT, T5, "
                       "LLaVA captions)")
    p.add_argument("--load", required=True, metavar="DIR", help="checkpoint directory (its 'latest'; any layout)")
    p.add_argument("--prompt", action="append", help="text to continue; repeat for a batch (T5: the encoder input)")
    p.add_argument("--max-new-tokens", type=int, default=40, metavar="N", help="tokens to generate (default: 40)")
    p.add_argument("--temperature", type=float, default=0.8, help="divide the logits by it; 0 = greedy (default: 0.8)")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the K likeliest; 1 = greedy, "
                   "0 = no limit (default: 20, or 0 with --top-p: the two are not combined, as in Megatron)")
    p.add_argument("--top-p", type=float, default=0.0, metavar="P", help="nucleus sampling: the likeliest tokens "
                   "whose mass reaches P; 0 = off (default: 0)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed, prompt i uses seed + i (default: the "
                   "checkpoint's --seed)")
    p.add_argument("--return-log-probs", action="store_true", help="print each token with its log-probability")
    p.add_argument("--backend", default=None, help="backend (default: $OMNITRON_BACKEND, else auto)")
    add_layout_flags(p)
    add_family_module_flag(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON (the server's response shape)")
    image = p.add_mutually_exclusive_group()
    image.add_argument("--image-index", type=int, metavar="N", help="multimodal: caption sample N of the synthetic "
                       "validation images (its true caption is printed too)")
    image.add_argument("--image", metavar="FILE.npy", help="multimodal: caption this [C, H, W] float image")
    p.set_defaults(func=run)


def _images(loaded, args, count: int):
    """``[count, C, H, W]`` (the one image repeated per prompt) and its true caption, or (None, None)."""
    import torch

    from omnitron.core.inference.text import load_image, synthetic_image

    if args.image_index is None and args.image is None:
        if loaded.spec.takes_images:
            raise ValueError("a multimodal checkpoint captions an image: pass --image-index N or --image FILE.npy")
        return None, None
    if not loaded.spec.takes_images:
        raise ValueError(f"--image-index / --image apply to multimodal checkpoints; this one is {loaded.family}")
    if args.image is not None:
        image, truth = load_image(args.image, loaded.model.config), None
    else:
        image, truth = synthetic_image(loaded, args.image_index)
    return torch.stack([image] * count), truth


def sampling_flags(args: argparse.Namespace) -> dict:
    """``--temperature / --top-k / --top-p / --seed`` as SamplingParams fields: ``--top-k`` defaults to 20, or to 0
    with ``--top-p``; both given is a ValueError naming the flags (Megatron's sampling refuses the pair)."""
    if args.top_k and args.top_p:
        raise ValueError(f"--top-k {args.top_k} and --top-p {args.top_p:g} together: give one of them (Megatron's "
                         "sampling refuses the pair)")
    top_k = args.top_k if args.top_k is not None else 0 if args.top_p else 20
    return {"temperature": args.temperature, "top_k": top_k, "top_p": args.top_p, "seed": args.seed}


def run(args: argparse.Namespace) -> int:
    from omnitron.backends import get_backend
    from omnitron.core.checkpoint import CheckpointError
    from omnitron.core.inference.loader import SERVING_DTYPES, load_for_inference
    from omnitron.core.inference.sampling import SamplingParams
    from omnitron.core.inference.text import complete, print_result

    if args.max_new_tokens < 1:
        print("omnitron generate: error: --max-new-tokens must be >= 1", file=sys.stderr)
        return 2
    try:
        sampling = sampling_flags(args)
        SamplingParams(**sampling)  # every value checked before a checkpoint is read or ranks start
    except ValueError as err:
        print(f"omnitron generate: error: {err}", file=sys.stderr)
        return 2
    world = sharded_world(args, "generate")
    if world is not None:
        return _run_sharded(args, world, sampling)
    try:
        loaded = load_for_inference(args.load, get_backend(args.backend), SERVING_DTYPES[args.serving_dtype])
        default = loaded.spec.default_prompt
        prompts = args.prompt or ([default] if default is not None else None)
        if not prompts:
            raise ValueError("--prompt TEXT is required (repeat it for a batch)")
        params = SamplingParams(**{**sampling, "seed": loaded.seed if args.seed is None else args.seed})
        images, truth = _images(loaded, args, len(prompts))
        out = complete(loaded, prompts, args.max_new_tokens, params=params, logprobs=args.return_log_probs,
                       images=images)
    except (CheckpointError, ValueError, OSError) as err:
        print(f"omnitron generate: error: {err}", file=sys.stderr)
        return 2
    print_result(out, args.json, args.return_log_probs, truth)
    return 0


def _run_sharded(args: argparse.Namespace, world: int, sampling: dict) -> int:
    """Launch tp x pp ranks (as training launches its workers) that each load their stage and generate."""
    from omnitron.core.inference.sharded import GenerateJob, run_generate_job
    from omnitron.core.training.launch import launch

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    ep = args.expert_model_parallel_size
    if args.image is not None or args.image_index is not None:
        print("omnitron generate: error: multimodal checkpoints caption in one process; drop "
              "--tensor-model-parallel-size / --pipeline-model-parallel-size", file=sys.stderr)
        return 2
    if not args.prompt:
        print("omnitron generate: error: --prompt TEXT is required (repeat it for a batch)", file=sys.stderr)
        return 2
    job = GenerateJob(load=args.load, prompts=args.prompt, tensor_model_parallel_size=tp,
                      pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                      max_new_tokens=args.max_new_tokens, sampling=sampling,
                      return_log_probs=args.return_log_probs, json=args.json, backend=args.backend,
                      nproc_per_node=world, world_size=world, serving_dtype=args.serving_dtype)
    return launch(job, run_generate_job)
