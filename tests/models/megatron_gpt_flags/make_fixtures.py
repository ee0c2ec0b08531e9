"""Writes ``fixtures.pt`` beside this file WITH MEGATRON-LM'S OWN CODE: megatron-core's ``GPTModel`` (local layer
spec, CPU, float64) under one model-shape flag at a time, whose logits, per-token losses and gradients omnitron's
GPT must reproduce (tests/models/test_gpt_flags_megatron.py).

Needs megatron-core (the Megatron-LM d98e8a6 snapshot was used) and psutil on the path; runs on CPU, offline.
Run from the omnitron root (about a minute; two gloo processes for the tp2 runs):

    PYTHONPATH=/path/to/Megatron-LM python tests/models/megatron_gpt_flags/make_fixtures.py

omnitron is not imported. Each case of :data:`CASES` is a set of ``TransformerConfig`` / ``GPTModel`` arguments
as Megatron's ``core_transformer_config_from_args`` and ``gpt_builders.py`` set them from the flag in the case's
name. Every parameter gets seeded random values (bfloat16 values, so the fixture's bfloat16 weights are exact;
norm weights near 1); one forward gives the logits, one with labels the per-token loss, whose mean's backward gives
every gradient (stored as float32). The same weights then run at tensor-parallel size 2 on two gloo ranks (each
rank's slice of every split parameter; the gated fc1 as [gate_r; up_r]; one query group: megatron-core's
replicated key/value path) and rank 0's loss and the gathered gradients are stored too, the QK norms' summed over
the ranks as ``finalize_model_grads`` sums them. Also stored: RoPE's inverse frequencies (``rotary_pos_emb``).

``--apply-layernorm-1p`` (``layernorm_zero_centered_gamma``): megatron-core's local spec refuses it without Apex
("zero_centered_gamma not supported by torch LayerNorm"); Apex's and Transformer Engine's LayerNorm with it scale
by ``1 + weight``. So that case runs megatron-core's plain LayerNorm holding ``1 + w`` and stores ``w`` (the same
function; the gradient with respect to ``w`` is the one with respect to ``1 + w``).
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import typing

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

if not hasattr(typing, "override"):  # Megatron imports typing.override (Python >= 3.12)
    typing.override = lambda f: f

HERE = os.path.dirname(os.path.abspath(__file__))
V, S, B = 32, 12, 2  # vocabulary (a multiple of 2 x the divisor 1: no padding rows), sequence, batch
BASE = dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=24)
GPT2 = dict(position_embedding_type="learned_absolute")  # LayerNorm, GeLU (tanh, fused with its bias), biases, tied
LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
             untie=True, num_query_groups=2)
CASES = {  # name -> (flags, in Megatron's config / GPTModel argument names, seed)
    "gpt2": (dict(GPT2), 1),
    "qk_layernorm": (dict(GPT2, position_embedding_type="rope", qk_layernorm=True), 2),
    "qk_layernorm_gqa_rmsnorm": (dict(LLAMA, qk_layernorm=True), 3),
    "rotary_interleaved": (dict(LLAMA, rotary_interleaved=True), 4),
    "rotary_percent_half_base_500": (dict(LLAMA, rotary_percent=0.5, rotary_base=500), 5),
    # 8 pairs at base 5e5: wavelengths 6 .. 1.3e5, so all three of Llama 3.1's bands (kept, blended, / 8)
    "rope_scaling_llama31": (dict(LLAMA, rope_scaling=True, rotary_base=500000, kv_channels=16), 6),
    "layernorm_1p": (dict(GPT2, layernorm_zero_centered_gamma=True), 7),
    "rmsnorm_eps_1e-2": (dict(LLAMA, layernorm_epsilon=1e-2), 8),
    "swiglu_with_biases": (dict(GPT2, swiglu=True), 9),
    "gelu_no_bias": (dict(GPT2, add_bias_linear=False), 10),
    "qkv_bias_only": (dict(LLAMA, add_qkv_bias=True), 11),
    "untied_learned": (dict(GPT2, untie=True), 12),
    "kv_channels_12": (dict(LLAMA, kv_channels=12), 13),
    "query_groups_1": (dict(LLAMA, num_query_groups=1), 14),
    "query_groups_2_rope_gelu": (dict(GPT2, position_embedding_type="rope", num_query_groups=2), 15),
    "window_4_learnable_sinks": (dict(LLAMA, window_size=(4, 0), softmax_type="learnable"), 16),
    "off_by_one_softmax": (dict(LLAMA, softmax_type="off-by-one"), 17),
    "window_skip_freq_2": (dict(LLAMA, window_size=(3, 0), window_attn_skip_freq=2), 18),
    "no_position_embedding": (dict(LLAMA, position_embedding_type="none"), 19),  # NoPE
    # Megatron refuses --squared-relu with its fused bias-GeLU (bias_activation_fusion): biases need
    # --no-bias-gelu-fusion, as here
    "squared_relu_biases": (dict(GPT2, squared_relu=True), 20),
    "squared_relu_no_bias_rope": (dict(LLAMA, swiglu=False, squared_relu=True), 21),
    # megatron-core's layers never read it: the pre-norm model, whose numbers omnitron must give with the flag
    "residual_post_layernorm_flag": (dict(GPT2, apply_residual_connection_post_layernorm=True), 22),
}


def config(flags: dict, dtype=torch.float64):
    """megatron-core's TransformerConfig of a case, CPU and unfused where a fused kernel needs CUDA."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.core.activations import squared_relu

    swiglu, bias, relu2 = flags.get("swiglu", False), flags.get("add_bias_linear", True), flags.get("squared_relu")
    kw = {k: flags[k] for k in ("num_query_groups", "kv_channels", "qk_layernorm", "add_qkv_bias", "rotary_interleaved",
                                "window_size", "window_attn_skip_freq", "softmax_type",
                                "apply_residual_connection_post_layernorm") if k in flags}
    return TransformerConfig(
        **BASE, **kw, normalization=flags.get("normalization", "LayerNorm"),
        layernorm_epsilon=flags.get("layernorm_epsilon", 1e-5), gated_linear_unit=swiglu,
        activation_func=squared_relu if relu2 else F.silu if swiglu else F.gelu, add_bias_linear=bias,
        bias_activation_fusion=bias and not swiglu and not relu2,  # --bias-gelu-fusion's default: the tanh GeLU
        params_dtype=dtype, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False)


def build(flags: dict):
    """megatron-core's GPTModel of a case (as gpt_builders.py builds it)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cfg = config(flags)
    spec = get_gpt_layer_local_spec(qk_layernorm=cfg.qk_layernorm, normalization=cfg.normalization)
    return GPTModel(cfg, spec, vocab_size=V, max_sequence_length=S,
                    position_embedding_type=flags["position_embedding_type"],
                    rotary_percent=flags.get("rotary_percent", 1.0), rotary_base=flags.get("rotary_base", 10000),
                    rope_scaling=flags.get("rope_scaling", False),
                    share_embeddings_and_output_weights=not flags.get("untie", False)).double()


def draw(model, flags: dict, seed: int) -> dict:
    """Seeded bfloat16-valued weights (by name, full shapes), tokens and labels ``[B, S]``."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, p in model.named_parameters():
        centre = 1.0 if name.endswith("norm.weight") else 0.0
        weights[name] = (centre + 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64)).bfloat16()
    return {"weights": weights, "tokens": torch.randint(0, V, (B, S), generator=g),
            "labels": torch.randint(0, V, (B, S), generator=g)}


def stored_weights(flags: dict, weights: dict) -> dict:
    """The weights as the flag's model holds them: under zero-centred norms ``w`` where megatron-core ran ``1 + w``
    (float32: ``1 + w``'s 8 significant bits minus 1 need up to 8 + |exponent| bits, not always bfloat16's 8)."""
    if not flags.get("layernorm_zero_centered_gamma"):
        return weights
    return {n: (t.double() - 1.0).float() if n.endswith("norm.weight") else t for n, t in weights.items()}


class _FactoriesOnCpu(TorchFunctionMode):
    """Every torch call's ``device=`` argument pointed at the CPU (megatron-core names "cuda" in some factories)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs and "device" in kwargs:
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **(kwargs or {}))


def on_cpu(fn):
    """``fn`` run with its tensors built on the CPU (:class:`_FactoriesOnCpu`), its body unchanged."""

    def run_on_cpu(*args, **kwargs):
        with _FactoriesOnCpu():
            return fn(*args, **kwargs)

    return run_on_cpu


def cpu_stand_ins() -> None:
    """CUDA calls megatron-core makes on a CPU run: the device of RoPE's and the sinks' buffers and of the sliding
    window's mask (megatron-core's own ``get_sliding_window_causal_mask``, run :func:`on_cpu`), the tensor-parallel
    RNG tracker (dropout is 0)."""
    from megatron.core import tensor_parallel
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    torch.cuda.current_device = lambda: "cpu"
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    fused_softmax.get_sliding_window_causal_mask = on_cpu(utils.get_sliding_window_causal_mask)


def run(model, data: dict) -> dict:
    """Logits ``[s, b, V/tp]``, per-token loss ``[b, s]`` and the gradients of its mean."""
    tokens, labels = data["tokens"], data["labels"]
    pos = torch.arange(S)[None].expand(B, S)
    mask = torch.triu(torch.ones(S, S), 1).bool()[None, None]
    with torch.no_grad():
        logits = model(tokens, pos, mask).clone()
    loss = model(tokens, pos, mask, labels=labels)
    loss.mean().backward()
    return {"logits": logits.float(), "loss": loss.detach(),
            "grads": {n: p.grad.float() for n, p in model.named_parameters()}}


def _dim(name: str, p) -> int | None:
    """The dimension parameter ``p`` is split along over tp (None: replicated). The learnable sinks
    (``softmax_offset``, one per local head) carry no tensor-parallel attributes; their split is over the heads."""
    if name.endswith("softmax_offset"):
        return 0
    return p.partition_dim if getattr(p, "tensor_model_parallel", False) else None


def _split(name: str, p, full: torch.Tensor, tp: int, rank: int, gated: bool) -> torch.Tensor:
    """Rank ``rank``'s slice of the full tensor ``full`` of parameter ``p`` (its ``partition_dim``)."""
    dim = _dim(name, p)
    if dim is None:
        return full
    if gated and "linear_fc1" in name:  # [gate; up]: each rank holds its slice of both
        gate, up = full.chunk(2, dim)
        return torch.cat([gate.chunk(tp, dim)[rank], up.chunk(tp, dim)[rank]], dim)
    return full.chunk(tp, dim)[rank]


def _gather(name: str, p, grad: torch.Tensor, tp: int, gated: bool) -> torch.Tensor:
    """The full gradient of a parameter from every rank's (inverse of :func:`_split`). A replicated QK norm's
    is summed over tp, as megatron-core's ``finalize_model_grads`` does (``_allreduce_non_tensor_model_parallel_
    grads``: each rank's holds its own heads' part)."""
    dim = _dim(name, p)
    if dim is None and ("q_layernorm" in name or "k_layernorm" in name):
        grad = grad.clone()
        torch.distributed.all_reduce(grad)
    if dim is None:
        return grad
    parts = [torch.empty_like(grad) for _ in range(tp)]
    torch.distributed.all_gather(parts, grad.contiguous())
    if gated and "linear_fc1" in name:
        halves = [t.chunk(2, dim) for t in parts]
        return torch.cat([torch.cat([h[0] for h in halves], dim), torch.cat([h[1] for h in halves], dim)], dim)
    return torch.cat(parts, dim)


def tp_rank(rank: int, port: int, cases: dict, out) -> None:
    """One rank of the tp2 runs of every case ``{name: (flags, data)}``: the full weights sliced, the loss and the
    gathered gradients (rank 0 reports ``{name: {"loss", "grads"}}``)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    from megatron.core import parallel_state

    cpu_stand_ins()
    parallel_state.initialize_model_parallel(2, 1)
    got = {}
    for name, (flags, data) in cases.items():
        model = build(flags).train()
        gated = flags.get("swiglu", False)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(_split(n, p, data["weights"][n].double(), 2, rank, gated))
        r = run(model, data)
        grads = {n: _gather(n, p, r["grads"][n], 2, gated) for n, p in params.items()}
        got[name] = {"loss": r["loss"], "grads": grads}
    if rank == 0:  # as bytes: a queued tensor's shared memory may be gone once this process exits
        buf = io.BytesIO()
        torch.save(got, buf)
        out.put(buf.getvalue())
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def run_tp2(cases: dict, port: int) -> dict:
    """The tp2 runs of ``cases`` on two spawned gloo ranks."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=tp_rank, args=(r, port, cases, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = torch.load(io.BytesIO(q.get(timeout=1200)), weights_only=True)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, p.exitcode
    return got


def main() -> None:
    from megatron.core import parallel_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(20000 + os.getpid() % 20000))
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    cpu_stand_ins()
    parallel_state.initialize_model_parallel(1, 1)
    only = sys.argv[1:]
    out, inputs = {}, {}
    for name, (flags, seed) in CASES.items():
        if only and name not in only:
            continue
        model = build(flags).train()
        data = draw(model, flags, seed)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(data["weights"][n].double())
        rope = getattr(model, "rotary_pos_emb", None)
        out[name] = {"flags": flags, "base": BASE, **data, **run(model, data),
                     "inv_freq": None if rope is None else rope.inv_freq.double()}
        out[name]["weights"] = stored_weights(flags, data["weights"])
        inputs[name] = (flags, data)
    for name, r in run_tp2(inputs, 21000 + os.getpid() % 9000).items():
        out[name]["tp2"] = r
    torch.save(out, os.path.join(HERE, "fixtures.pt") if not only else os.environ["FIXTURES_OUT"])


if __name__ == "__main__":
    main()
