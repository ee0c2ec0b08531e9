"""Writes ``fixtures.pt`` beside this file WITH MEGATRON-LM'S OWN TRAINING STEP: ten iterations of a tiny GPT as a
megatron-core user trains it, whose per-iteration losses, gradient norms, learning rates and final weights
omnitron's loop must reproduce from the same weights and batches (tests/training/test_megatron_train_steps.py).

Needs megatron-core (the Megatron-LM d98e8a6 snapshot was used) on the path; runs on CPU (gloo), offline. Run from
the omnitron root (about a minute; the two-rank runs spawn two gloo ranks):

    PYTHONPATH=/path/to/Megatron-LM python tests/training/megatron_train_steps/make_fixtures.py

omnitron is not imported. The pieces are megatron-core's: ``GPTModel`` (local layer spec, dropout 0),
wrapped in ``megatron.core.distributed.DistributedDataParallel``; ``get_megatron_optimizer`` (Adam, decoupled
weight decay off biases and norms as Megatron groups them, --clip-grad; without Apex or Transformer Engine it is
torch's AdamW); ``OptimizerParamScheduler`` built as ``training.get_optimizer_param_scheduler`` builds it under
--train-iters (steps counted in samples; linear warmup, cosine decay); ``get_forward_backward_func()`` over several
micro-batches with ``pretrain_gpt.py``'s loss function (the masked loss sum and its token count); the model config's
``finalize_model_grads_func`` and ``grad_scale_func`` set as ``training.setup_model_and_optimizer`` sets them; the
iteration as ``training.train_step`` runs it (zero the grad buffers, forward-backward, ``optimizer.step()``,
``scheduler.step(increment=global batch)`` after a successful step). The logged loss is ``train_step``'s: the
micro-batches' loss sums over their token counts (all-reduced over dp).

Float64 (and one float32 case): Adam's first steps move every weight by about +-lr whatever its gradient's size,
so a float32 rounding in a gradient near Adam's eps becomes a change of that weight of a sizeable fraction of lr,
and two float32 runs' final weights part (megatron-core's own float32 and float64 runs here: 1.1e-4 in one element);
in float64 they stay at rounding size. Megatron's loss function casts the per-token losses to float32
(``output_tensor.float()``): its logged loss is float32, and the per-token losses' gradient, 1 / tokens /
micro-batches, is computed in float32 (a power of two, exact, for a micro-batch of 32 tokens; rounded once or
twice, <= 2 u relative, for the masked case's 24). The clipping's gradient norm is
float32 too (megatron-core's local multi-tensor L2 norm, without Apex).

The weights are seeded random values (float32-representable, so the stored float32 copies are exact), the token
stream is seeded random ids ``[iterations, global batch, seq + 1]`` (tokens = ``[:, :, :-1]``, labels ``[:, :, 1:]``),
the loss mask is all ones except where a case masks one micro-batch's tokens. Cases: ``tp1`` (one rank),
``tp1_masked`` (half of sample 1 masked: micro-batches of 24 and 32 loss tokens; each micro-batch's reported
[loss sum, tokens] is stored too), ``tp1_fp32`` (float32 model, optimizer and gradient buffer) and, on two gloo
ranks, ``dp2`` (the global batch split as Megatron's data loader splits it: rank r reads samples
``r * mbs .. r * mbs + mbs`` of each ``dp * mbs`` slice), ``tp2`` (each rank its ``partition_dim`` slice of the
weights; the final weights gathered) and ``pp2`` (one layer a stage, the last stage's output weight the tied copy
of the word embedding, megatron-core's 1F1B schedule with gloo's point-to-point). Final weights are stored by
their one-rank names. ``dp2_distopt_fp32``: megatron-core's distributed optimizer (--use-distributed-optimizer;
float32, as it refuses float64 parameters: it hands them float32 gradients). On four ranks: ``tp2_pp2``,
``dp2_tp2_sp`` (--sequence-parallel) and ``dp2_pp2``. On two: ``pp2_vpp2`` (4 layers, two virtual stages a rank,
megatron-core's interleaved schedule with its CLI's default --overlap-p2p-comm), ``pp2_untied``
(--untie-embeddings-and-output-weights: the last stage's output layer its own weight),
``dp2_overlap_distopt_fp32`` (--overlap-grad-reduce --overlap-param-gather with the distributed optimizer, the
model config's grad-sync hook as ``training.train`` sets it; the last step's parameter all-gather forced before the
weights are read) and ``dp2_moe_ep2`` (4 experts, top 2, --moe-aux-loss-coeff 0.01, the alltoall dispatcher, ep2;
--no-bias-gelu-fusion, as megatron-core's expert MLP fuses no bias-GeLU with the routing weights). On one:
``tp1_fp16`` (--fp16 in megatron's Float16Module, dynamic loss scaling from 2**16 with --loss-scale-window 2 and
--hysteresis 1: the scale doubles every two good steps until a step overflows, which is skipped and halves it; the
scheduler steps after good steps only, as ``train_step``; the scale used in each iteration is stored) and
``tp1_bf16`` (--bf16 in Float16Module, gradients accumulated and reduced in float32 as Megatron's --bf16 sets
--accumulate-allreduce-grads-in-fp32; it runs on CPU with torch 2.13). Also ``dp2_distopt_fp16`` (fp16 with the
distributed optimizer: two overflows), ``dp2_pp2_vpp2_overlap_distopt_fp32`` (four ranks; the interleaved schedule's
param-sync hook as ``training.train`` sets it under --align-param-gather), ``dp4_moe_ep2_overlap_distopt_fp32``
(four ranks: the experts' gradients reduced over their data-parallel pair, overlapped) and ``dp2_tp2_sp_moe_ep2`` (four
ranks,
--expert-tensor-parallel-size 1 as megatron-core's experts need for biases; its run is wrong, see MEGATRON_BUG:
losses and norms only). A case whose
model differs (4 layers, untied, MoE) draws its own weights from the same seed (``case_weights``). Only what the test
reads is stored: final weights of float64 cases, the masked case's micro-batch reports, fp16's loss scales.

CPU stand-ins beside the CUDA ones (the generator's only; megatron-core's code runs unchanged): Apex's layer-norm
function as ``F.layer_norm`` (megatron-core's torch norm refuses --sequence-parallel; its ``FusedLayerNorm``, which
marks the norms' parameters ``sequence_parallel``, calls Apex), used only by the sequence-parallel case's spec; and
the MoE alltoall dispatcher's split sizes handed to gloo's ``all_to_all_single`` as lists (on a GPU they reach the
host as numpy arrays; ``moe_utils.maybe_move_tensor_to_cpu`` leaves a CPU tensor a tensor, which the binding
refuses). ``CASES=tp1,pp2`` in the environment runs only those (writing the given path, argv[1]).
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import typing

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

if not hasattr(typing, "override"):  # Megatron imports typing.override (Python >= 3.12)
    typing.override = lambda f: f

HERE = os.path.dirname(os.path.abspath(__file__))
V, S, MBS, GBS, ITERS = 64, 16, 2, 8, 10
MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64)
OPTIM = dict(lr=3e-3, min_lr=3e-4, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=0.5)
SCHEDULE = dict(lr_warmup_iters=3, lr_decay_iters=10, lr_decay_style="cosine")
SEED = 1234
CASES = {"tp1": (1, 1, 1), "tp1_masked": (1, 1, 1), "tp1_fp32": (1, 1, 1), "dp2": (1, 1, 2), "tp2": (2, 1, 1),
         "pp2": (1, 2, 1), "dp2_distopt_fp32": (1, 1, 2), "tp2_pp2": (2, 2, 1), "dp2_tp2_sp": (2, 1, 2),
         "dp2_pp2": (1, 2, 2), "pp2_vpp2": (1, 2, 1), "pp2_untied": (1, 2, 1), "dp2_overlap_distopt_fp32": (1, 1, 2),
         "dp2_moe_ep2": (1, 1, 2), "tp1_fp16": (1, 1, 1), "tp1_bf16": (1, 1, 1), "dp2_distopt_fp16": (1, 1, 2),
         "dp2_tp2_sp_moe_ep2": (2, 1, 2), "dp2_pp2_vpp2_overlap_distopt_fp32": (1, 2, 2),
         "dp4_moe_ep2_overlap_distopt_fp32": (1, 1, 4)}
"""name -> (tp, pp, dp) of megatron-core's run"""
OPTIONS = {"dp2_tp2_sp": dict(sp=True), "pp2_vpp2": dict(layers=4, vpp=2), "pp2_untied": dict(untie=True),
           "dp2_overlap_distopt_fp32": dict(overlap=True), "dp2_moe_ep2": dict(moe=True, ep=2),
           "dp2_tp2_sp_moe_ep2": dict(sp=True, moe=True, ep=2),
           "dp2_pp2_vpp2_overlap_distopt_fp32": dict(layers=4, vpp=2, overlap=True),
           "dp4_moe_ep2_overlap_distopt_fp32": dict(moe=True, ep=2, overlap=True)}
"""name -> what the case changes: sp (--sequence-parallel), layers (--num-layers), vpp (virtual stages a rank),
untie (--untie-embeddings-and-output-weights), overlap (--overlap-grad-reduce --overlap-param-gather), moe (4
experts, top 2, aux loss, the alltoall dispatcher) with ep (--expert-model-parallel-size); the dtype is the name's
suffix (dtype_of)"""
MEGATRON_BUG = {"dp2_tp2_sp_moe_ep2"}
"""cases whose megatron-core run is wrong, stored to show it (the test compares omnitron with another layout):
under --sequence-parallel megatron-core's RowParallelLinear marks its bias ``sequence_parallel`` whether or not it
is an expert's (tensor_parallel/layers.py), and finalize_model_grads sums such gradients over the tensor-parallel
group, so at --expert-tensor-parallel-size 1 each expert's fc2 bias gradient is added to those of the experts on
the other tp ranks (here the ep peers: experts 0 and 2, 1 and 3 end with one summed gradient)"""
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_router_load_balancing_type="aux_loss",
           moe_token_dispatcher_type="alltoall")
FP16 = dict(initial_loss_scale=2.0 ** 16, min_loss_scale=1.0, loss_scale_window=2, hysteresis=1)
"""fp16's dynamic loss scaler: a short window so ten iterations see it grow as well as back off"""


def variant(case: str) -> tuple:
    """The model's shape options (its weights are drawn per variant): (layers, untie, moe)."""
    o = OPTIONS.get(case, {})
    return (o.get("layers", MODEL["num_layers"]), bool(o.get("untie")), bool(o.get("moe")))


class _FactoriesOnCpu(TorchFunctionMode):
    """Every torch call's ``device=`` argument pointed at the CPU (megatron-core names "cuda" in its factories),
    ``Tensor.cuda()`` the tensor itself."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:  # the last stage's tied output weight is moved to the GPU
            return args[0]
        if kwargs and "device" in kwargs:
            kwargs = dict(kwargs, device="cpu")
        return func(*args, **(kwargs or {}))


class _Stream:
    """A CUDA stream stand-in: the CPU runs in order, so waiting is a no-op."""

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self) -> "_Stream":  # the MoE dispatcher's device-to-host event: already done
        return self


_STREAM = _Stream()
"""the one stream: the MoE dispatcher compares its side stream with the current one"""


class _ApexLayerNormAffine:
    """A stand-in for Apex's ``FusedLayerNormAffineFunction`` (Apex is absent): the plain layer norm, with torch's
    autograd. Only ``--sequence-parallel`` needs it: megatron-core's torch norm refuses sequence parallelism, its
    ``FusedLayerNorm`` (which marks the norm's parameters ``sequence_parallel`` so their gradients are summed over
    tp) calls this function."""

    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps):  # the signature FusedLayerNorm inspects
        raise NotImplementedError

    @staticmethod
    def apply(input, weight, bias, normalized_shape, eps):
        return F.layer_norm(input, normalized_shape, weight, bias, eps)


def cpu_stand_ins() -> None:
    """The CUDA calls megatron-core makes on this path: the current device and stream, the RNG tracker (no
    dropout), and the clipping's (and fp16's optimizer's) check that each tensor is a CUDA one (these are CPU)."""
    from megatron.core import tensor_parallel

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda *a, **k: _STREAM
    torch.cuda.Stream = lambda *a, **k: _STREAM
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a, **k: None
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    from megatron.core.fusions import fused_layer_norm

    all_to_all_single = torch.distributed.all_to_all_single

    def host_splits(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        """The MoE alltoall dispatcher's split sizes as lists: on a GPU they come to the host as numpy arrays, a
        CPU tensor stays a tensor (moe_utils.maybe_move_tensor_to_cpu), which gloo's binding refuses."""
        as_list = (lambda s: s.tolist() if torch.is_tensor(s) else s)
        return all_to_all_single(output, input, as_list(output_split_sizes), as_list(input_split_sizes), *args,
                                 **kwargs)

    torch.distributed.all_to_all_single = host_splits

    fused_layer_norm.HAVE_FUSED_LAYER_NORM = True
    fused_layer_norm.FusedLayerNormAffineFunction = _ApexLayerNormAffine
    tensor_type = torch.Tensor.type

    cuda_names = {torch.float32: "torch.cuda.FloatTensor", torch.float64: "torch.cuda.FloatTensor",
                  torch.float16: "torch.cuda.HalfTensor", torch.bfloat16: "torch.cuda.BFloat16Tensor"}

    def cuda_float_type(self, *args, **kwargs):  # the clip (and fp16's optimizer) assert CUDA tensor type names
        if not args and not kwargs and self.dtype in cuda_names:
            return cuda_names[self.dtype]
        return tensor_type(self, *args, **kwargs)

    torch.Tensor.type = cuda_float_type


def dtype_of(case: str) -> torch.dtype:
    """The model's parameter dtype: the case name's suffix (fp32, fp16, bf16), else float64."""
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}.get(case.rsplit("_", 1)[-1],
                                                                                      torch.float64)


def model_config(case: str, dtype: torch.dtype, tp: int = 1, pp: int = 1, ep: int = 1, vpp=None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    o, (layers, _, moe) = OPTIONS.get(case, {}), variant(case)
    # --no-bias-gelu-fusion with experts: megatron-core's expert MLP fuses only swiglu / quick-gelu with the probs
    # and --expert-tensor-parallel-size 1: megatron-core's experts take biases only at etp 1
    extra = dict(MOE, expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
                 bias_activation_fusion=False) if moe else {}
    if vpp:  # Megatron's CLI default --overlap-p2p-comm under the interleaved schedule (no batched p2p)
        extra.update(virtual_pipeline_model_parallel_size=vpp, overlap_p2p_comm=True, batch_p2p_comm=False)
    return TransformerConfig(
        **dict(MODEL, num_layers=layers), normalization="LayerNorm", layernorm_epsilon=1e-5, activation_func=F.gelu,
        add_bias_linear=True, **{"bias_activation_fusion": True, **extra}, params_dtype=dtype,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        bias_dropout_fusion=False, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=dtype,
        sequence_parallel=bool(o.get("sp")) and tp > 1, fp16=dtype == torch.float16, bf16=dtype == torch.bfloat16)


def build(case: str, tp: int = 1, pp: int = 1, ep: int = 1, vpp=None) -> list:
    """megatron-core's GPT-2-style GPTModel (learned positions, tied embeddings unless the case unties them) in
    the case's dtype: this rank's stage (its ``vpp`` chunks) and tensor-parallel slice; fp16 inside megatron's
    Float16Module, as ``training.get_model`` wraps it."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    dtype, (_, untie, moe) = dtype_of(case), variant(case)
    cfg = model_config(case, dtype, tp, pp, ep, vpp)
    spec = get_gpt_layer_local_spec(num_experts=MOE["num_moe_experts"] if moe else None, normalization="LayerNorm")
    if cfg.sequence_parallel:  # Apex's layer norm (as Megatron's local spec picks it with Apex), in every norm
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = FusedLayerNorm
        spec = TransformerBlockSubmodules(layer_specs=[spec] * (cfg.num_layers // pp), layer_norm=FusedLayerNorm)
    chunks = []
    for v in range(vpp or 1):
        at = dict(ignore_virtual=False, vp_stage=v) if vpp else {}
        m = GPTModel(cfg, spec, vocab_size=V, max_sequence_length=S, position_embedding_type="learned_absolute",
                     share_embeddings_and_output_weights=not untie, pre_process=ps.is_pipeline_first_stage(**at),
                     post_process=ps.is_pipeline_last_stage(**at), vp_stage=v if vpp else None).to(dtype)
        chunks.append(Float16Module(cfg, m) if dtype in (torch.float16, torch.bfloat16) else m)
    return chunks


def global_names(model) -> dict:
    """{this chunk's parameter name: its name in the one-stage, one-expert-rank model} (a chunk's layers count
    from 0 locally; a rank's experts likewise; the last stage's copy of the tied embedding is the word embedding;
    Float16Module's ``module.`` prefix dropped)."""
    from megatron.core import parallel_state as ps

    gpt = getattr(model, "module", model)
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    out = {}
    for n, _ in model.named_parameters():
        n_local = n[len("module."):] if gpt is not model else n
        if n_local.startswith("decoder.layers."):
            i, rest = n_local[len("decoder.layers."):].split(".", 1)
            if rest.startswith("mlp.experts.local_experts."):
                j, tail = rest[len("mlp.experts.local_experts."):].split(".", 1)
                rest = f"mlp.experts.local_experts.{int(j) + ep_rank * MOE['num_moe_experts'] // ep}.{tail}"
            n_global = f"decoder.layers.{gpt.decoder.layers[int(i)].layer_number - 1}.{rest}"
        elif n_local == "output_layer.weight" and gpt.share_embeddings_and_output_weights:
            n_global = "embedding.word_embeddings.weight"
        else:
            n_global = n_local
        out[n] = n_global
    return out


def tp_of(p) -> tuple:
    """(size, rank, group) of the tensor-parallel group splitting ``p``: the expert one for an expert's weight
    (megatron marks those ``allreduce=False``)."""
    from megatron.core import parallel_state as ps

    if getattr(p, "allreduce", True):
        return (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
                ps.get_tensor_model_parallel_group())
    return (ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_tensor_parallel_group())


def load_slice(model, weights: dict) -> None:
    """Copy this rank's slice (``partition_dim`` over its tp group) of every full weight into the chunk."""
    names = global_names(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            full = weights[names[n]]
            if getattr(p, "tensor_model_parallel", False):
                tp, r, _ = tp_of(p)
                full = full.chunk(tp, p.partition_dim)[r]
            p.copy_(full)


def full_weights(chunks: list) -> dict:
    """Every rank's chunks' parameters, gathered over tp, merged over pp and ep: {one-stage name: full tensor}."""
    mine = {}
    for model in chunks:
        params = dict(model.named_parameters())
        for n, g in global_names(model).items():
            p = t = params[n].detach()
            tp, _, group = tp_of(params[n])
            if getattr(params[n], "tensor_model_parallel", False) and tp > 1:
                parts = [torch.empty_like(p) for _ in range(tp)]
                torch.distributed.all_gather(parts, p.contiguous(), group=group)
                t = torch.cat(parts, params[n].partition_dim)
            if not (n.endswith("output_layer.weight") and g == "embedding.word_embeddings.weight"):  # tied copy
                mine[g] = t.clone().double()
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    return {k: v for d in every for k, v in d.items()}


def draw(model, stream: bool = True) -> dict:
    """Seeded weights (float32 values; norms near 1) and (``stream``) the token stream."""
    g = torch.Generator().manual_seed(SEED)
    weights = {}
    for name, p in model.named_parameters():
        centre = 1.0 if name.endswith("norm.weight") else 0.0
        weights[name] = (centre + 0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64)).float()
    if not stream:
        return {"weights": weights}
    return {"weights": weights, "stream": torch.randint(0, V, (ITERS, GBS, S + 1), generator=g)}


def loss_mask(case: str, it: int, sample: int) -> torch.Tensor:
    """All ones; the ``masked`` case zeroes the second half of sample 1 of every iteration (an uneven micro-batch)."""
    m = torch.ones(S)
    if case.endswith("masked") and sample == 1:
        m[S // 2:] = 0
    return m


def pretrain_gpt_loss(mask: torch.Tensor, output_tensor: torch.Tensor):
    """``pretrain_gpt.py``'s ``loss_func`` (no logits-distillation, no ModelOpt, no NaN check)."""
    losses = output_tensor.view(-1).float()
    mask = mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def wrap(case: str, chunks: list):
    """megatron's DDP around each chunk (bucketing off past the first, as ``training.get_model``), the optimizer
    and the model config's hooks as ``training.setup_model_and_optimizer`` and ``train`` set them."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    o, dtype = OPTIONS.get(case, {}), dtype_of(case)
    distopt, overlap = "distopt" in case, bool(o.get("overlap"))
    fp16, bf16 = dtype == torch.float16, dtype == torch.bfloat16
    cfg = chunks[0].config
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=distopt, overlap_grad_reduce=overlap,
                                            overlap_param_gather=overlap, grad_reduce_in_fp32=bf16)
    ddps = [DistributedDataParallel(cfg, ddp_cfg, m, disable_bucketing=i > 0) for i, m in enumerate(chunks)]
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", params_dtype=dtype, use_distributed_optimizer=distopt, fp16=fp16, bf16=bf16,
        **(FP16 if fp16 else {}), **OPTIM), ddps)
    one = (lambda fs: fs[0] if len(fs) == 1 else fs)
    cfg.no_sync_func = one([d.no_sync for d in ddps])
    if overlap:  # --align-grad-reduce (default); --align-param-gather: on (default) with the interleaved schedule
        cfg.grad_sync_func = one([d.start_grad_sync for d in ddps])
        if len(ddps) > 1:
            cfg.param_sync_func = [d.start_param_sync for d in ddps]
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.grad_scale_func = optimizer.scale_loss
    return ddps, optimizer


def train(case: str, data: dict, layout: tuple) -> dict:
    """Megatron's ten iterations on this rank at ``layout`` (tp, pp, dp); per-iteration loss, grad norm, lr (and
    fp16's loss scale) and the final full weights."""
    from functools import partial

    from megatron.core import parallel_state as ps
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tp, pp, dp = layout
    o = OPTIONS.get(case, {})
    chunks = build(case, tp, pp, o.get("ep", 1), o.get("vpp"))
    weights = data["case_weights"].get(case, data["weights"])
    for m in chunks:
        load_slice(m, weights)
    ddps, optimizer = wrap(case, chunks)
    sched = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=OPTIM["lr"], min_lr=OPTIM["min_lr"],
        lr_warmup_steps=SCHEDULE["lr_warmup_iters"] * GBS, lr_decay_steps=SCHEDULE["lr_decay_iters"] * GBS,
        lr_decay_style=SCHEDULE["lr_decay_style"], start_wd=OPTIM["weight_decay"], end_wd=OPTIM["weight_decay"],
        wd_incr_steps=ITERS * GBS, wd_incr_style="constant")
    pos = torch.arange(S)[None].expand(MBS, S)
    causal = torch.triu(torch.ones(S, S), 1).bool()[None, None]

    def forward_step(batches, model):
        tokens, labels, mask = next(batches)
        return model(tokens, pos, causal, labels=labels), partial(pretrain_gpt_loss, mask)

    out = {"loss": [], "grad_norm": [], "lr": [], "microbatch_loss": [], "loss_scale": []}
    dp_rank = ps.get_data_parallel_rank()
    for it in range(ITERS):
        rows = [i for i in range(GBS) if (i // MBS) % dp == dp_rank]  # Megatron's sampler: mbs-sized slices
        mbs = [rows[k:k + MBS] for k in range(0, len(rows), MBS)]
        batch = [(data["stream"][it, r, :-1], data["stream"][it, r, 1:],
                  torch.stack([loss_mask(case, it, i) for i in r])) for r in mbs]
        for d in ddps:
            d.zero_grad_buffer()
        optimizer.zero_grad()
        out["lr"].append(optimizer.param_groups[0]["lr"])
        out["loss_scale"].append(float(optimizer.get_loss_scale()))
        its = [iter(batch) for _ in ddps]  # every chunk reads the same micro-batches
        reduced = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=its if len(its) > 1 else its[0], model=ddps,
            num_microbatches=len(mbs), seq_length=S, micro_batch_size=MBS, forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        if ok:  # train_step: the scheduler steps after a successful update only
            sched.step(increment=GBS)
        # [sum, tokens] of each micro-batch, on the last stage (train_step's report; other stages add zeros)
        mine = (torch.stack([r["lm loss"] for r in reduced]).double() if reduced
                else torch.zeros(len(mbs), 2, dtype=torch.float64))
        out["microbatch_loss"].append(mine)
        total = mine.sum(0)
        torch.distributed.all_reduce(total)  # every dp rank's last stage, tp times: the ratio is train_step's
        out["loss"].append(float(total[0] / total[1]))
        out["grad_norm"].append(float(grad_norm) if ok else float("nan"))
    if o.get("overlap"):  # --overlap-param-gather leaves the last step's all-gather to the next forward
        for d in ddps:
            d.start_param_sync(force_sync=True)
    out["weights"] = full_weights(chunks)
    if dtype_of(case) != torch.float64 or case in MEGATRON_BUG:  # the test compares float64 cases' weights only
        del out["weights"]
    if "fp16" not in case:
        del out["loss_scale"]
    if "masked" not in case:
        del out["microbatch_loss"]
    return out


def rank_main(rank: int, world: int, port: int, cases: dict, path: str) -> None:
    """One gloo rank: every case of ``cases`` ({name: (data, (tp, pp, dp))}); rank 0 saves to ``path``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state

    cpu_stand_ins()
    got = {}
    for name, (data, (tp, pp, dp)) in cases.items():
        o = OPTIONS.get(name, {})
        parallel_state.initialize_model_parallel(tp, pp, o.get("vpp"), expert_model_parallel_size=o.get("ep", 1),
                                                 expert_tensor_parallel_size=1 if o.get("moe") else None)
        with _FactoriesOnCpu():
            got[name] = train(name, data, (tp, pp, dp))
        parallel_state.destroy_model_parallel()
    if rank == 0:
        torch.save(got, path)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def run_ranks(world: int, cases: dict) -> dict:
    """``cases`` trained on ``world`` spawned gloo ranks (rank 0's results)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "out.pt")
        mp.spawn(rank_main, args=(world, 21000 + os.getpid() % 9000 + world, cases, path), nprocs=world)
        return torch.load(path, weights_only=True)


def main() -> None:
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    from megatron.core import parallel_state

    cpu_stand_ins()
    parallel_state.initialize_model_parallel(1, 1)
    with _FactoriesOnCpu():
        data = draw(build("tp1")[0])
        data["case_weights"] = {c: draw(build(c)[0], stream=False)["weights"] for c in CASES
                                if variant(c) != variant("tp1")}  # one rank, one expert rank, no vpp
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    out = {"settings": dict(V=V, S=S, MBS=MBS, GBS=GBS, ITERS=ITERS, MODEL=MODEL, OPTIM=OPTIM, SCHEDULE=SCHEDULE),
           **data, "cases": {}}
    only = os.environ.get("CASES", "").split(",") if os.environ.get("CASES") else list(CASES)
    for world in (1, 2, 4):
        todo = {n: (data, lay) for n, lay in CASES.items() if n in only and lay[0] * lay[1] * lay[2] == world}
        if todo:
            out["cases"].update(run_ranks(world, todo))
    torch.save(out, os.path.join(HERE, "fixtures.pt") if len(sys.argv) < 2 else sys.argv[1])


if __name__ == "__main__":
    main()
