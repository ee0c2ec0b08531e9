"""Writes ``fixtures.pt`` beside this file WITH MEGATRON-LM'S OWN TRAINING STEP: ten iterations of a tiny GPT as a
megatron-core user trains it, whose per-iteration losses, gradient norms, learning rates and final weights
omnitron's loop must reproduce from the same weights and batches (tests/training/test_megatron_train_steps.py).

Needs megatron-core (the Megatron-LM d98e8a6 snapshot was used) on the path; runs on CPU (gloo), offline. Run from
the omnitron root (under a minute; the dp2 run spawns two gloo ranks):

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
[loss sum, tokens] is stored too), ``tp1_fp32`` (float32 model, optimizer and gradient buffer) and ``dp2`` (two
gloo ranks, the global batch split as Megatron's data loader splits it: rank r reads samples
``r * mbs .. r * mbs + mbs`` of each ``dp * mbs`` slice).
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


class _FactoriesOnCpu(TorchFunctionMode):
    """Every torch call's ``device=`` argument pointed at the CPU (megatron-core names "cuda" in its factories)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
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


def model_config(dtype: torch.dtype):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        **MODEL, normalization="LayerNorm", layernorm_epsilon=1e-5, activation_func=F.gelu, add_bias_linear=True,
        bias_activation_fusion=True, params_dtype=dtype, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False)


def build(dtype: torch.dtype = torch.float64):
    """megatron-core's GPT-2-style GPTModel (learned positions, tied embeddings) in ``dtype``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="LayerNorm")
    return GPTModel(model_config(dtype), spec, vocab_size=V, max_sequence_length=S,
                    position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True).to(dtype)


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


def train(case: str, data: dict, dp: int, rank: int) -> dict:
    """Megatron's ten iterations on this rank; per-iteration loss, grad norm, lr and the final weights."""
    from functools import partial

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dtype = dtype_of(case)
    model = build(dtype)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(data["weights"][n])
    cfg = model.config
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", params_dtype=dtype,
                                                       **{k: v for k, v in OPTIM.items()}), [ddp])
    cfg.no_sync_func = ddp.no_sync
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.grad_scale_func = optimizer.scale_loss
    sched = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=OPTIM["lr"], min_lr=OPTIM["min_lr"],
        lr_warmup_steps=SCHEDULE["lr_warmup_iters"] * GBS, lr_decay_steps=SCHEDULE["lr_decay_iters"] * GBS,
        lr_decay_style=SCHEDULE["lr_decay_style"], start_wd=OPTIM["weight_decay"], end_wd=OPTIM["weight_decay"],
        wd_incr_steps=ITERS * GBS, wd_incr_style="constant")
    nmb = GBS // (MBS * dp)
    pos = torch.arange(S)[None].expand(MBS, S)
    causal = torch.triu(torch.ones(S, S), 1).bool()[None, None]

    def forward_step(batches, model):
        tokens, labels, mask = next(batches)
        return model(tokens, pos, causal, labels=labels), partial(pretrain_gpt_loss, mask)

    out = {"loss": [], "grad_norm": [], "lr": [], "microbatch_loss": []}
    for it in range(ITERS):
        rows = [i for i in range(GBS) if (i // MBS) % dp == rank]  # Megatron's sampler: mbs-sized slices per rank
        mbs = [rows[k:k + MBS] for k in range(0, len(rows), MBS)]
        batches = iter([(data["stream"][it, r, :-1], data["stream"][it, r, 1:],
                         torch.stack([loss_mask(case, it, i) for i in r])) for r in mbs])
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        out["lr"].append(optimizer.param_groups[0]["lr"])
        reduced = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=batches, model=[ddp],
                                              num_microbatches=nmb, seq_length=S, micro_batch_size=MBS,
                                              forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        assert ok
        sched.step(increment=GBS)
        out["microbatch_loss"].append(torch.stack([r["lm loss"] for r in reduced]).double())  # [sum, tokens] each
        total = out["microbatch_loss"][-1].sum(0)
        torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group())
        out["loss"].append(float(total[0] / total[1]))
        out["grad_norm"].append(float(grad_norm))
    out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["wd"] = {n: g["wd_mult"] for g in optimizer.param_groups for n, p in model.named_parameters()
                 if any(p is q for q in g["params"])}
    return out


def rank_main(rank: int, world: int, port: int, cases: dict, path: str) -> None:
    """One gloo rank: every case of ``cases`` ({name: data}) trained at dp ``world``; rank 0 saves to ``path``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state

    cpu_stand_ins()
    parallel_state.initialize_model_parallel(1, 1)
    with _FactoriesOnCpu():
        got = {name: train(name, data, world, rank) for name, data in cases.items()}
    if rank == 0:
        torch.save(got, path)
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
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
    cases = {"tp1": 1, "tp1_masked": 1, "tp1_fp32": 1, "dp2": 2}
    out = {"settings": dict(V=V, S=S, MBS=MBS, GBS=GBS, ITERS=ITERS, MODEL=MODEL, OPTIM=OPTIM, SCHEDULE=SCHEDULE),
           **data, "cases": {}}
    for world in sorted(set(cases.values())):
        out["cases"].update(run_ranks(world, {n: data for n, w in cases.items() if w == world}))
    torch.save(out, os.path.join(HERE, "fixtures.pt") if len(sys.argv) < 2 else sys.argv[1])


if __name__ == "__main__":
    main()
