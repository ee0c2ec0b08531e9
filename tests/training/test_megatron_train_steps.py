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
float64 parameters); tp2 x pp2, dp2 x tp2 with --sequence-parallel and dp2 x pp2 on four ranks, pp2 x vpp2 (4 layers,
the interleaved schedule), pp2 with untied embeddings and MoE at ep2 (4 experts, top 2, aux loss, alltoall) in
float64, dp2 (dp2 x pp2 x vpp2, MoE at dp4 x ep2) with --overlap-grad-reduce --overlap-param-gather and the
distributed optimizer in float32, one rank in fp16 with dynamic loss scaling (and dp2 with the distributed
optimizer) and in bf16 (make_fixtures.py's docstring says how each is run). MoE at dp2 x tp2 x ep2 under
--sequence-parallel is checked against megatron-core's dp2 x ep2 run: megatron-core's own run at that layout sums
the experts' fc2 bias gradients over the tensor-parallel group (make_fixtures.py MEGATRON_BUG).

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

Float16 (TOL16, losses and norms; --fp16 on both sides, float32 masters). The forward rounds each op's output to
fp16 (u16 = 2**-11; inner products accumulate in float32 on the CPU): about 8 roundings a layer, 2 layers, the
embedding sum, the final norm and the logits, K ~ 20 relative roundings of values of size ~1 carried to the logits
with gain <~ 1 (weights 0.1, rows of 32: norm ~0.6). So a logit differs by <= K u16 and a token's loss (its
gradient in the logits sums to <= 2 in absolute value) by <= 2 K u16, <= 2 x 20 x 4.9e-4 / 4.2 = 4.7e-3 relative
to the loss (~4.2). The backward rounds as often again on its way down: a gradient element by <= 2 K u16 = 2e-2
relative, the norm likewise; the weights' later divergence acts at second order as in float32. TOL16 = 2e-2 for
both. What the fp16 case pins exactly: the loss scale of every iteration, which iteration overflows and is skipped
(its grad norm absent, its lr not advanced), the lr of every iteration.

BFloat16 (TOL_BF16, losses and norms; --bf16 on both sides, float32 masters, gradients accumulated and reduced in
float32). The float16 argument with u = 2**-8: a token's loss by <= 2 K u / 4.2 = 3.7e-2 relative, a gradient
element and the norm by <= 2 K u = 0.16; TOL_BF16 = 0.16 for both. Loose by design: it pins the bf16 training
path (master weights, the float32 accumulation, no loss scaling, the lr), not rounding.
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
TOL16 = 2e-2  # the docstring's float16 bound (losses and grad norms)
TOL_BF16 = 0.16  # the docstring's bfloat16 bound (losses and grad norms)
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


def omnitron_name(megatron_name: str) -> str:
    """omnitron's name of a parameter of megatron-core's local-spec model (its experts sit in ``local_experts``)."""
    return megatron_name.replace(".mlp.experts.local_experts.", ".mlp.experts.")


def case_weights(case: str) -> dict:
    """The case's initial full weights by omnitron's names (its own draw where its model differs)."""
    return {omnitron_name(n): w for n, w in FIXTURES["case_weights"].get(case, FIXTURES["weights"]).items()}


def train_omnitron(case: str, extra: list[str], world: int, dtype: torch.dtype) -> dict:
    """omnitron's ten iterations of ``case`` on this process's rank (``extra``: layout flags): per-iteration loss,
    grad norm, lr, loss scale and the final full weights (by megatron-core's names)."""
    from omnitron.backends import get_backend
    from omnitron.core.models.gpt import gather_full_state, shard_full_state
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.components import build_components
    from omnitron.core.training.step import train_step

    s = parse_settings([*FLAGS, *extra], world)
    s = dataclasses.replace(s, model=dataclasses.replace(s.model, params_dtype=dtype))
    be = get_backend()  # the backend under test: the batches go to its device
    c = build_components(s, be)
    assert c.model.vocab_size == SETTINGS["V"]
    full = case_weights(case)
    for m in c.modules:  # a rank's virtual stages: one module each
        shard_full_state(m, {n: w.to(dtype) for n, w in full.items()}, c.groups)
    c.optimizer.reload_masters()  # the masters were copied from omnitron's own initialisation
    dp = c.groups.dp.size
    out = {"loss": [], "grad_norm": [], "lr": [], "loss_scale": []}
    for it in range(SETTINGS["ITERS"]):
        got = train_step(c, micro_batches(case, it, dp, c.groups.dp.rank if dp > 1 else 0, be.device()))
        for key, name in (("loss", "lm_loss"), ("lr", "lr")):
            out[key].append(float(got[name]))
        out["loss_scale"].append(got["loss_scale"] and float(got["loss_scale"]))  # None without --fp16
        out["grad_norm"].append(float("nan") if got["skipped"] else float(got["grad_norm"]))
    mine = {n: w.to("cpu", torch.float64) for m in c.modules for n, w in gather_full_state(m, c.groups).items()}
    if world > 1:
        import torch.distributed as dist

        every = [None] * world  # the pipeline stages' (and expert ranks') parameters merged
        dist.all_gather_object(every, mine)
        mine = {n: w for d in every for n, w in d.items()}
    megatron_names = {omnitron_name(n): n for n in FIXTURES["case_weights"].get(case, FIXTURES["weights"])}
    out["weights"] = {megatron_names.get(n, n): w for n, w in mine.items()}
    return out


def dtype_of(case: str) -> torch.dtype:
    """The case's parameter dtype (make_fixtures.py's)."""
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}.get(case.rsplit("_", 1)[-1],
                                                                                      torch.float64)


def layouts_worker(layouts: dict) -> dict:
    """Every layout ``{name: (case, flags)}`` trained on this process's rank (the reference kernels; float32 where
    the case's name says so)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    with reference_kernels():
        return {name: train_omnitron(case, flags, dist.get_world_size(), dtype_of(case))
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
        if want["grad_norm"][it] != want["grad_norm"][it]:  # Megatron skipped the step (fp16 overflow): so must we
            assert got["grad_norm"][it] != got["grad_norm"][it], (it, got["grad_norm"], want["grad_norm"])
            continue
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


LAYOUTS = {
    "dp2": [], "tp2": ["--tensor-model-parallel-size", "2"], "pp2": ["--pipeline-model-parallel-size", "2"],
    "dp2_distopt_fp32": ["--use-distributed-optimizer"],
    "tp2_pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
    "dp2_tp2_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "dp2_pp2": ["--pipeline-model-parallel-size", "2"],
    "pp2_vpp2": ["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                 "--num-layers-per-virtual-pipeline-stage", "1"],
    "pp2_untied": ["--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights"],
    "dp2_overlap_distopt_fp32": ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
    "dp2_moe_ep2": ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
                    "--moe-router-load-balancing-type", "aux_loss", "--moe-token-dispatcher-type", "alltoall",
                    "--expert-model-parallel-size", "2", "--no-bias-gelu-fusion"],
    "tp1_bf16": ["--bf16"]}
LAYOUTS["tp1_fp16"] = ["--fp16", "--initial-loss-scale", "65536", "--min-loss-scale", "1", "--loss-scale-window", "2",
                       "--hysteresis", "1"]
LAYOUTS["dp2_distopt_fp16"] = [*LAYOUTS["tp1_fp16"], "--use-distributed-optimizer"]
LAYOUTS["dp2_tp2_sp_moe_ep2"] = [*LAYOUTS["dp2_tp2_sp"], *LAYOUTS["dp2_moe_ep2"], "--expert-tensor-parallel-size", "1"]
LAYOUTS["dp2_pp2_vpp2_overlap_distopt_fp32"] = [*LAYOUTS["pp2_vpp2"], *LAYOUTS["dp2_overlap_distopt_fp32"]]
LAYOUTS["dp4_moe_ep2_overlap_distopt_fp32"] = [*LAYOUTS["dp2_moe_ep2"], *LAYOUTS["dp2_overlap_distopt_fp32"]]
"""case -> omnitron's flags for megatron-core's layout and options of that case (make_fixtures.py's CASES,
OPTIONS)"""


def check_layouts(world: int, names: list[str], against: dict | None = None) -> None:
    """Each case of ``names`` on ``world`` gloo ranks against megatron-core's run at that layout (or at the layout
    ``against`` names for it): every rank's curves (omnitron reports the last stage's loss on every rank;
    Megatron's first pipeline stage has none, its figure is the last stage's) within the dtype's bound, fp16's loss
    scales exactly, and in float64 the final weights."""
    layouts = {name: (name, LAYOUTS[name]) for name in names}
    per_rank = run_distributed(layouts_worker, world, layouts, env=REFERENCE_KERNELS, timeout_s=600)
    tols = {torch.float32: TOL32, torch.float16: TOL16, torch.bfloat16: TOL_BF16, torch.float64: TOL64}
    for name in names:
        want = FIXTURES["cases"][(against or {}).get(name, name)]
        for got in (r[name] for r in per_rank):
            check_curves(got, want, tols[dtype_of(name)])
            if "loss_scale" in want:
                assert got["loss_scale"] == want["loss_scale"]
            if dtype_of(name) == torch.float64:  # float32 and below: losses and norms (the module docstring)
                check_weights(got["weights"], want["weights"], TOL64)


def test_dp2_tp2_pp2_match_megatron_at_the_same_layout_every_iteration():
    """dp2, tp2, pp2 in float64 and dp2 with --use-distributed-optimizer on both sides in float32."""
    check_layouts(2, ["dp2", "tp2", "pp2", "dp2_distopt_fp32"])


def test_interleaved_untied_overlapped_and_moe_match_megatron_every_iteration():
    """pp2 x vpp2 (4 layers, megatron-core's interleaved schedule), pp2 with untied embeddings, dp2 with the
    distributed optimizer and --overlap-grad-reduce --overlap-param-gather (float32), MoE (4 experts, top 2,
    aux loss, alltoall dispatcher) at ep2."""
    check_layouts(2, ["pp2_vpp2", "pp2_untied", "dp2_overlap_distopt_fp32", "dp2_moe_ep2"])


def test_four_rank_layouts_match_megatron_every_iteration():
    """tp2 x pp2, dp2 x tp2 with --sequence-parallel, dp2 x pp2; dp2 x pp2 x vpp2 and MoE at dp4 x ep2 (the
    experts' gradients reduced over their own data-parallel pair) with the distributed optimizer and
    --overlap-grad-reduce --overlap-param-gather (float32) on four ranks."""
    check_layouts(4, ["tp2_pp2", "dp2_tp2_sp", "dp2_pp2", "dp2_pp2_vpp2_overlap_distopt_fp32",
                      "dp4_moe_ep2_overlap_distopt_fp32"])


def test_moe_under_sequence_parallelism_matches_megatron_at_dp2_ep2():
    """MoE at dp2 x tp2 x ep2 with --sequence-parallel (--expert-tensor-parallel-size 1, which Megatron needs for
    expert biases) trains as megatron-core at dp2 x ep2: the layout changes no number beyond reordering. Against
    megatron-core's run at ITS layout it cannot be checked: there each expert's fc2 bias gradient is summed over the
    tensor-parallel group with the other tp rank's experts' (make_fixtures.py MEGATRON_BUG); the second half pins
    that this is still so in the fixture (regenerated from a fixed Megatron it fails: compare at the same layout)."""
    check_layouts(4, ["dp2_tp2_sp_moe_ep2"], against={"dp2_tp2_sp_moe_ep2": "dp2_moe_ep2"})
    bugged, right = FIXTURES["cases"]["dp2_tp2_sp_moe_ep2"], FIXTURES["cases"]["dp2_moe_ep2"]
    assert relative(bugged["loss"][0], right["loss"][0]) <= TOL64  # the same forward
    assert relative(bugged["grad_norm"][0], right["grad_norm"][0]) > 1e3 * TOL64  # the summed bias gradients


def test_one_rank_float32_losses_and_norms_match_megatron():
    want = FIXTURES["cases"]["tp1_fp32"]
    got = train_omnitron("tp1_fp32", [], 1, torch.float32)
    check_curves(got, want, TOL32)


def test_fp16_dynamic_loss_scaling_matches_megatron_every_iteration():
    """--fp16 with dynamic loss scaling: the same loss scale at every iteration (doubled every --loss-scale-window
    2 good steps from 2**16), the same iteration overflowing and skipped (the lr not advanced past it), the losses
    and norms within TOL16; on one rank and at dp2 with the distributed optimizer (the overflow found on either
    rank skips both)."""
    want = FIXTURES["cases"]["tp1_fp16"]
    with reference_kernels():
        got = train_omnitron("tp1_fp16", LAYOUTS["tp1_fp16"], 1, torch.float16)
    assert got["loss_scale"] == want["loss_scale"]
    assert sum(g != g for g in want["grad_norm"]) == 1  # the case overflows (and backs off) once
    check_curves(got, want, TOL16)
    assert sum(g != g for g in FIXTURES["cases"]["dp2_distopt_fp16"]["grad_norm"]) == 2
    check_layouts(2, ["dp2_distopt_fp16"])


def test_bf16_matches_megatron_every_iteration():
    """--bf16 (float32 masters, gradients accumulated and all-reduced in float32): losses and norms within
    TOL_BF16, the same lr at every iteration."""
    want = FIXTURES["cases"]["tp1_bf16"]
    with reference_kernels():
        got = train_omnitron("tp1_bf16", LAYOUTS["tp1_bf16"], 1, torch.bfloat16)
    check_curves(got, want, TOL_BF16)
