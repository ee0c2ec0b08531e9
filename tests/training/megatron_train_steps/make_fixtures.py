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
float32, as it refuses float64 parameters: it hands them float32 gradients). ``CASES=tp1,pp2`` in the
environment runs only those (writing the given path, argv[1]).
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
         "pp2": (1, 2, 1), "dp2_distopt_fp32": (1, 1, 2)}
"""name -> (tp, pp, dp) of megatron-core's run"""


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


def cpu_stand_ins() -> None:
    """The CUDA calls megatron-core makes on this path: the current device and stream, the RNG tracker (no
    dropout), and the clipping's check that each gradient is a CUDA float tensor (these are CPU float64)."""
    from megatron.core import tensor_parallel

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda *a, **k: _Stream()
    torch.cuda.Stream = lambda *a, **k: _Stream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a, **k: None
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    tensor_type = torch.Tensor.type

    def cuda_float_type(self, *args, **kwargs):  # clip_grad_by_total_norm_fp32 asserts 'torch.cuda.FloatTensor'
        if not args and not kwargs and self.dtype in (torch.float32, torch.float64):
            return "torch.cuda.FloatTensor"
        return tensor_type(self, *args, **kwargs)

    torch.Tensor.type = cuda_float_type


def dtype_of(case: str) -> torch.dtype:
    return torch.float32 if case.endswith("fp32") else torch.float64


def model_config(dtype: torch.dtype, tp: int = 1, pp: int = 1):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        **MODEL, normalization="LayerNorm", layernorm_epsilon=1e-5, activation_func=F.gelu, add_bias_linear=True,
        bias_activation_fusion=True, params_dtype=dtype, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, pipeline_dtype=dtype)


def build(dtype: torch.dtype = torch.float64, tp: int = 1, pp: int = 1):
    """megatron-core's GPT-2-style GPTModel (learned positions, tied embeddings) in ``dtype``: this rank's stage
    and tensor-parallel slice."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="LayerNorm")
    return GPTModel(model_config(dtype, tp, pp), spec, vocab_size=V, max_sequence_length=S,
                    position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True,
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage()).to(dtype)


def global_names(model) -> dict:
    """{this stage's parameter name: its name in the one-stage model} (a stage's layers count from 0 locally;
    the last stage's copy of the tied embedding is the word embedding)."""
    out = {}
    for n, _ in model.named_parameters():
        if n.startswith("decoder.layers."):
            i, rest = n[len("decoder.layers."):].split(".", 1)
            n_global = f"decoder.layers.{model.decoder.layers[int(i)].layer_number - 1}.{rest}"
        else:
            n_global = "embedding.word_embeddings.weight" if n == "output_layer.weight" else n
        out[n] = n_global
    return out


def load_slice(model, weights: dict) -> None:
    """Copy this rank's slice (``partition_dim`` over tp) of every full weight into the stage's parameters."""
    from megatron.core import parallel_state as ps

    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    names = global_names(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            full = weights[names[n]]
            if getattr(p, "tensor_model_parallel", False):
                full = full.chunk(tp, p.partition_dim)[r]
            p.copy_(full)


def full_weights(model) -> dict:
    """Every rank's stage parameters, gathered over tp, merged over pp: {one-stage name: full tensor}."""
    from megatron.core import parallel_state as ps

    tp, mine, params = ps.get_tensor_model_parallel_world_size(), {}, dict(model.named_parameters())
    for n, g in global_names(model).items():
        p = t = params[n].detach()
        if getattr(params[n], "tensor_model_parallel", False):
            parts = [torch.empty_like(p) for _ in range(tp)]
            torch.distributed.all_gather(parts, p.contiguous(), group=ps.get_tensor_model_parallel_group())
            t = torch.cat(parts, params[n].partition_dim)
        if n != "output_layer.weight":  # the tied copy, updated alike
            mine[g] = t.clone()
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    return {k: v for d in every for k, v in d.items()}


def draw(model) -> dict:
    """Seeded weights (float32 values; norms near 1) and the token stream."""
    g = torch.Generator().manual_seed(SEED)
    weights = {}
    for name, p in model.named_parameters():
        centre = 1.0 if name.endswith("norm.weight") else 0.0
        weights[name] = (centre + 0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64)).float()
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


def train(case: str, data: dict, layout: tuple) -> dict:
    """Megatron's ten iterations on this rank at ``layout`` (tp, pp, dp); per-iteration loss, grad norm, lr and
    the final full weights."""
    from functools import partial

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tp, pp, dp = layout
    dtype, distopt = dtype_of(case), "distopt" in case
    model = build(dtype, tp, pp)
    load_slice(model, data["weights"])
    cfg = model.config
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=distopt), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", params_dtype=dtype,
                                                       use_distributed_optimizer=distopt, **OPTIM), [ddp])
    cfg.no_sync_func = ddp.no_sync
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.grad_scale_func = optimizer.scale_loss
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

    out = {"loss": [], "grad_norm": [], "lr": [], "microbatch_loss": []}
    dp_rank = ps.get_data_parallel_rank()
    for it in range(ITERS):
        rows = [i for i in range(GBS) if (i // MBS) % dp == dp_rank]  # Megatron's sampler: mbs-sized slices
        mbs = [rows[k:k + MBS] for k in range(0, len(rows), MBS)]
        batches = iter([(data["stream"][it, r, :-1], data["stream"][it, r, 1:],
                         torch.stack([loss_mask(case, it, i) for i in r])) for r in mbs])
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        out["lr"].append(optimizer.param_groups[0]["lr"])
        reduced = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=batches, model=[ddp],
                                              num_microbatches=len(mbs), seq_length=S, micro_batch_size=MBS,
                                              forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        assert ok
        sched.step(increment=GBS)
        # [sum, tokens] of each micro-batch, on the last stage (train_step's report; other stages add zeros)
        mine = (torch.stack([r["lm loss"] for r in reduced]).double() if reduced
                else torch.zeros(len(mbs), 2, dtype=torch.float64))
        out["microbatch_loss"].append(mine)
        total = mine.sum(0)
        torch.distributed.all_reduce(total)  # every dp rank's last stage, tp times: the ratio is train_step's
        out["loss"].append(float(total[0] / total[1]))
        out["grad_norm"].append(float(grad_norm))
    out["weights"] = full_weights(model)
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
        parallel_state.initialize_model_parallel(tp, pp)
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
        data = draw(build())
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()
    out = {"settings": dict(V=V, S=S, MBS=MBS, GBS=GBS, ITERS=ITERS, MODEL=MODEL, OPTIM=OPTIM, SCHEDULE=SCHEDULE),
           **data, "cases": {}}
    only = os.environ.get("CASES", "").split(",") if os.environ.get("CASES") else list(CASES)
    for world in (1, 2):
        todo = {n: (data, lay) for n, lay in CASES.items() if n in only and lay[0] * lay[1] * lay[2] == world}
        if todo:
            out["cases"].update(run_ranks(world, todo))
    torch.save(out, os.path.join(HERE, "fixtures.pt") if len(sys.argv) < 2 else sys.argv[1])


if __name__ == "__main__":
    main()
