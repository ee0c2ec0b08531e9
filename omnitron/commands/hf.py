"""``omnitron checkpoint import-hf|export-hf``: Hugging Face GPT-2 / Llama checkpoints in and out.

``import-hf --hf-dir DIR --save OUT [--tensor-model-parallel-size T --pipeline-model-parallel-size P]``
writes a weights-only omnitron checkpoint (iteration 0; training from it starts with a fresh
optimizer, as ``--finetune``) and prints the model flags a training run must repeat.
``export-hf --load DIR --out HFDIR`` writes ``config.json`` + ``model.safetensors`` that
``transformers``' ``from_pretrained`` loads. The mapping is :mod:`omnitron.core.checkpoint.hf`.
Registered under ``omnitron checkpoint`` by :mod:`omnitron.commands.checkpoint`.
"""
from __future__ import annotations

import argparse
import sys

from omnitron.commands.checkpoint_args import add_family_module_flag, fail


def register(cmds) -> None:
    """Add ``import-hf`` and ``export-hf`` to the ``omnitron checkpoint`` sub-parsers ``cmds``."""
    imp = cmds.add_parser("import-hf", help="a Hugging Face GPT-2 / Llama / Qwen2 (or MoE) checkpoint to an "
                          "omnitron checkpoint")
    imp.add_argument("--hf-dir", required=True, metavar="DIR", help="a save_pretrained directory (config.json + "
                     "model.safetensors, sharded safetensors or pytorch_model.bin)")
    imp.add_argument("--save", required=True, metavar="DIR", help="where the omnitron checkpoint goes")
    imp.add_argument("--tensor-model-parallel-size", type=int, default=1, metavar="T")
    imp.add_argument("--pipeline-model-parallel-size", type=int, default=1, metavar="P")
    imp.set_defaults(func=run_import)
    exp = cmds.add_parser("export-hf", help="an omnitron GPT-2 / Llama / Qwen2 (or MoE) checkpoint to a Hugging "
                          "Face directory")
    exp.add_argument("--load", required=True, metavar="DIR", help="a --save directory (its latest) or an iter_N one")
    exp.add_argument("--out", required=True, metavar="DIR", help="directory for config.json + model.safetensors")
    add_family_module_flag(exp)
    for flag, what in (("--tokenizer-type", "the tokenizer to write (default: the one the checkpoint records)"),
                       ("--tokenizer-model", "its model file or directory"), ("--vocab-file", "its vocabulary file"),
                       ("--merge-file", "its BPE merges"), ("--vocab-size", "NullTokenizer's vocabulary")):
        exp.add_argument(flag, type=int if flag == "--vocab-size" else str, help=what)
    exp.set_defaults(func=run_export)


def run_import(args: argparse.Namespace) -> int:
    from omnitron.core.checkpoint import CheckpointError
    from omnitron.core.checkpoint.hf import import_hf
    from omnitron.core.checkpoint.reshard import read_metadata
    from omnitron.core.config.parallel import ConfigError

    try:
        layout = import_layout(args)
        check_import_save(args.save)
        out = import_hf(args.hf_dir, args.save, layout, say=lambda text: print(f"note: {text}"))
    except (CheckpointError, ConfigError, OSError, ValueError, KeyError) as err:
        return fail("import-hf", err)
    meta = read_metadata(out)
    print(f"imported {args.hf_dir} ({meta['imported_from']['model_type']}) to {out} ({layout}); weights only: "
          f"training from it starts at iteration 0 with a fresh optimizer")
    print(train_hint(args.save, meta))
    return 0


def check_import_save(save: str, load: str | None = None) -> None:
    """Before any work: an import's ``--save`` can be written, is not the checkpoint directory it reads
    (``load``: ``import-megatron``'s ``--load``) and holds no iteration-0 checkpoint yet (an import writes
    ``iter_0000000`` and points ``latest`` at it; it never replaces one)."""
    from omnitron.commands.checkpoint_args import check_output
    from omnitron.core.checkpoint.io import refuse_overwrite

    refuse_overwrite(save, 0, load=(load,) if load else ())
    check_output("--save", save)


def import_layout(args: argparse.Namespace):
    """The Layout an import's ``--tensor-model-parallel-size`` / ``--pipeline-model-parallel-size`` ask for."""
    from omnitron.core.checkpoint.reshard import Layout
    from omnitron.core.config.parallel import ConfigError

    for flag, v in (("--tensor-model-parallel-size", args.tensor_model_parallel_size),
                    ("--pipeline-model-parallel-size", args.pipeline_model_parallel_size)):
        if v < 1:
            raise ConfigError(f"{flag} must be >= 1, got {v}")
    return Layout(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size)


def train_hint(save: str, meta: dict) -> str:
    """The ``train from it with: --load ...`` line for an imported checkpoint's metadata ``meta``: every model
    setting that is not ``omnitron train``'s default, through the parser's own flags
    (:func:`~omnitron.core.training.arguments.model_words`), so that the line builds the imported model whole,
    then the tokenizer; shell-quoted (a pattern such as ``[0,1,1]`` is one word)."""
    import shlex

    from omnitron.core.training.arguments import model_words

    run = meta["config"]
    tokenizer = [w for k in ("tokenizer_type", "tokenizer_model", "vocab_size") if k in run
                 for w in (f"--{k.replace('_', '-')}", str(run[k]))]
    return "train from it with: " + shlex.join(["--load", save, *model_words(meta["model"]), *tokenizer])


def run_export(args: argparse.Namespace) -> int:
    from omnitron.commands.checkpoint_args import run_export as export
    from omnitron.core.checkpoint.hf import export_hf

    keys = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size")
    tokenizer = {k: getattr(args, k, None) for k in keys}

    def warn(text: str) -> None:  # the export goes on: transformers' model differs slightly (hf.export_hf)
        print(f"omnitron checkpoint export-hf: warning: {text}", file=sys.stderr)

    return export(args, what="export-hf", write=lambda path, out: export_hf(path, out, tokenizer, warn=warn),
                  note=" (config.json + model.safetensors + tokenizer)", out_dir=True)
