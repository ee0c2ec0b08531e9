"""megatron-core's side of tests/checkpoint/test_megatron_core_interop.py for MoE / MLA / MTP models, run in its own
process: ``python megatron_core_moe_side.py DIR``.

Builds megatron-core's ``GPTModel`` (local spec through ``get_gpt_decoder_block_spec`` and
``get_gpt_mtp_block_spec``, SequentialMLP experts, allgather dispatcher, CPU) from ``DIR/args.pt`` (the test's
own file), loads omnitron's torch_dist export ``DIR/omnitron/iter_0000000`` with ``dist_checkpointing.load``,
and writes to ``DIR/loaded.pt``: the main logits, the MTP depths' logits (the output layer's calls), and the
model's ``state_dict`` tensors. Then gives every parameter and the routers' ``expert_bias`` fresh random values,
saves with ``dist_checkpointing.save`` to ``DIR/megatron/iter_0000005`` and writes the same record to
``DIR/saved.pt``.

Stand-ins on CPU (none changes what a checkpoint holds): RoPE's device, the tensor-parallel RNG tracker,
``torch.cuda.synchronize``; MLA's core attention (megatron-core's local ``DotProductAttention`` takes no
``k_channels``, so MLA needs TE's) is a plain causal softmax attention with MLA's softmax scale, and
``HAVE_TE`` is cleared in ``multi_latent_attention`` (it only selects FP8 paths); ``moe_utils.te_general_gemm``
(unbound without TE) is set to None, the router's plain matmul path; later megatron-core's MTP layer asks
``is_inference_column_parallel_linear`` (an isinstance on TE's inference linears, None without TE): answered False.
"""
import contextlib
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_core_side import save_random  # noqa: E402


class CoreAttention(torch.nn.Module):
    """Causal softmax attention ``[s, b, h, d]`` -> ``[s, b, h * dv]`` (MLA's core attention on CPU)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, k_channels=None,
                 v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.scale = softmax_scale

    def forward(self, q, k, v, mask, packed_seq_params=None, attn_mask_type=None):
        s = torch.einsum("sbhd,tbhd->bhst", q, k) * self.scale
        s = s.masked_fill(torch.triu(torch.ones(q.shape[0], k.shape[0], dtype=torch.bool), 1), float("-inf"))
        o = torch.einsum("bhst,tbhd->sbhd", s.softmax(-1), v)
        return o.reshape(o.shape[0], o.shape[1], -1)


def build(args, **extra):
    """megatron-core's GPTModel of ``args`` (Megatron's argument names); ``extra``: further config fields."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    kw = dict(num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
              ffn_hidden_size=args.ffn_hidden_size, normalization=args.normalization, gated_linear_unit=True,
              activation_func=F.silu, add_bias_linear=False, layernorm_epsilon=args.norm_epsilon,
              use_cpu_initialization=True, qk_layernorm=args.qk_layernorm, num_moe_experts=args.num_experts,
              moe_router_topk=args.moe_router_topk, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
              moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
              moe_layer_freq=args.moe_layer_freq, moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
              moe_router_score_function=args.moe_router_score_function,
              moe_router_num_groups=args.moe_router_num_groups,
              moe_router_group_topk=args.moe_router_group_topk,
              moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor, moe_aux_loss_coeff=0.0,
              moe_router_load_balancing_type="none", moe_token_dispatcher_type="allgather",
              mtp_num_layers=args.mtp_num_layers, hidden_dropout=0.0, attention_dropout=0.0,
              bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
              apply_rope_fusion=False, gradient_accumulation_fusion=False)
    kw.update(extra)
    if args.multi_latent_attention:
        cfg = MLATransformerConfig(**kw, multi_latent_attention=True, q_lora_rank=args.q_lora_rank,
                                   kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
                                   qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim,
                                   rope_type=args.rope_type, rotary_base=args.rotary_base,
                                   rotary_scaling_factor=args.rotary_scaling_factor, mscale=args.mscale,
                                   mscale_all_dim=args.mscale_all_dim,
                                   original_max_position_embeddings=args.original_max_position_embeddings,
                                   beta_fast=args.beta_fast, beta_slow=args.beta_slow)
    else:
        cfg = TransformerConfig(**kw, num_query_groups=args.num_query_groups, kv_channels=args.kv_channels)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization=cfg.normalization)
    if args.multi_latent_attention:
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = CoreAttention
    mtp = get_gpt_mtp_block_spec(cfg, spec.layer_specs[-1], use_transformer_engine=False) \
        if args.mtp_num_layers else None
    return GPTModel(cfg, spec, vocab_size=args.padded_vocab_size, max_sequence_length=args.seq_length,
                    position_embedding_type="rope", rotary_base=args.rotary_base,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    mtp_block_spec=mtp).eval()


def record(model, tokens):
    """Main logits, MTP logits (the output layer's earlier calls in a forward with labels), state_dict tensors."""
    calls = []
    forward = model.output_layer.forward

    def spy(*a, **k):
        out = forward(*a, **k)
        calls.append(out[0].detach().clone())
        return out

    model.output_layer.forward = spy
    pos = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    mask = torch.triu(torch.ones(tokens.shape[1], tokens.shape[1]), 1).bool()[None, None]
    with torch.no_grad():
        model(tokens, pos, mask, labels=tokens)
    model.output_layer.forward = forward
    return {"logits": calls[-1], "mtp_logits": calls[:-1],
            "state": {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}}


def cpu_stand_ins() -> None:
    """One gloo process with megatron-core's parallel state at tp = pp = 1 and the CPU stand-ins of the module
    docstring (also used by tests/models/megatron_mla_mtp/make_fixtures.py)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(20000 + os.getpid() % 20000))
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.multi_latent_attention as mla
    import megatron.core.transformer.multi_token_prediction as mtp
    from megatron.core import parallel_state, tensor_parallel

    mla.HAVE_TE = False
    moe_utils.te_general_gemm = None  # unbound without TE: the router's plain matmul path
    if hasattr(mtp, "is_inference_column_parallel_linear"):  # later megatron-core: an isinstance on TE's classes
        mtp.is_inference_column_parallel_linear = lambda module: False
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


def main(root: str) -> None:
    from megatron.core import dist_checkpointing

    cpu_stand_ins()
    args = torch.load(os.path.join(root, "args.pt"), weights_only=False)  # the test's own file
    model = build(args)
    tokens = torch.load(os.path.join(root, "tokens.pt"))
    state = dist_checkpointing.load({"model": model.sharded_state_dict()},
                                    os.path.join(root, "omnitron", "iter_0000000"))
    model.load_state_dict(state["model"], strict=True)
    torch.save(record(model, tokens), os.path.join(root, "loaded.pt"))

    save_random(model, args, root, list(model.named_parameters()) +
                [(n, b) for n, b in model.named_buffers() if n.endswith("expert_bias")])
    torch.save(record(model, tokens), os.path.join(root, "saved.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
