"""``omnitron checkpoint inspect|convert|export``: look into, reshard and export training checkpoints
(``import-hf`` / ``export-hf``: :mod:`omnitron.commands.hf`; ``import-megatron`` / ``export-megatron``:
:mod:`omnitron.commands.megatron`).

``inspect DIR`` prints the layout, iteration, parameter count and each tensor's full shape;
``convert --load DIR --save DIR2 --target-...`` rewrites a checkpoint for another parallel layout
and, with ``--target-ckpt-format``, the other format (offline, one process; see
:mod:`omnitron.core.checkpoint.reshard`); ``export --load DIR --out FILE`` writes the full model
weights to one safetensors file. ``DIR`` is a ``--save`` directory
(its ``latest`` is used) or one ``iter_N`` directory.
"""
from __future__ import annotations

import argparse
import re
import sys

from omnitron.commands.checkpoint_args import add_family_module_flag, check_save, fail, resolve, run_export


def register(sub) -> None:
    p = sub.add_parser("checkpoint", help="inspect, reshard (convert) or export a checkpoint; import or export "
                       "Hugging Face and Megatron-LM ones")
    cmds = p.add_subparsers(dest="checkpoint_command", metavar="ACTION")
    ins = cmds.add_parser("inspect", help="layout, iteration, parameter count and tensor shapes of a checkpoint")
    ins.add_argument("dir", metavar="DIR", help="a --save directory (its latest) or an iter_N directory")
    add_family_module_flag(ins)
    ins.set_defaults(func=run_inspect)
    conv = cmds.add_parser("convert", help="rewrite a checkpoint for another tensor/pipeline/virtual layout")
    conv.add_argument("--load", required=True, metavar="DIR", help="a --save directory (its latest) or an iter_N one")
    conv.add_argument("--save", required=True, metavar="DIR", help="where the converted checkpoint goes")
    conv.add_argument("--target-tensor-model-parallel-size", type=int, required=True, metavar="T")
    conv.add_argument("--target-pipeline-model-parallel-size", type=int, required=True, metavar="P")
    conv.add_argument("--target-num-layers-per-virtual-pipeline-stage", type=int, metavar="V",
                      help="interleaved pipeline: layers per virtual stage (default: not interleaved)")
    conv.add_argument("--target-num-virtual-stages-per-pipeline-rank", type=int, metavar="V",
                      help="interleaved pipeline: virtual stages per pipeline rank (default: not interleaved)")
    conv.add_argument("--target-decoder-first-pipeline-num-layers", type=int, metavar="N")
    conv.add_argument("--target-decoder-last-pipeline-num-layers", type=int, metavar="N")
    conv.add_argument("--target-account-for-embedding-in-pipeline-split", action="store_true",
                      help="the embedding counts as a layer of the pipeline split")
    conv.add_argument("--target-account-for-loss-in-pipeline-split", action="store_true",
                      help="the loss counts as a layer of the pipeline split")
    conv.add_argument("--target-expert-model-parallel-size", type=int, default=1, metavar="E",
                      help="MoE models: ranks the experts are spread over (default: 1); each expert is written "
                           "whole (no expert tensor-parallel split, as Megatron's converter has no such target)")
    conv.add_argument("--target-data-parallel-size", type=int, default=1, metavar="D",
                      help="data-parallel replicas to write (default: 1; a resume with another dp reshards anyway)")
    conv.add_argument("--target-ckpt-format", choices=("torch", "torch_dist"), metavar="F",
                      help="torch_dist (torch.distributed.checkpoint) or torch (one file per rank); default: the "
                           "source checkpoint's")
    add_family_module_flag(conv)
    conv.set_defaults(func=run_convert)
    exp = cmds.add_parser("export", help="the full model weights of a checkpoint to one safetensors file")
    exp.add_argument("--load", required=True, metavar="DIR", help="a --save directory (its latest) or an iter_N one")
    exp.add_argument("--out", required=True, metavar="FILE", help="the .safetensors file to write")
    add_family_module_flag(exp)
    exp.set_defaults(func=run_export)
    from omnitron.commands import hf, megatron  # import-hf / export-hf, import-megatron / export-megatron

    hf.register(cmds)
    megatron.register(cmds)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run_inspect(args: argparse.Namespace) -> int:
    from omnitron.core.checkpoint import CheckpointError
    from omnitron.core.checkpoint.reshard import Layout, read_full_state

    try:
        path = resolve(args.dir)
        full = read_full_state(path)
    except (CheckpointError, OSError, ValueError) as err:
        return fail("inspect", err)
    meta = full.meta
    print(f"checkpoint   {path}")
    print(f"iteration    {meta['iteration']} ({meta['consumed_samples']} samples consumed)")
    print(f"layout       {Layout.from_dict(meta['layout'])} ({meta['world_size']} shards)")
    print(f"format       {meta.get('ckpt_format', 'torch')}")
    if meta.get("resharded_from"):
        print(f"converted    from {Layout.from_dict(meta['resharded_from'])} (no RNG state)")
    m = meta["model"]
    print(f"model        {m['num_layers']} layers, hidden {m['hidden_size']}, {m['num_attention_heads']} heads, "
          f"vocab {m['vocab_size']}, {m.get('params_dtype')}")
    print(f"parameters   {sum(t.numel() for t in full.model.values()):,}")
    opt = full.optimizer_meta
    if opt.get("weights_only"):
        print("optimizer    none: weights only (imported); training from it starts as --finetune")
    else:
        print(f"optimizer    {opt.get('optimizer')} step {opt.get('step')}, state {sorted(full.optimizer)}"
              + (f", loss scaler {opt['loss_scaler']}" if "loss_scaler" in opt else ""))
    for name, t in sorted(full.model.items(), key=lambda kv: _natural(kv[0])):
        print(f"  {name:60s} {str(tuple(t.shape)):>16s} {str(t.dtype).replace('torch.', '')}")
    return 0


def _natural(name: str) -> list:
    """Sort key putting decoder.layers.10 after decoder.layers.9."""
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def run_convert(args: argparse.Namespace) -> int:
    from omnitron.core.checkpoint import CheckpointError
    from omnitron.core.checkpoint.reshard import Layout, convert, model_config, read_metadata, recorded_family
    from omnitron.core.config.parallel import ConfigError

    import time

    start = time.perf_counter()

    def say(text: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f} s] {text}", flush=True)

    def progress(shards, total):
        from tqdm import tqdm

        return tqdm(shards, total=total, unit="shard", desc="converting", disable=not sys.stderr.isatty())

    try:
        path = resolve(args.load)
        check_save("--save", args.save, args.load, path)  # never over a checkpoint, never into --load
        meta = read_metadata(path)
        target = _target_layout(args, model_config(meta["model"], recorded_family(meta, path)))
        out = convert(path, args.save, target, args.target_ckpt_format, say=say, progress=progress)
    except (CheckpointError, ConfigError, OSError, ValueError) as err:
        return fail("convert", err)
    say(f"converted {path} ({Layout.from_dict(read_metadata(path)['layout'])}) to {out} ({target}); a resume "
        f"continues the data order with fresh RNG streams")
    return 0


def _target_layout(args: argparse.Namespace, cfg):
    """The Layout the --target-* flags ask for for the checkpoint's model ``cfg`` (ConfigError naming the --target-
    flag when they do not fit), checked as a training run's layout and model are, before anything is read: a
    checkpoint written in a layout no run can have is refused by every reader, and a target the model does not
    split over (heads, query groups or the MLP over tp) fails the conversion."""
    from omnitron.core.checkpoint.reshard import Layout, layout_only
    from omnitron.core.config.parallel import ConfigError
    from omnitron.core.models.family import family_of
    from omnitron.core.models.gpt.validate import validate_model
    from omnitron.core.parallel.pipeline.layout import pipeline_layer_ranges, virtual_pipeline_size

    num_layers, num_experts = cfg.num_layers, getattr(cfg, "num_experts", None)

    tp, pp = args.target_tensor_model_parallel_size, args.target_pipeline_model_parallel_size
    first, last = args.target_decoder_first_pipeline_num_layers, args.target_decoder_last_pipeline_num_layers
    embedding = args.target_account_for_embedding_in_pipeline_split
    loss = args.target_account_for_loss_in_pipeline_split
    for flag, v in (("--target-tensor-model-parallel-size", tp), ("--target-pipeline-model-parallel-size", pp),
                    ("--target-data-parallel-size", args.target_data_parallel_size),
                    ("--target-expert-model-parallel-size", args.target_expert_model_parallel_size)):
        if v < 1:
            raise ConfigError(f"{flag} must be >= 1, got {v}")
    _check_experts(tp, args.target_data_parallel_size, args.target_expert_model_parallel_size, num_experts)
    try:  # the training flags' rules, their names with --target- in front
        vp = virtual_pipeline_size(num_layers, pp, args.target_num_layers_per_virtual_pipeline_stage,
                                   args.target_num_virtual_stages_per_pipeline_rank, first, last, embedding, loss)
        pipeline_layer_ranges(num_layers, pp, vp, first, last, embedding=embedding, loss=loss)
        layout = Layout(tp=tp, pp=pp, vp=vp, dp=args.target_data_parallel_size,
                        ep=args.target_expert_model_parallel_size, first=first, last=last, embedding=embedding,
                        loss=loss)
        parallel = layout.parallel_config()  # the training rules for the whole grid
        shape = layout_only(cfg)  # what the target needs, not how the recorded run executed
        if family_of(shape).validate is not None:  # the model's rules at that grid, as a run's settings check them
            family_of(shape).validate(shape, parallel)
        validate_model(shape, parallel, check_layers=not parallel.uneven_pipeline)
    except ConfigError as err:
        raise ConfigError(re.sub(r"--(?=pipeline-model|num-layers-per|num-virtual|decoder-|account-for|tensor-model|"
                                 r"data-parallel|expert-model)", "--target-", str(err))) from None
    return layout


def _check_experts(tp: int, dp: int, ep: int, num_experts: int | None) -> None:
    """The experts' ranks: ``ep`` needs an MoE model, must divide its experts and the tp x dp ranks of a pipeline
    stage (whole experts, as converted checkpoints hold them); ConfigError naming the --target- flag that fixes it."""
    from math import gcd

    from omnitron.core.config.parallel import ConfigError

    if ep == 1:
        return
    if not num_experts:
        raise ConfigError(f"--target-expert-model-parallel-size {ep} needs an MoE model and this checkpoint's has no "
                          f"experts; use --target-expert-model-parallel-size 1")
    if num_experts % ep:
        raise ConfigError(f"--target-expert-model-parallel-size {ep} does not divide the model's {num_experts} "
                          f"experts (each rank holds as many); use a divisor of {num_experts}")
    if (tp * dp) % ep:
        step = ep // gcd(ep, tp)  # the smallest dp whose tp x dp ep divides, and its multiples
        raise ConfigError(f"--target-expert-model-parallel-size {ep} must divide the ranks of a pipeline stage, "
                          f"--target-tensor-model-parallel-size {tp} x --target-data-parallel-size {dp} = {tp * dp}; "
                          f"give --target-data-parallel-size {step * -(-dp // step)}")


