"""Writes the Megatron-LM checkpoints beside this file WITH MEGATRON-LM'S OWN CODE: legacy ``--ckpt-format torch``
directories of a run with ``--use-distributed-optimizer``, each tensor x pipeline rank's ``model_optim_rng.pt``
and ``distrib_optim.pt``, and ``held.pt`` (what that rank's optimizer held: per model chunk, per parameter, its
``exp_avg`` and ``exp_avg_sq`` in the parameter's shape -- the reference the reader is checked against); the three
cases' directories are committed as ``megatron_checkpoints.tar.xz`` (74 KB; the test unpacks it).

Per case: megatron-core's ``GPTModel`` (local layer spec, CPU, float32) built by each of tp x pp gloo processes
with megatron-core's parallel state (virtual pipeline chunks included; megatron-core sets the tied embedding's
``shared_embedding`` flags itself); Megatron's argparse values (``megatron.training.arguments.parse_args`` of
the case's flags; the few fields ``validate_args`` derives -- it needs CUDA -- are filled as it would);
the bucket size per chunk by Megatron's rule (``resolve_ddp_bucket_size``, then get_model's per-chunk rule:
none for a chunk after the first or a stage after the first); the buffer layout by
``DistributedOptimizer.compute_full_param_layout``; each data-parallel rank's shard ranges by
``DistributedOptimizer._build_gbuf_range_map``; and the file by ``DistributedOptimizer.get_parameter_state_dp_zero``
(what ``save_parameter_state`` torch.saves), the data-parallel ranks stood in for by stubs (the gloo gather
replayed from each rank's sends). The moments are random (positive ``exp_avg_sq``), the main parameters the
model's own. Needs a Megatron-LM checkout (snapshot d98e8a64dd was used) and torch; CPU, offline:

    MEGATRON_LM=/path/to/Megatron-LM python tests/checkpoint/megatron_optim/make_fixtures.py

omnitron is not imported.
"""
from __future__ import annotations

import argparse
import os
import sys
import tarfile
import types
import typing

import torch

if not hasattr(typing, "override"):
    typing.override = lambda f: f

HERE = os.path.dirname(os.path.abspath(__file__))
ITERATION, SEED = 7, 20261207
# name: tp, pp, vp, dp, layers, flags (Megatron's)
CASES = {
    "tp1_dp1": (1, 1, 1, 1, 1, ["--ddp-bucket-size", "300"]),  # no --overlap-grad-reduce: one bucket anyway
    "tp2_dp2": (2, 1, 1, 2, 1, ["--overlap-grad-reduce", "--ddp-bucket-size", "300"]),
    "pp2_vp2_dp2": (1, 2, 2, 2, 4, ["--overlap-grad-reduce", "--ddp-bucket-size", "200"]),
}


def megatron_args(tp, pp, vp, dp, layers, flags):
    from megatron.training.arguments import parse_args

    argv = ["--num-layers", str(layers), "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "4",
            "--max-position-embeddings", "4", "--tokenizer-type", "NullTokenizer", "--vocab-size", "24",
            "--make-vocab-size-divisible-by", "8", "--use-distributed-optimizer", "--ckpt-format", "torch",
            "--transformer-impl", "local", "--micro-batch-size", "1", "--global-batch-size", str(2 * dp),
            "--lr", "0.001", "--train-iters", "10", "--tensor-model-parallel-size", str(tp),
            "--pipeline-model-parallel-size", str(pp)] + (["--num-layers-per-virtual-pipeline-stage",
                                                           str(layers // pp // vp)] if vp > 1 else []) + flags
    saved, sys.argv = sys.argv, ["pretrain_gpt.py"] + argv
    try:
        args = parse_args(ignore_unknown_args=True)
    finally:
        sys.argv = saved
    # what validate_args derives for these flags
    multiple = args.make_vocab_size_divisible_by * tp
    args.padded_vocab_size = -(-(args.vocab_size + 1) // multiple) * multiple  # NullTokenizer adds its eod
    args.world_size, args.data_parallel_size = tp * pp * dp, dp
    args.ffn_hidden_size, args.kv_channels, args.num_query_groups = 4 * args.hidden_size, args.hidden_size // 2, 2
    args.virtual_pipeline_model_parallel_size = vp if vp > 1 else None
    args.iteration = ITERATION
    return args


def rank_main(rank: int, name: str, port: int) -> None:
    tp, pp, vp, dp, layers, flags = CASES[name]
    sys.path.insert(0, os.environ.get("MEGATRON_LM", "/tmp/megatron"))
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=tp * pp)
    torch.Tensor.cuda = lambda self, *a, **k: self  # CPU: the tied copy's sync moves it to the device first
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    args = megatron_args(tp, pp, vp, dp, layers, flags)
    parallel_state.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vp if vp > 1 else None)
    t, p = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(SEED + rank)
    cfg = TransformerConfig(num_layers=layers, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True,
                            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            virtual_pipeline_model_parallel_size=vp if vp > 1 else None,
                            pipeline_dtype=torch.float32, gradient_accumulation_fusion=False,
                            hidden_dropout=0.0, attention_dropout=0.0)
    chunks = []
    for v in range(vp):
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v)
        chunks.append(GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=args.padded_vocab_size,
                               max_sequence_length=4, pre_process=pre, post_process=post,
                               share_embeddings_and_output_weights=True, vp_stage=v if vp > 1 else None))
    buckets = chunk_bucket_sizes(args, chunks, p)
    held, state = write_distrib_optim(chunks, buckets, dp)
    out = os.path.join(HERE, name, f"iter_{ITERATION:07d}", f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else ""))
    os.makedirs(out, exist_ok=True)
    torch.save(state, os.path.join(out, "distrib_optim.pt"))  # DistributedOptimizer.save_parameter_state
    torch.save(held, os.path.join(out, "held.pt"))
    models = {"model": chunks[0].state_dict_for_save_checkpoint()} if vp == 1 else \
        {f"model{v}": c.state_dict_for_save_checkpoint() for v, c in enumerate(chunks)}
    # Megatron's save_checkpoint: args, version, iteration, model(s), the optimizer's non-parameter state
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "step": ITERATION}]
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION, **models,
                "optimizer": {"optimizer": {"param_groups": groups}}}, os.path.join(out, "model_optim_rng.pt"))
    if rank == 0:
        with open(os.path.join(HERE, name, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def chunk_bucket_sizes(args, chunks, pp_rank: int) -> list:
    """Megatron's rule: ``resolve_ddp_bucket_size`` (None without --overlap-grad-reduce), then get_model's per-chunk
    sizes (None for a chunk after the first and on a stage after the first)."""
    from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
    from megatron.training.training import resolve_ddp_bucket_size

    config = DistributedDataParallelConfig(overlap_grad_reduce=args.overlap_grad_reduce,
                                           bucket_size=args.ddp_bucket_size, num_buckets=args.ddp_num_buckets,
                                           use_distributed_optimizer=True)
    group = types.SimpleNamespace(size=lambda: args.data_parallel_size)
    size = resolve_ddp_bucket_size(config, group, config.overlap_grad_reduce,
                                   sum(q.numel() for c in chunks for q in c.parameters()))
    return [None if (v > 0 or pp_rank > 0) else size for v in range(len(chunks))]


def write_distrib_optim(chunks, buckets, dp: int):
    """Random moments for every parameter; the file Megatron's ``get_parameter_state_dp_zero`` writes on data-parallel
    rank 0, each rank's shard gathered (stubbed: ``dp`` ranks, the gather replayed)."""
    import torch.distributed as dist
    from megatron.core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    g = torch.Generator().manual_seed(SEED + 1000 * dist.get_rank())
    held, truth, layouts = [], {}, []
    for chunk, bucket in zip(chunks, buckets):
        named = [(n, q) for n, q in chunk.named_parameters() if q.requires_grad]
        mine = {}
        for n, q in named:
            m = torch.randn(q.shape, generator=g) * 1e-3
            v = (torch.randn(q.shape, generator=g) * 1e-3) ** 2
            mine[n] = {"exp_avg": m, "exp_avg_sq": v}
            truth[q] = {"param": q.detach().float().flatten(), "exp_avg": m.flatten(), "exp_avg_sq": v.flatten()}
        held.append(mine)
        full = DistributedOptimizer.compute_full_param_layout([q for _, q in named], bucket, dp,
                                                              DistributedDataParallelConfig(
                                                                  use_distributed_optimizer=True))
        (key, lay), = full.layouts.items()
        layouts.append(lay)

    def fake_buffer(lay, r):
        grp = types.SimpleNamespace(rank=lambda: r, size=lambda: dp)
        bks = [types.SimpleNamespace(grad_data=torch.empty(hi - lo), offset=lo, numel_unpadded=u)
               for (lo, hi), u in zip(lay.bucket_indices, lay.per_bucket_numel_unpadded)]
        return types.SimpleNamespace(param_dtype=torch.float32, grad_dtype=torch.float32, data_parallel_group=grp,
                                     num_optimizer_shards=dp, buckets=bks, param_index_map=lay.param_index_map,
                                     numel_unpadded=sum(lay.per_bucket_numel_unpadded))

    sent = {r: [] for r in range(dp)}
    state = None
    for r in list(range(1, dp)) + [0]:
        buffers = [fake_buffer(lay, r) for lay in layouts]
        ranges = [DistributedOptimizer._build_gbuf_range_map(b) for b in buffers]
        maps = {}
        for rm in ranges:
            for bm in next(iter(rm.values())):
                maps.update(bm["param_map"])

        def states(q, maps=maps):
            sub = maps[q]["param"]
            return {k: t[sub.start:sub.end] for k, t in truth[q].items()}

        me = types.SimpleNamespace(data_parallel_group_gloo=buffers[0].data_parallel_group, gbuf_ranges=ranges,
                                   buffers=buffers, optimizer_state_keys=("exp_avg", "exp_avg_sq"),
                                   _get_main_param_and_optimizer_states=states)
        calls = iter(range(10 ** 6))

        def gather(send, recv, dst, group, r=r, calls=calls):
            k = next(calls)
            sent[r].append(send.clone())
            if recv is not None:
                for q in range(dp):
                    recv[q].copy_(sent[q][k])

        orig = (dist.gather, dist.get_process_group_ranks)
        dist.gather, dist.get_process_group_ranks = gather, lambda grp: list(range(dp))
        try:
            out = DistributedOptimizer.get_parameter_state_dp_zero(me)
        finally:
            dist.gather, dist.get_process_group_ranks = orig
        if r == 0:
            state = out
    return held, state


def main() -> None:
    import shutil
    import socket

    import torch.multiprocessing as mp

    for name, (tp, pp, *_rest) in CASES.items():
        shutil.rmtree(os.path.join(HERE, name), ignore_errors=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(rank_main, args=(name, port), nprocs=tp * pp, join=True)
    with tarfile.open(os.path.join(HERE, "megatron_checkpoints.tar.xz"), "w:xz") as tar:
        for name in CASES:
            tar.add(os.path.join(HERE, name), arcname=name)
            shutil.rmtree(os.path.join(HERE, name))


if __name__ == "__main__":
    main()
