"""A float64 model trains float64 end to end: six Adam steps (weight decay, --clip-grad, warmup + cosine schedule)
through omnitron's own components and ``train_step`` at one rank and at dp2, dp2 with the distributed optimizer,
dp2 under FSDP2, tp2 and pp2, and a float64 checkpoint's resume (torch_dist and torch), against a plain-torch
float64 loop written here (torch.optim.AdamW, torch.nn.utils.clip_grad_norm_, the schedule's formula) on omnitron's
one-process model with the reference kernels.

Bound (TOL). u = 2**-53 = 1.1e-16. Both sides compute every value in float64; they differ only in the order of
sums: tp splits inner products of <= 64 terms, dp / micro-batch gradient sums of <= 8 terms, the norm's sum of
squares (~2e4 terms, in another order and tree), and the two AdamW formulas (sqrt(v / bc2) + eps against sqrt(v) /
sqrt(bc2) + eps, a few roundings). Summing n terms in another order moves the result by <= n u times the sum of the
magnitudes, so a gradient, loss or norm errs by <= 64 x 8 u ~ 6e-14 relative to its terms' magnitudes (their
typical error is sqrt(n) u ~ 3e-15). Adam's update lr m^ / (sqrt(v^) + eps) has relative sensitivity ~1 to a
relative gradient error where |g| >> eps, and the clip factor clip / (norm + 1e-6) carries the norm's; so each step
moves a weight by lr x (a few 1e-15 relative) and six steps at lr <= 3e-3 on weights ~0.02 (lr / |w| ~ 0.15 a step)
add ~6 x 0.15 x 1e-14 relative; the losses and gradients of later steps take the weights' error at gain ~1 (a few
weight errors' size). An element whose gradient is ~eps (1e-8) would amplify an absolute gradient error (~1e-18
there) by lr / eps = 3e5 into ~3e-13 absolute, below 1e-11 relative to one element and far below it norm-wise
over a tensor. Linear layers have no biases (--disable-bias-linear): the key projection's bias has an exact
gradient of 0 (a constant added to every key shifts each query's logits alike, which softmax ignores), so its
float64 gradient is pure rounding noise (~1e-18), which Adam normalises into steps of up to lr x noise / eps
(~1e-15 a step, a different noise in each layout): that tensor's two runs would part by noise, not by the parallel
maths (1.7e-13 norm-wise over the qkv bias when it was there). TOL = 1e-12 (DESIGN's float64 promise) leaves a
factor ~5 over the worst-case order estimates above (~100 over the sqrt(n) u typical ones). What it catches:
the float32 masters this test was written against (each step rounds every weight to float32: ~3e-8 relative), a
float32 gradient norm or clip factor (a 2**-24 relative error in every update: ~6e-8 x lr / |w|, 1e-8), float32
moments (~1e-8) -- all >= 1e4 x TOL.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from omnitron.testing.distributed import REFERENCE_KERNELS, run_distributed
from omnitron.testing.parity import reference_kernels

TOL = 1e-12  # the module docstring's bound
ITERS, MBS, GBS, S, V = 6, 2, 8, 16, 64
LR, MIN_LR, WARMUP, WD, CLIP, BETAS, EPS = 3e-3, 3e-4, 2, 0.1, 0.5, (0.9, 0.95), 1e-8
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
         "--seq-length", str(S), "--max-position-embeddings", str(S), "--mock-data", "--tokenizer-type",
         "NullTokenizer", "--vocab-size", str(V - 1), "--make-vocab-size-divisible-by", "1", "--num-workers", "0",
         "--no-tensorboard", "--seed", "3", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--disable-bias-linear",
         "--train-iters", str(ITERS), "--micro-batch-size", str(MBS), "--global-batch-size", str(GBS),
         "--lr", str(LR), "--min-lr", str(MIN_LR), "--lr-warmup-iters", str(WARMUP), "--lr-decay-iters", str(ITERS),
         "--lr-decay-style", "cosine", "--weight-decay", str(WD), "--adam-beta1", str(BETAS[0]),
         "--adam-beta2", str(BETAS[1]), "--adam-eps", str(EPS), "--clip-grad", str(CLIP)]


def stream() -> torch.Tensor:
    """Every iteration's global batch of token ids, ``[ITERS, GBS, S + 1]`` (fresh random tokens)."""
    return torch.randint(0, V, (ITERS, GBS, S + 1), generator=torch.Generator().manual_seed(20261207))


def components(extra: list[str], world: int, dtype: torch.dtype = torch.float64):
    """omnitron's components (float64 unless ``dtype``) for ``FLAGS + extra`` at ``world`` ranks."""
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.components import build_components

    s = parse_settings([*FLAGS, *extra], world)
    s = dataclasses.replace(s, model=dataclasses.replace(s.model, params_dtype=dtype))
    return build_components(s, get_backend())


def micro_batches(tokens: torch.Tensor, dp: int, dp_rank: int, device):
    """One iteration's micro-batches of one data-parallel rank (rank r reads samples r mbs .. (r + 1) mbs of each
    dp mbs, as Megatron's sampler)."""
    rows = [i for i in range(GBS) if (i // MBS) % dp == dp_rank]
    for k in range(0, len(rows), MBS):
        t = tokens[rows[k:k + MBS]].to(device)
        yield {"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": torch.ones(len(t), S, device=device),
               "position_ids": torch.arange(S, device=device)[None].expand(len(t), S)}


def train(c, start: int, stop: int, weights: dict | None) -> dict:
    """Iterations ``start`` .. ``stop`` of ``c`` (from ``weights``, the full state, when given): per-iteration loss,
    grad norm, lr, and the final full weights (merged over the pipeline stages)."""
    import torch.distributed as dist

    from omnitron.core.training.step import train_step

    if weights is not None:
        set_weights(c, weights)
    dp, data, out = c.groups.dp.size, stream(), {"loss": [], "grad_norm": [], "lr": []}
    for it in range(start, stop):
        got = train_step(c, micro_batches(data[it], dp, c.groups.dp.rank if dp > 1 else 0, c.backend.device()))
        c.iteration, c.consumed_samples = it + 1, (it + 1) * GBS
        for key, name in (("loss", "lm_loss"), ("grad_norm", "grad_norm"), ("lr", "lr")):
            out[key].append(float(got[name]))
    mine = full_weights(c)
    every = [mine]
    if c.groups.world_size > 1:
        every = [None] * c.groups.world_size
        dist.all_gather_object(every, mine)
    out["weights"] = {n: w for d in every for n, w in d.items()}
    return out


def set_weights(c, weights: dict) -> None:
    """This rank's part of the full ``weights`` into the model (FSDP2: each DTensor's local rows), then the
    masters."""
    from torch.distributed.tensor import DTensor

    from omnitron.core.models.gpt.state import full_state_shards
    from omnitron.core.parallel.data.fsdp import local_shard, shard_offset
    from omnitron.core.parallel.tensor.mappings import local_rank

    model = c.modules[0]
    shards = full_state_shards(model, weights, c.groups.tp.size, local_rank(c.groups.tp))
    with torch.no_grad():
        for name, p in model.named_parameters():
            mine = local_shard(p) if isinstance(p, DTensor) else p
            start = shard_offset(p) if isinstance(p, DTensor) else 0
            mine.copy_(shards[name][start:start + mine.shape[0]])
    c.optimizer.reload_masters()


def full_weights(c) -> dict:
    """This stage's full weights on the host (FSDP2: each DTensor gathered; collective)."""
    from torch.distributed.tensor import DTensor

    from omnitron.core.models.gpt import gather_full_state

    model = c.modules[0]
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return {n: p.full_tensor().detach().cpu() for n, p in model.named_parameters()}
    return {n: w.to("cpu") for n, w in gather_full_state(model, c.groups).items()}


def schedule_lr(it: int) -> float:
    """Megatron's linear warmup from 0 over WARMUP iterations, then cosine to MIN_LR at ITERS (the formula)."""
    if it <= WARMUP:
        return LR * it / WARMUP
    ratio = (it - WARMUP) / (ITERS - WARMUP)
    return MIN_LR + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (LR - MIN_LR)


def reference(weights: dict) -> dict:
    """The plain-torch float64 loop: omnitron's one-process model from ``weights``, the whole global batch's mean
    token loss, clip_grad_norm_, torch.optim.AdamW (decay on matrices only), the schedule's formula."""
    from omnitron.core.models.gpt import GPTModel, shard_full_state
    from omnitron.core.parallel.groups import ParallelGroups

    groups = ParallelGroups.single()
    c = components([], 1)
    model = GPTModel(c.model, groups, seed=0)
    shard_full_state(model, weights, groups)
    named = list(model.named_parameters())
    decay = [p for n, p in named if p.ndim > 1 and not n.endswith(".bias")]
    rest = [p for n, p in named if not (p.ndim > 1 and not n.endswith(".bias"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS, foreach=False)
    out, data = {"loss": [], "grad_norm": [], "lr": []}, stream()
    for it in range(ITERS):
        opt.zero_grad()
        loss = model(tokens=data[it, :, :-1], labels=data[it, :, 1:]).mean()
        loss.backward()
        out["grad_norm"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        for group in opt.param_groups:
            group["lr"] = schedule_lr(it)
        opt.step()
        out["loss"].append(loss.item())
        out["lr"].append(schedule_lr(it))
    out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def check(got: dict, want: dict, first: int = 0) -> None:
    """Losses, norms and lrs of iterations ``first``.. and every final weight (norm-wise per tensor) within TOL."""
    for key in ("loss", "grad_norm", "lr"):
        assert got[key] == pytest.approx(want[key][first:], rel=TOL, abs=1e-300), (key, got[key], want[key])
    assert got["weights"].keys() == want["weights"].keys()
    for n, w in want["weights"].items():
        assert got["weights"][n].dtype == torch.float64, n
        err = float((got["weights"][n] - w).norm() / w.norm())
        assert err <= TOL, (n, err)


@pytest.fixture(scope="module")
def start_and_want():
    """(the initial full weights, the reference's run from them)."""
    from omnitron.core.models.gpt import gather_full_state

    torch.set_num_threads(1)
    with reference_kernels():
        c = components([], 1)
        weights = {n: w.cpu().clone() for n, w in gather_full_state(c.modules[0], c.groups).items()}  # host
        return weights, reference(weights)


def test_one_rank_trains_float64_end_to_end(start_and_want):
    weights, want = start_and_want
    with reference_kernels():
        c = components([], 1)
        got = train(c, 0, ITERS, weights)
    check(got, want)
    opt = c.optimizer
    assert all(m.dtype == torch.float64 for m in opt.masters)
    assert all(t.dtype == torch.float64 for ts in opt.state.values() for t in ts)
    assert all(p.main_grad.dtype == torch.float64 for m in c.modules for p in m.parameters())


def test_float64_checkpoint_stays_float64_and_resumes_the_curve(start_and_want, tmp_path):
    """Three iterations, a save (torch_dist, then torch), a fresh run loading it, three more: the uninterrupted
    reference's curve; the saved optimizer state and weights are float64. An fp32 run resuming it takes each
    weight and moment rounded to nearest once (the masters of an fp32 run are its weights)."""
    from omnitron.core.training.checkpointing import load, save

    weights, want = start_and_want
    for fmt in ("torch_dist", "torch"):
        where = ["--save", str(tmp_path / fmt), "--load", str(tmp_path / fmt), "--ckpt-format", fmt]
        with reference_kernels():
            first = components(where, 1)
            train(first, 0, 3, weights)
            save(first)
            narrow = components(where, 1, torch.float32)
            assert load(narrow)
            second = components(where, 1)
            assert load(second)
            got = train(second, 3, ITERS, None)
        for (n, p), (_, q) in zip(narrow.modules[0].named_parameters(), first.modules[0].named_parameters()):
            assert p.dtype == torch.float32 and torch.equal(p.detach(), q.detach().float()), n
        for key, moments in first.optimizer.state.items():
            assert all(torch.equal(a, b.float()) for a, b in zip(narrow.optimizer.state[key], moments)), key
        check(got, want, first=3)
        if fmt == "torch":
            saved = second.optimizer.state_dict()["tensors"]
            assert all("master" not in e and all(t.dtype == torch.float64 for t in e.values())
                       for e in saved.values())


def layouts_worker(layouts: dict) -> dict:
    """Every layout ``{name: flags}`` trained from the same initial weights on this rank."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    weights = layouts.pop("weights")
    with reference_kernels():
        return {name: train(components(flags, dist.get_world_size()), 0, ITERS, weights)
                for name, flags in layouts.items()}


def test_two_ranks_dp_distributed_optimizer_tp_pp_train_float64(start_and_want):
    weights, want = start_and_want
    layouts = {"dp2": [], "dp2_distopt": ["--use-distributed-optimizer"], "dp2_fsdp2": ["--use-torch-fsdp2"],
               "tp2": ["--tensor-model-parallel-size", "2"], "pp2": ["--pipeline-model-parallel-size", "2"]}
    per_rank = run_distributed(layouts_worker, 2, {**layouts, "weights": weights}, env=REFERENCE_KERNELS,
                               timeout_s=600)
    for name in layouts:
        for got in (r[name] for r in per_rank):
            check(got, want)


def test_moments_below_fp32_refused_for_a_float64_model():
    """--exp-avg-dtype bf16 with float64 parameters: one line naming the flag, when the optimizer is built."""
    from omnitron.backends import get_backend
    from omnitron.core.config.training import OptimizerConfig
    from omnitron.core.optim import MixedPrecisionOptimizer
    from omnitron.core.parallel.groups import ParallelGroups

    model = torch.nn.Linear(4, 3).double()
    cfg = OptimizerConfig(optimizer="adam", lr=1e-3, exp_avg_dtype="bf16")
    with pytest.raises(ValueError, match="--exp-avg-dtype below fp32 with float64 parameters"):
        MixedPrecisionOptimizer(model.named_parameters(), cfg, ParallelGroups.single(), backend=get_backend("cpu"))


def test_onebit_adam_refuses_a_float64_model():
    """1-bit Adam's flat momenta and error feedback are fp32: a float64 model is refused in one line, naming adam."""
    from omnitron.backends import get_backend
    from omnitron.core.config.training import OptimizerConfig
    from omnitron.core.optim.onebit import OneBitAdam
    from omnitron.core.parallel.groups import ParallelGroups

    model = torch.nn.Linear(4, 3).double()
    cfg = OptimizerConfig(optimizer="onebit_adam", lr=1e-3)
    with pytest.raises(ValueError, match="onebit_adam keeps its momenta .* float64; train a float64 model with"):
        OneBitAdam(model.named_parameters(), cfg, ParallelGroups.single(), backend=get_backend("cpu"), freeze_step=2)
