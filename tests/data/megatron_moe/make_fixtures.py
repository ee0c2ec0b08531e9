"""Writes ``fixtures.json`` beside this file WITH MEGATRON-CORE'S OWN MoE LAYER: outputs and gradients omnitron's MoE
layer must reproduce (tests/models/test_megatron_moe_layer.py).

Needs a Megatron-LM checkout (snapshot d98e8a6 was used) and torch; runs on CPU, offline, one gloo process, without
Transformer Engine (the local spec: SequentialMLP experts, the alltoall dispatcher). omnitron is not imported.
Run from the omnitron root:

    PYTHONPATH=/path/to/Megatron-LM python tests/data/megatron_moe/make_fixtures.py

Stand-ins on CPU, none of which changes a number: ``torch.cuda`` streams and events (no-op objects), the current
device ("cpu"), the RNG tracker's fork (no dropout), ``all_to_all_single``'s split sizes as Python lists (gloo
takes no tensors there), ``moe_utils.te_general_gemm`` unset (the router's plain matmul). Every parameter is drawn
by :func:`draw` in the order of the names listed (the test draws the same), the router in float32
(``moe_router_dtype fp32``), everything else float64; an expert bias (a buffer) is drawn from ``seed + 2``.
"""
from __future__ import annotations

import contextlib
import json
import os

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPE = dict(s=4, b=2, h=8, E=4, f=8, k=2)
CASES = {
    # name -> the MoE settings (TransformerConfig fields, which are omnitron's GPTConfig fields of the same name)
    "capacity_probs_list_losses": dict(moe_expert_capacity_factor=0.5, moe_token_drop_policy="probs",
                                       moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                                       moe_aux_loss_coeff=[0.3, 0.5], moe_z_loss_coeff=0.1),
    "capacity_probs_padded": dict(moe_expert_capacity_factor=0.75, moe_token_drop_policy="probs",
                                  moe_pad_expert_input_to_capacity=True, moe_router_load_balancing_type="aux_loss",
                                  moe_aux_loss_coeff=0.2),
    "sigmoid_groups_seq_aux": dict(moe_router_score_function="sigmoid", moe_router_num_groups=2,
                                   moe_router_group_topk=1, moe_router_topk_scaling_factor=2.5,
                                   moe_expert_capacity_factor=1.0, moe_router_load_balancing_type="seq_aux_loss",
                                   moe_aux_loss_coeff=0.4),
    "dropless_shared_z": dict(moe_shared_expert_intermediate_size=8, moe_router_pre_softmax=True,
                              moe_router_load_balancing_type="none", moe_z_loss_coeff=0.05),
    # the expert bias's token counts are the routing map after the capacity (dropped pairs out, padding rows in)
    "sigmoid_bias_capacity": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                  moe_router_bias_update_rate=0.01, moe_expert_capacity_factor=0.75,
                                  moe_router_load_balancing_type="none"),
    "sigmoid_bias_capacity_padded": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                         moe_router_bias_update_rate=0.01, moe_expert_capacity_factor=0.75,
                                         moe_pad_expert_input_to_capacity=True, moe_router_load_balancing_type="none"),
}
SCALE = 0.7  # the aux losses' gradient weight (Megatron's MoEAuxLossAutoScaler scale)


def draw(names_shapes, seed: int) -> dict:
    """``{name: float64 tensor}``: normal draws in the listed order (router 0.5, others 0.3)."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g, dtype=torch.float64) * (0.5 if n.startswith("router") else 0.3)
            for n, shape in names_shapes}


def _cpu_stand_ins() -> None:
    class Stream:
        def __init__(self, *a, **k): pass
        def wait_stream(self, *a): pass
        def wait_event(self, *a): pass
        def record_event(self, *a): return Stream()
        def synchronize(self): pass
        def record(self, *a): pass

    current = Stream()
    torch.cuda.Stream = torch.cuda.Event = Stream
    torch.cuda.current_stream = lambda *a, **k: current
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.record_stream = lambda self, *a: None
    a2a = torch.distributed.all_to_all_single

    def all_to_all_single(out, inp, output_split_sizes=None, input_split_sizes=None, **kw):
        lists = [None if v is None else [int(x) for x in v] for v in (output_split_sizes, input_split_sizes)]
        return a2a(out, inp, *lists, **kw)

    torch.distributed.all_to_all_single = all_to_all_single


def run_case(name: str, settings: dict, seed: int) -> dict:
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe import moe_logging
    from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler
    from megatron.core.transformer.transformer_config import TransformerConfig

    s, b, h, E, f, k = (SHAPE[x] for x in ("s", "b", "h", "E", "f", "k"))
    cfg = TransformerConfig(num_layers=2, hidden_size=h, num_attention_heads=2, ffn_hidden_size=2 * h,
                            num_moe_experts=E, moe_router_topk=k, moe_ffn_hidden_size=f, params_dtype=torch.float64,
                            moe_router_dtype="fp32", moe_token_dispatcher_type="alltoall", gated_linear_unit=True,
                            activation_func=F.silu, add_bias_linear=False, use_cpu_initialization=True,
                            hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
                            gradient_accumulation_fusion=False, moe_router_fusion=False, moe_permute_fusion=False,
                            **settings)
    layer = get_moe_module_spec(use_te=False, num_experts=E)(config=cfg, layer_number=1)
    layer.set_layer_number(1)
    layer.train()
    params = dict(layer.named_parameters())
    weights = draw([(n, tuple(p.shape)) for n, p in sorted(params.items())], seed)
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(weights[n])
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(s, b, h, generator=g, dtype=torch.float64).requires_grad_(True)
    dy = torch.randn(s, b, h, generator=g, dtype=torch.float64)
    bias = layer.router.expert_bias
    if bias is not None:  # a drawn expert bias (float32, as Megatron keeps it) that steers the picks
        bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(seed + 2)) * 0.3)
    moe_logging.get_moe_metrics_tracker().clear()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(SCALE))
    y, _ = layer(x)
    (y * dy).sum().backward()
    tracker = {n: e.values[0].item() for n, e in moe_logging.get_moe_metrics_tracker().metrics.items()}
    out = {"settings": settings, "seed": seed, "y": y.detach().flatten().tolist(),
           "dx": x.grad.flatten().tolist(), "tracker": tracker,
           "grads": {n: p.grad.flatten().tolist() for n, p in sorted(params.items()) if p.grad is not None}}
    if bias is not None:  # the step's counts and finalize_model_grads' update of the bias
        from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

        counts = layer.router.local_tokens_per_expert
        out["tokens_per_expert"] = counts.tolist()
        out["updated_expert_bias"] = get_updated_expert_bias(counts.clone(), bias, cfg.moe_router_bias_update_rate,
                                                             torch.distributed.group.WORLD).tolist()
    return out


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(20000 + os.getpid() % 20000))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    _cpu_stand_ins()
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core import parallel_state, tensor_parallel

    moe_utils.te_general_gemm = None
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    out = {"shape": SHAPE, "scale": SCALE,
           "cases": {name: run_case(name, settings, 100 + i) for i, (name, settings) in enumerate(CASES.items())}}
    with open(os.path.join(HERE, "fixtures.json"), "w") as fh:
        json.dump(out, fh, indent=0)


if __name__ == "__main__":
    main()
