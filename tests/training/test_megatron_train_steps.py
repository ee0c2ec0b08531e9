"""Ten training iterations of omnitron against megatron-core's own training step: the same Megatron flags, weights and
token batches give the same loss, gradient norm and learning rate at every iteration, and the same final weights.

The reference (tests/training/megatron_train_steps/fixtures.pt, written by its make_fixtures.py with the Megatron-LM
d98e8a6 snapshot on CPU gloo) is a tiny GPT-2-style model (2 layers, hidden 32, 4 heads, ffn 64, vocabulary 64,
sequence 16, tied embeddings, learned positions) trained as a megatron-core user trains it: ``GPTModel`` (local
spec) in megatron-core's ``DistributedDataParallel``, ``get_megatron_optimizer`` (Adam, beta2 0.95, weight decay 0.1
off biases and norms, --clip-grad 0.5: the clip acts at every step), ``OptimizerParamScheduler`` (lr 3e-3, 3 warmup
iterations from 0, cosine to 3e-4 over 10), ``get_forward_backward_func()`` over 4 micro-batches of 2 with
pretrain_gpt's loss function, global batch 8. omnitron runs the same flags through its own argument parser, builds
its components and calls its ``train_step`` on the same micro-batches. Cases: one rank (float64), one rank with an
uneven loss mask (float64), dp2, tp2 and pp2 on two gloo ranks (each against megatron-core's run at the same
layout, float64), one rank in float32, and dp2 with the distributed optimizer in float32 (megatron-core's refuses
float64 parameters).

Float64 bound (TOL64). Both models run in float64; what is not float64: Megatron's loss function casts the per-token
losses to float32 (its logged loss: 128 float32 products summed, a tree of depth 7, and the cast: <= 8 u relative,
u = 2**-24; their gradient, 1 / tokens / micro-batches, is exact but for the masked case's 1 / 24 / 4, <= 2 u) and
its gradient norm (per-tensor float64 norms cast to float32 and normed in float32: <= 2 u), hence its clip factor
(<= 2 u on every clipped update). omnitron is float64 throughout (its optimizer keeps a float64 model's gradients,
moments and norm in float64: tests/optim/test_float64_training.py). Adam's update is invariant to a scale common to
all steps but not to one varying per step: the clip factor's error moves each update by <= 2 u relative, a weight by
<= 2 u x lr / |w| (<= 1) a step, <= 20 u over 10 steps; those weights feed the next gradients and the loss at gain ~1.
So per iteration: loss <= (8 + 20) u, grad norm <= (2 + 20) u, final weights (norm-wise, each tensor) <= 20 u:
TOL64 = 32 u = 1.9e-6 for all three. The learning rates are
the same float64 formula on both sides: 1e-12. A bug of the kinds this guards (weight decay on a bias or norm,
the warmup's first rate, the clip before or after the dp reduction, the micro-batch or dp averaging, Adam's eps
inside or outside the root) moves a weight by at least lr x wd x |w| ~ 3e-5 a step, 1e-4 or more relative to the
tensor, or the loss / norm by a factor.

Float32 (TOL32, losses and grad norms only). Both sides now round everywhere; Adam's update of an element whose
gradient is near eps (1e-8) turns a float32 rounding of that gradient into an lr-sized change of the element (the
first steps move every weight by about +-lr whatever its gradient's size), so the final weights of two float32
runs part by up to a few per cent of lr in single elements (megatron-core's own float32 and float64 runs do:
1.1e-4 in one element). Those elements are the ones whose gradient is ~0, so their effect on the loss and on the
gradient's norm is second order: the losses and norms stay at forward-rounding size. A float32 forward of this
model (matrix products of inner size <= 64: <= 64 u each, 4 a layer, 2 layers, the head and the loss) bounds a
token's loss error by ~600 u relative at worst; TOL32 = 1e-5 (170 u), the sum of the 128 tokens' losses erring by
their mean's relative error. The final weights are compared with the float64 case instead.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from omnitron.testing.distributed import REFERENCE_KERNELS, run_distributed
from omnitron.testing.parity import reference_kernels

FIXTURES = torch.load(os.path.join(os.path.dirname(__file__), "megatron_train_steps", "fixtures.pt"),
                      weights_only=True)
U = 2.0 ** -24
TOL64 = 32 * U  # the docstring's float64 bound
TOL32 = 1e-5  # the docstring's float32 bound (losses and grad norms)
SETTINGS = FIXTURES["settings"]
M, O, SCH = SETTINGS["MODEL"], SETTINGS["OPTIM"], SETTINGS["SCHEDULE"]
FLAGS = [
    "--num-layers", str(M["num_layers"]), "--hidden-size", str(M["hidden_size"]),
    "--num-attention-heads", str(M["num_attention_heads"]), "--ffn-hidden-size", str(M["ffn_hidden_size"]),
    "--seq-length", str(SETTINGS["S"]), "--max-position-embeddings", str(SETTINGS["S"]),
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(SETTINGS["V"] - 1),  # + its eod
    "--make-vocab-size-divisible-by", "1", "--num-workers", "0", "--no-tensorboard", "--seed", "1",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--position-embedding-type", "learned_absolute",
    "--train-iters", str(SETTINGS["ITERS"]), "--micro-batch-size", str(SETTINGS["MBS"]),
    "--global-batch-size", str(SETTINGS["GBS"]),
    "--lr", str(O["lr"]), "--min-lr", str(O["min_lr"]), "--lr-warmup-iters", str(SCH["lr_warmup_iters"]),
    "--lr-decay-iters", str(SCH["lr_decay_iters"]), "--lr-decay-style", SCH["lr_decay_style"],
    "--weight-decay", str(O["weight_decay"]), "--adam-beta1", str(O["adam_beta1"]),
    "--adam-beta2", str(O["adam_beta2"]), "--adam-eps", str(O["adam_eps"]), "--clip-grad", str(O["clip_grad"])]


def loss_mask(case: str, sample: int) -> torch.Tensor:
    """make_fixtures.py's mask: the ``masked`` case drops the second half of sample 1 of every global batch."""
    S = SETTINGS["S"]
    m = torch.ones(S)
    if case.endswith("masked") and sample == 1:
        m[S // 2:] = 0
    return m


def micro_batches(case: str, it: int, dp: int, dp_rank: int, device):
    """Iteration ``it``'s micro-batches of one data-parallel rank on ``device``, as Megatron's sampler splits the
    global batch (rank r reads samples r * mbs .. (r + 1) * mbs of each dp * mbs)."""
    stream, mbs, S = FIXTURES["stream"], SETTINGS["MBS"], SETTINGS["S"]
    rows = [i for i in range(SETTINGS["GBS"]) if (i // mbs) % dp == dp_rank]
    for k in range(0, len(rows), mbs):
        r = rows[k:k + mbs]
        t = stream[it, r]
        batch = {"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": torch.stack([loss_mask(case, i) for i in r]),
                 "position_ids": torch.arange(S)[None].expand(len(r), S)}
        yield {k: v.to(device) for k, v in batch.items()}


def train_omnitron(case: str, extra: list[str], world: int, dtype: torch.dtype) -> dict:
    """omnitron's ten iterations of ``case`` on this process's rank (``extra``: layout flags): per-iteration loss,
    grad norm, lr and the final full weights."""
    from omnitron.backends import get_backend
    from omnitron.core.models.gpt import gather_full_state, shard_full_state
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.components import build_components
    from omnitron.core.training.step import train_step

    s = parse_settings([*FLAGS, *extra], world)
    s = dataclasses.replace(s, model=dataclasses.replace(s.model, params_dtype=dtype))
    be = get_backend()  # the backend under test: the batches go to its device
    c = build_components(s, be)
    assert len(c.modules) == 1 and c.model.vocab_size == SETTINGS["V"]
    shard_full_state(c.modules[0], {n: w.to(dtype) for n, w in FIXTURES["weights"].items()}, c.groups)
    c.optimizer.reload_masters()  # the masters were copied from omnitron's own initialisation
    dp = c.groups.dp.size
    out = {"loss": [], "grad_norm": [], "lr": []}
    for it in range(SETTINGS["ITERS"]):
        got = train_step(c, micro_batches(case, it, dp, c.groups.dp.rank if dp > 1 else 0, be.device()))
        for key, name in (("loss", "lm_loss"), ("grad_norm", "grad_norm"), ("lr", "lr")):
            out[key].append(float(got[name]))
    mine = {n: w.to("cpu", torch.float64) for n, w in gather_full_state(c.modules[0], c.groups).items()}
    if world == 1:
        out["weights"] = mine
        return out
    import torch.distributed as dist

    every = [None] * world  # the pipeline stages' parameters merged
    dist.all_gather_object(every, mine)
    out["weights"] = {n: w for d in every for n, w in d.items()}
    return out


def layouts_worker(layouts: dict) -> dict:
    """Every layout ``{name: (case, flags)}`` trained on this process's rank (the reference kernels; float32 where
    the case's name says so)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    with reference_kernels():
        return {name: train_omnitron(case, flags, dist.get_world_size(),
                                     torch.float32 if case.endswith("fp32") else torch.float64)
                for name, (case, flags) in layouts.items()}


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def check_curves(got: dict, want: dict, tol: float, *, loss: bool = True) -> None:
    """Each iteration's loss (``loss``), grad norm and lr within ``tol`` (lr: 1e-12) of Megatron's."""
    n = SETTINGS["ITERS"]
    assert len(got["loss"]) == len(want["loss"]) == n
    for it in range(n):
        if loss:
            assert relative(got["loss"][it], want["loss"][it]) <= tol, (it, got["loss"], want["loss"])
        assert relative(got["grad_norm"][it], want["grad_norm"][it]) <= tol, (it, got["grad_norm"],
                                                                              want["grad_norm"])
        assert got["lr"][it] == pytest.approx(want["lr"][it], rel=1e-12, abs=1e-15), (it, got["lr"], want["lr"])


def check_weights(got: dict, want: dict, tol: float) -> None:
    """Each final weight tensor within ``tol`` of Megatron's, norm-wise relative to the tensor."""
    assert got.keys() == want.keys()
    for n, w in want.items():
        w = w.double()
        err = float((got[n] - w).norm() / w.norm())
        assert err <= tol, (n, err)


def test_one_rank_float64_matches_megatron_every_iteration():
    want = FIXTURES["cases"]["tp1"]
    with reference_kernels():
        got = train_omnitron("tp1", [], 1, torch.float64)
    check_curves(got, want, TOL64)
    check_weights(got["weights"], want["weights"], TOL64)
    assert want["lr"][0] == 0.0 and got["lr"][0] == 0.0  # Megatron's warmup starts at --lr-warmup-init (0)


def test_uneven_loss_mask_trains_as_megatron_and_logs_the_documented_mean():
    """With a loss mask the gradients (hence the weights and norms) are Megatron's; the logged loss is, as
    docs/megatron-flags.md says, the mean of the micro-batches' token means where Megatron logs the global batch's
    token mean: checked against Megatron's own per-micro-batch [sum, tokens] reports."""
    want = FIXTURES["cases"]["tp1_masked"]
    with reference_kernels():
        got = train_omnitron("tp1_masked", [], 1, torch.float64)
    check_curves(got, want, TOL64, loss=False)
    check_weights(got["weights"], want["weights"], TOL64)
    apart = []
    for it, reports in enumerate(want["microbatch_loss"]):
        means = (reports[:, 0] / reports[:, 1]).mean().item()
        token_mean = (reports[:, 0].sum() / reports[:, 1].sum()).item()
        assert relative(want["loss"][it], token_mean) <= TOL64
        assert relative(got["loss"][it], means) <= TOL64, (it, got["loss"][it], means)
        apart.append(relative(means, token_mean))
    assert min(apart) > 10 * TOL64  # the case tells the two apart at every iteration


def test_dp2_tp2_pp2_match_megatron_at_the_same_layout_every_iteration():
    """Each layout against megatron-core's run at that layout, --use-distributed-optimizer on both sides in float32
    (every rank's logged loss: omnitron reports the last stage's on every rank; Megatron's first pipeline stage has
    none, its figure is the last stage's)."""
    layouts = {"dp2": ("dp2", []), "tp2": ("tp2", ["--tensor-model-parallel-size", "2"]),
               "pp2": ("pp2", ["--pipeline-model-parallel-size", "2"]),
               "dp2_distopt_fp32": ("dp2_distopt_fp32", ["--use-distributed-optimizer"])}
    per_rank = run_distributed(layouts_worker, 2, layouts, env=REFERENCE_KERNELS, timeout_s=600)
    for name in layouts:
        want = FIXTURES["cases"][name]
        for got in (r[name] for r in per_rank):
            if name.endswith("fp32"):  # float32: losses and norms (the module docstring)
                check_curves(got, want, TOL32)
                continue
            check_curves(got, want, TOL64)
            check_weights(got["weights"], want["weights"], TOL64)


def test_one_rank_float32_losses_and_norms_match_megatron():
    want = FIXTURES["cases"]["tp1_fp32"]
    got = train_omnitron("tp1_fp32", [], 1, torch.float32)
    check_curves(got, want, TOL32)
