"""megatron-core's side of tests/checkpoint/test_megatron_core_interop.py, run as a script in its own process
(it needs a process group and megatron-core's parallel state): ``python megatron_core_side.py KIND DIR [TP]``:
megatron-core at tensor-parallel size TP (default 1; TP > 1: TP gloo processes, the logits gathered over tp).

1. Builds megatron-core's ``GPTModel`` (local layer spec, CPU) for the test's model ``KIND``, loads the
   torch_dist checkpoint ``DIR/omnitron/iter_0000000`` (omnitron's export) with
   ``megatron.core.dist_checkpointing.load`` as Megatron's training loop does, and writes the logits of
   ``DIR/tokens.pt`` to ``DIR/loaded_logits.pt``.
2. Re-initialises the model's weights at random, saves them with ``dist_checkpointing.save`` (the state
   dict Megatron's training loop writes: model, args, iteration, checkpoint_version) to
   ``DIR/megatron/iter_0000005`` with its tracker, and writes that model's logits to ``DIR/saved_logits.pt``.

On CPU, CUDA calls are stood in for: the RoPE buffer's device, the tensor-parallel RNG tracker and the
default causal mask (forward), ``torch.cuda.synchronize`` (the saver's wait); none changes what a
checkpoint holds.
"""
import contextlib
import os
import sys

import torch
import torch.nn.functional as F


def main(kind: str, root: str, tp: int = 1, rank: int = 0, port: int = 0) -> None:
    if tp == 1:
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    else:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    torch.cuda.current_device = lambda: "cpu"  # RoPE moves its inv_freq to the current CUDA device
    torch.cuda.synchronize = lambda *a, **k: None  # the saver waits for the device before writing
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tp, 1)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # dropout is 0
    args = torch.load(os.path.join(root, "args.pt"), weights_only=False)  # the test's own file
    llama = kind == "llama"
    cfg = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if llama else args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, kv_channels=args.kv_channels, normalization=args.normalization,
        gated_linear_unit=llama, activation_func=F.silu if llama else F.gelu, add_bias_linear=not llama,
        layernorm_epsilon=args.norm_epsilon, use_cpu_initialization=True, bias_activation_fusion=not llama,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp)
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization=cfg.normalization),
                     vocab_size=args.padded_vocab_size, max_sequence_length=args.seq_length,
                     position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights).eval()
    tokens = torch.load(os.path.join(root, "tokens.pt"))
    pos = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    mask = torch.triu(torch.ones(tokens.shape[1], tokens.shape[1]), 1).bool()[None, None]  # True: masked

    def logits(name: str) -> None:  # the vocabulary's tp shards gathered, written by rank 0
        with torch.no_grad():
            out = model(tokens, pos, mask).contiguous()
        parts = [torch.empty_like(out) for _ in range(tp)]
        torch.distributed.all_gather(parts, out)
        if rank == 0:
            torch.save(torch.cat(parts, -1), os.path.join(root, name))

    state = {"model": model.sharded_state_dict()}
    state = dist_checkpointing.load(state, os.path.join(root, "omnitron", "iter_0000000"))
    model.load_state_dict(state["model"], strict=True)
    logits("loaded_logits.pt")

    save_random(model, args, root, model.named_parameters(), rank)
    logits("saved_logits.pt")


def save_random(model, args, root: str, tensors, rank: int = 0) -> None:
    """Give ``tensors`` (name, tensor) fresh random values (seed ``$SEED``; norms near 1; a tensor-parallel shard
    its own per rank, a replicated tensor the same on every rank) and save ``model`` with megatron-core's
    ``dist_checkpointing.save`` as Megatron's training loop does (model, args, iteration, checkpoint_version) to
    ``root/megatron/iter_0000005``, with its tracker file."""
    from megatron.core import dist_checkpointing

    seed = int(os.environ.get("SEED", "1"))
    with torch.no_grad():
        for i, (name, p) in enumerate(tensors):
            shard = rank if getattr(p, "tensor_model_parallel", False) else 0
            g = torch.Generator().manual_seed(seed + 1000 * i + shard)
            p.copy_((1.0 if "norm" in name else 0.0) + torch.randn(p.shape, generator=g) * 0.1)
    it = os.path.join(root, "megatron", "iter_0000005")
    os.makedirs(it, exist_ok=True)
    dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args, "iteration": 5,
                             "checkpoint_version": 3.0}, it)
    if rank == 0:
        with open(os.path.join(root, "megatron", "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("5")


def _rank(rank: int, kind: str, root: str, tp: int, port: int) -> None:
    main(kind, root, tp, rank, port)


if __name__ == "__main__":
    world = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    if world == 1:
        main(sys.argv[1], sys.argv[2])
    else:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as sock:  # a free port for the ranks' store
            sock.bind(("127.0.0.1", 0))
            free = sock.getsockname()[1]
        mp.spawn(_rank, args=(sys.argv[1], sys.argv[2], world, free), nprocs=world)
