"""``omnitron checkpoint import-megatron|export-megatron``: Megatron-LM GPT checkpoints in and out.

``import-megatron --load MEGATRON_DIR --save OUT [--tensor-model-parallel-size T
--pipeline-model-parallel-size P]`` reads a Megatron-Core GPT checkpoint saved with
``--ckpt-format torch_dist`` (Megatron's default) or ``torch`` (any tensor / pipeline / virtual-pipeline
layout; dense, MoE, MLA and MTP models) and writes an omnitron checkpoint at iteration 0: weights only (a
fresh optimizer, as ``--finetune``; the routers' expert bias carried), or, where a ``--ckpt-format torch`` run
saved its distributed optimizer's ``distrib_optim.pt`` files, with Megatron's Adam moments, fp32 masters and
step count (the learning-rate schedule then the training command line's, from its start),
printing the model flags a training run must repeat. ``export-megatron --load DIR --out MEGATRON_DIR
--target-tensor-model-parallel-size T --target-pipeline-model-parallel-size P [--ckpt-format F]``
writes the reverse (default torch_dist). The mapping is :mod:`omnitron.core.checkpoint.megatron` and
:mod:`omnitron.core.checkpoint.megatron_dist`. Registered under ``omnitron checkpoint``
by :mod:`omnitron.commands.checkpoint`.
"""
from __future__ import annotations

import argparse

from omnitron.commands.checkpoint_args import add_family_module_flag, fail


def register(cmds) -> None:
    """Add ``import-megatron`` and ``export-megatron`` to the ``omnitron checkpoint`` sub-parsers ``cmds``."""
    imp = cmds.add_parser("import-megatron", help="a Megatron-LM GPT checkpoint (--ckpt-format torch_dist or "
                          "torch) to an omnitron checkpoint")
    imp.add_argument("--load", required=True, metavar="DIR", help="a Megatron --save directory (its "
                     "latest_checkpointed_iteration.txt) or one iter_N directory")
    imp.add_argument("--save", required=True, metavar="DIR", help="where the omnitron checkpoint goes")
    imp.add_argument("--tensor-model-parallel-size", type=int, default=1, metavar="T")
    imp.add_argument("--pipeline-model-parallel-size", type=int, default=1, metavar="P")
    imp.add_argument("--vocab-size", type=int, metavar="V", help="real vocabulary rows to keep of Megatron's padded "
                     "one (default: from the checkpoint's tokenizer args)")
    imp.set_defaults(func=run_import)
    exp = cmds.add_parser("export-megatron", help="an omnitron GPT checkpoint to a Megatron-LM checkpoint "
                          "(--ckpt-format torch_dist or torch)")
    exp.add_argument("--load", required=True, metavar="DIR", help="a --save directory (its latest) or an iter_N one")
    exp.add_argument("--out", required=True, metavar="DIR", help="the Megatron --load directory to write")
    exp.add_argument("--target-tensor-model-parallel-size", type=int, required=True, metavar="T")
    exp.add_argument("--target-pipeline-model-parallel-size", type=int, required=True, metavar="P")
    exp.add_argument("--transformer-impl", default="transformer_engine", choices=("transformer_engine", "local"),
                     help="the Megatron layer spec to name tensors for, --ckpt-format torch only (torch_dist "
                     "serves both; default: transformer_engine, Megatron's)")
    exp.add_argument("--ckpt-format", default="torch_dist", choices=("torch_dist", "torch"),
                     help="Megatron's checkpoint format to write (default: torch_dist, Megatron's)")
    add_family_module_flag(exp)
    exp.set_defaults(func=run_export)


def run_import(args: argparse.Namespace) -> int:
    from omnitron.commands.hf import check_import_save, import_layout, train_hint
    from omnitron.core.checkpoint import CheckpointError
    from omnitron.core.checkpoint.megatron import import_megatron
    from omnitron.core.checkpoint.reshard import read_metadata
    from omnitron.core.config.parallel import ConfigError

    try:
        if args.vocab_size is not None and args.vocab_size < 1:
            raise ConfigError(f"--vocab-size must be >= 1, got {args.vocab_size}")
        layout = import_layout(args)
        check_import_save(args.save, args.load)
        out = import_megatron(args.load, args.save, layout, vocab_size=args.vocab_size)
    except (CheckpointError, ConfigError, OSError, ValueError, KeyError) as err:
        return fail("import-megatron", err)
    meta = read_metadata(out)
    src = meta["imported_from"]
    print(f"imported {src['megatron_dir']} (Megatron {src['ckpt_format']} checkpoint, iteration {src['iteration']}, "
          f"tp{src['tensor_model_parallel_size']} pp{src['pipeline_model_parallel_size']}) to {out} ({layout}); "
          + ("with Megatron's Adam state (distrib_optim.pt: moments, fp32 masters, step "
             f"{meta['optimizer']['step']}): training from it starts at iteration 0 and resumes those moments"
             if "step" in (meta.get("optimizer") or {}) else "weights only: Megatron's optimizer state is not "
             "carried, training from it starts at iteration 0 with a fresh optimizer"))
    print(train_hint(args.save, meta))
    return 0


def run_export(args: argparse.Namespace) -> int:
    from omnitron.commands.checkpoint_args import check_save, resolve
    from omnitron.core.checkpoint import CheckpointError
    from omnitron.core.checkpoint.megatron import export_megatron
    from omnitron.core.config.parallel import ConfigError

    try:
        path = resolve(args.load)
        check_save("--out", args.out, args.load, path)  # Megatron's iter_N of the same iteration
        out = export_megatron(path, args.out, args.target_tensor_model_parallel_size,
                              args.target_pipeline_model_parallel_size, transformer_impl=args.transformer_impl,
                              ckpt_format=args.ckpt_format)
    except (CheckpointError, ConfigError, OSError, ValueError) as err:
        return fail("export-megatron", err)
    print(f"exported {path} to {out} (Megatron --ckpt-format {args.ckpt_format}, "
          f"tp{args.target_tensor_model_parallel_size} "
          f"pp{args.target_pipeline_model_parallel_size}); weights only: load it in Megatron with --finetune "
          f"(or --no-load-optim --no-load-rng)")
    return 0
