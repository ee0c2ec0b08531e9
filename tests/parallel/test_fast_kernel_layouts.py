"""The layouts on the DEFAULT kernel table (the C++ CPU kernels active), float32, against float64 references.

The layout parity tests train float64 models on the reference kernels (a statement about the parallel maths); the
C++ kernels decline float64, so those tests never run them on a layout's slices. Here one float32 case per family
runs them where a layout hands them something one process never does, and a counting proxy over the extension
checks each kernel was really called (on the cpu backend whatever the suite's --backend: these are its kernels):

* distributed optimizer (dp4 with an MoE model: dense masters sharded over dp4, expert masters over edp2; and
  pp2 x dp2): ``adamw_step`` and ``grad_norm_sq`` on shard slices that start mid-bucket and mid-parameter. Every
  rank writes the same known gradients, steps twice, and the gathered parameters and the norm are compared with
  AdamW written out in float64 on the full tensors.
* tp2 + sequence parallelism: ``rms_norm`` / ``layer_norm`` on sequence shards, ``swiglu`` on tp-split columns,
  ``rope`` (bias-gelu has no C++ kernel: the GPT config's MLP runs torch there), against the one-process float64
  model on the reference kernels.
* cp2: ``rope`` at a cp rank's load-balanced positions (rank 1 starts at position 4), forward and backward.
"""
from __future__ import annotations

import collections
import math
import os
import zlib

import torch

from omnitron.testing.distributed import run_distributed

U32 = 2.0 ** -24  # float32 unit roundoff
LR, WD, BETA1, BETA2, EPS, STEPS = 1e-2, 0.1, 0.9, 0.999, 1e-8, 2


def _beta_slip(beta: float) -> float:
    """Relative error of beta and of 1 - beta once beta is rounded to float32, as the C++ AdamW takes it (it forms
    1 - beta in float32 from the rounded beta: 1.3e-5 relative for 0.999)."""
    slip = abs(float(torch.tensor(beta, dtype=torch.float32)) - beta)
    return slip / min(beta, 1 - beta)


# See test_distributed_optimizer_fast_kernels: per step, |p32 - p64| <= u (4 |p| + 16 lr) + lr BETAS_REL
BETAS_REL = 1.01 * (_beta_slip(BETA1) + _beta_slip(BETA2) / 2)


class CountingExtension:
    """Forwards every attribute of the C++ extension module, counting the calls by name."""

    def __init__(self, module):
        self.module, self.calls = module, collections.Counter()

    def __getattr__(self, name):
        fn = getattr(self.module, name)

        def call(*args, **kwargs):
            self.calls[name] += 1
            return fn(*args, **kwargs)

        return call


def count_kernel_calls() -> CountingExtension:
    """Put a counting proxy in front of the loaded C++ extension (this process); fails if it is not available."""
    from omnitron.kernels import cpp

    ok, why = cpp.available()
    assert ok, f"the C++ kernels must be available for these tests: {why}"
    spy = CountingExtension(cpp.extension())
    cpp._state["module"] = spy
    return spy


def _args(pp: int, extra: list[str], root: str) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200", "--num-workers", "0",
            "--micro-batch-size", "1", "--global-batch-size", str(2 * 4 // pp), "--train-iters", "10",
            "--lr", str(LR), "--weight-decay", str(WD), "--adam-beta1", str(BETA1), "--adam-beta2", str(BETA2),
            "--adam-eps", str(EPS), "--clip-grad", "1e6",  # the norm is taken and reported; clipping stays off
            "--seed", "11", "--no-tensorboard", "--ddp-bucket-size", "3000", "--use-distributed-optimizer",
            "--pipeline-model-parallel-size", str(pp), "--data-cache-path", os.path.join(root, "cache"), *extra]


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
       "--expert-tensor-parallel-size", "1", "--moe-ffn-hidden-size", "24"]
DISTOPT_CASES = {"dp4": (1, []), "dp4_moe_edp2": (1, MOE), "pp2dp2": (2, [])}


def _known_grad(name: str, shape, step: int) -> torch.Tensor:
    """Gradient ``step`` of parameter ``name``: the same on every rank holding it, |g| in [5e-3, 1.5e-2] (bounded
    away from 0, so eps = 1e-8 moves no update by more than 2e-6 relative, alike in both precisions)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}".encode()))
    mag = 5e-3 + 1e-2 * torch.rand(shape, generator=g)
    return torch.where(torch.rand(shape, generator=g) < 0.5, -mag, mag)


def _distopt_case(pp: int, extra: list[str], root: str) -> dict:
    """One rank: two optimizer steps from known gradients; the float32 engine against float64 AdamW."""
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.optim import DistributedOptimizer
    from omnitron.core.optim.optimizer import _decays
    from omnitron.core.training.components import build_components
    from omnitron.testing.training import settings_in

    c = build_components(settings_in(_args(pp, extra, root), dist.get_world_size()), get_backend())
    opt = c.optimizer
    assert isinstance(opt, DistributedOptimizer)
    named = [(n, p) for m in c.modules for n, p in m.named_parameters()]
    ref = {n: (p.detach().double().clone(), torch.zeros_like(p, dtype=torch.float64),
               torch.zeros_like(p, dtype=torch.float64)) for n, p in named}
    out = {"norms": [], "squares": [], "err": 0.0, "ep_rank": c.groups.ep.rank, "pp": pp,
           "expert": any(getattr(p, "expert", False) for _, p in named)}
    for t in range(1, STEPS + 1):
        sq = {False: 0.0, True: 0.0}  # float64 sums of squares of this rank's dense / expert gradients
        for n, p in named:
            g = _known_grad(n, p.shape, t)
            p.main_grad.copy_(g)
            sq[bool(getattr(p, "expert", False))] += float(g.double().square().sum())
            w, m, v = ref[n]
            g = g.double()
            w.mul_(1 - LR * WD if _decays(n, p) else 1.0)
            m.mul_(BETA1).add_(g, alpha=1 - BETA1)
            v.mul_(BETA2).add_(g * g, alpha=1 - BETA2)
            w.add_(-LR / (1 - BETA1 ** t) * m / ((v / (1 - BETA2 ** t)).sqrt() + EPS))
        res = opt.step(LR)
        out["norms"].append(float(res.grad_norm))
        out["squares"].append((sq[False], sq[True]))
    # STEPS_BOUND (see test_distributed_optimizer_fast_kernels) per element, on |w| of the reference
    for n, p in named:  # err: the largest |p32 - p64| as a fraction of its bound
        w = ref[n][0]
        ratio = (p.detach().double() - w).abs() / (STEPS * (U32 * (4 * w.abs() + 16 * LR) + LR * BETAS_REL))
        if float(ratio.max()) > out["err"]:
            i = int(ratio.argmax())
            out["err"], out["worst"] = float(ratio.max()), (n, float(w.view(-1)[i]), float(p.detach().view(-1)[i]))
    out["k"] = max(min(s.grad.numel(), 1 << 15) for s in opt.slices)  # the longest float32 run grad_norm_sq sums
    return out


def _distopt_worker(root: str) -> dict:
    torch.set_num_threads(1)
    spy = count_kernel_calls()
    out = {name: _distopt_case(pp, extra, os.path.join(root, name)) for name, (pp, extra) in DISTOPT_CASES.items()}
    out["calls"] = dict(spy.calls)
    return out


def _reference_norms(results: list[dict], name: str) -> list[float | None]:
    """The float64 global norm per step: the dense squares (every rank holds them all) plus each ep rank's own
    experts' (a rank's local experts are distinct parameters with their own names, so their own gradients). None
    under pp (each stage's tied embedding copy carries its own known gradient here, so the norm's one-copy rule
    has no reference)."""
    first = results[0][name]
    if first["pp"] > 1:
        return [None] * STEPS
    by_ep = {r[name]["ep_rank"]: r[name]["squares"] for r in results}
    return [math.sqrt(first["squares"][t][0] + sum(sq[t][1] for sq in by_ep.values())) for t in range(STEPS)]


def test_distributed_optimizer_fast_kernels(tmp_path):
    """adamw_step and grad_norm_sq (C++, float32) on dp4 / edp2 / pp2 x dp2 shard slices against float64 AdamW.

    Bound per element after STEPS = 2 steps, u = 2**-24 (the C++ loop, csrc/cpu/optim.cpp, rounds each of its
    float32 operations once; the reference is exact to float64's 1e-16): the decay p (1 - lr wd) rounds twice
    (the factor and the product: 2u |p|), the add of the update once more (u |p| + u |update|), so <= 4u |p| a step
    counting the carried weight's own rounding. The update lr m^ / (sqrt(v^) + eps): m takes 3 roundings (g - m,
    x (1 - b1), + m), v 4 (g g, x (1 - b2), v b2, +), the bias-corrected sqrt(v / bc2) 2 more and half v's 4,
    the division and the step-size product 2 each, bc1 / bc2 / step size 1 each in their float casts: <= 16 u
    relative on m^ / sqrt(v^). That ratio is <= 1.01 for t <= 2 (Cauchy-Schwarz over the two steps' weights
    (0.09, 0.1) / 0.19 against (0.999, 1) / 1.999), and where m cancels (g1, g2 of opposite sign) the absolute
    error of m is still <= 3u (b1 |m1| + (1 - b1) |g2|), whose ratio to sqrt(v^) has the same 1.01 bound: <= 16 u
    lr a step. The kernel takes beta1, beta2 as float32 and forms 1 - beta from them: m^ and v^ carry the betas'
    representation errors (BETAS_REL: beta2 = 0.999 rounds by 1.3e-8, 1.3e-5 of 1 - beta2, half that on sqrt(v^)),
    lr BETAS_REL = 6.6e-8 a step. So |p32 - p64| <= STEPS (u (4 |p| + 16 lr) + lr BETAS_REL), the previous step's
    error carried at gain (1 - lr wd) <= 1. The norm: grad_norm_sq squares (u each) and sums in float32 runs of K =
    min(slice length, 32K) elements (partials in float64, exact to 1e-16 here), so for these positive terms its
    relative error is <= (K + 1) u, K the longest slice any rank sums; the square root halves it and the float32
    result rounds once more: |norm32 - norm64| <= ((K + 1) / 2 + 1) u norm. A slice read from the wrong offset
    moves an element by ~|g| / sqrt(v) ~ 1 lr, 1e5 x the parameters' bound."""
    results = run_distributed(_distopt_worker, 4, str(tmp_path), backend="cpu", timeout_s=240)
    for rank, res in enumerate(results):
        calls = res.pop("calls")
        assert calls.get("adamw_step", 0) >= len(DISTOPT_CASES) * STEPS, (rank, calls)
        assert calls.get("grad_norm_sq", 0) >= len(DISTOPT_CASES) * STEPS, (rank, calls)
        for name, r in res.items():
            k = max(other[name]["k"] for other in results)
            assert r["err"] <= 1.0, (name, rank, r["err"], r.get("worst"))
            for got, want in zip(r["norms"], _reference_norms(results, name)):
                if want is not None:
                    assert abs(got - want) <= ((k + 1) / 2 + 1) * U32 * want, (name, rank, k, got, want)
        assert res["dp4_moe_edp2"]["expert"], "the MoE case must have expert parameters"


# ---- tensor + sequence parallelism: C++ norms on sequence shards, gated activations on TP-split columns ------------
# float32 engine (C++ kernels) against the one-process float64 model on the reference kernels, same weights. Each
# float32 contraction of n terms errs by <= n u of the sum of its terms' magnitudes (the kernels' float32
# accumulation order, the gemms' blocking and tp's 2-way split alike: any order is covered by n u). One forward
# chains, per layer, qkv (h = 32 terms), scores (d = 8), softmax and attention over s = 16 keys (2 x 16), the
# projection (32), fc1 (32) and fc2 (ffn <= 96) and the norms' row sums (32); with the embedding and the logits'
# 32: K = 2 x 248 + 64 = 560 terms, 560 u = 3.3e-5 on the logits at condition ~1 (norms and softmaxes are well
# conditioned at these scales). A gradient chains the same sums backwards plus its b x s = 48-token weight-gradient
# sum: <= 2 x 560 + 48 = 1170 u = 7e-5. TP32_TOL = 2e-4 leaves a factor ~3 for the sums' condition; a norm or
# activation reading the wrong rows or columns moves these by ~1.
TP32_TOL = 2e-4


def _tp_configs():
    from omnitron.core.models.gpt import GPTConfig

    base = dict(num_layers=2, seq_length=16, vocab_size=97, make_vocab_size_divisible_by=1, hidden_dropout=0.0,
                attention_dropout=0.0, params_dtype=torch.float32)
    return {"llama_rms_swiglu_rope": GPTConfig(hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                               ffn_hidden_size=48, normalization="RMSNorm", swiglu=True,
                                               position_embedding_type="rope", add_bias_linear=False, **base),
            "gpt_layernorm_gelu": GPTConfig(hidden_size=32, num_attention_heads=4, ffn_hidden_size=96, **base)}


def _tp_case(cfg, groups) -> dict:
    """Relative errors of the float32 tp model's logits and gradients against the float64 one-process model."""
    import dataclasses

    from omnitron.core.models.gpt import GPTModel, allreduce_sequence_parallel_grads, gather_full_state
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.parallel.tensor.mappings import gather_last
    from omnitron.testing.parity import reference_kernels, relative_error

    single = ParallelGroups.single()
    tp = GPTModel(cfg, groups, seed=5)
    ref = GPTModel(dataclasses.replace(cfg, params_dtype=torch.float64), single, seed=5)
    ref.load_state_dict(GPTModel(cfg, single, seed=5).state_dict())  # the float32 weights, exactly, in float64
    gen = torch.Generator().manual_seed(2)
    tokens, labels = (torch.randint(0, cfg.vocab_size, (3, cfg.seq_length), generator=gen) for _ in range(2))
    with torch.no_grad():
        logits = gather_last(tp(tokens), groups.tp)[..., :cfg.vocab_size]
    tp(tokens, labels=labels).mean().backward()
    allreduce_sequence_parallel_grads(tp, groups)
    with reference_kernels():
        with torch.no_grad():
            want = ref(tokens)[..., :cfg.vocab_size]
        ref(tokens, labels=labels).mean().backward()
    g_tp, g_ref = gather_full_state(tp, groups, grads=True), gather_full_state(ref, single, grads=True)
    return {"logits": relative_error(logits, want),
            "grads": max(relative_error(g_tp[k], g_ref[k]) for k in g_ref), "keys": g_tp.keys() == g_ref.keys()}


def _tp_worker() -> dict:
    from omnitron.backends import get_backend
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups

    torch.set_num_threads(1)
    spy = count_kernel_calls()
    groups = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True),
                                  backend=get_backend())
    out = {name: _tp_case(cfg, groups) for name, cfg in _tp_configs().items()}
    out["calls"] = dict(spy.calls)
    return out


def test_tensor_sequence_parallel_fast_kernels():
    """tp2 + SP, float32 on the C++ kernels (rms_norm / layer_norm on sequence shards, swiglu on tp-split
    columns, rope), against the float64 one-process model: TP32_TOL's analysis."""
    for rank, res in enumerate(run_distributed(_tp_worker, 2, backend="cpu")):
        calls = res.pop("calls")
        for kernel in ("rms_norm_fwd", "rms_norm_bwd", "layer_norm_fwd", "layer_norm_bwd", "glu_fwd", "glu_bwd",
                       "rope_apply"):
            assert calls.get(kernel, 0) > 0, (rank, kernel, calls)
        for name, err in res.items():
            assert err.pop("keys"), (name, "gradient names differ")
            assert max(err.values()) < TP32_TOL, (name, rank, err)


# ---- context parallelism: the C++ rope at a cp rank's load-balanced positions ---------------------------------------
def _cp_case(groups) -> dict:
    """cp2, float32 on the C++ kernels, against the float64 one-process model: per-token losses at this rank's
    positions and the cp-summed gradients (TP32_TOL: cp merges 2 partial softmaxes over <= 16 keys, no new sums)."""
    import dataclasses

    from omnitron.core.models.gpt import GPTModel, gather_full_state
    from omnitron.core.parallel.context import context_parallel_batch
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.testing.parity import reference_kernels, relative_error

    cfg, single = _tp_configs()["llama_rms_swiglu_rope"], ParallelGroups.single()
    cp = GPTModel(cfg, groups, seed=5)
    ref = GPTModel(dataclasses.replace(cfg, params_dtype=torch.float64), single, seed=5)
    ref.load_state_dict(GPTModel(cfg, single, seed=5).state_dict())  # the float32 weights, exactly, in float64
    gen = torch.Generator().manual_seed(3)
    batch = {k: torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=gen) for k in ("tokens", "labels")}
    local = context_parallel_batch(batch, groups.cp)
    loss = cp(local["tokens"], position_ids=local["position_ids"], labels=local["labels"])
    loss.sum().backward()
    for p in cp.parameters():  # the cp ranks' partial gradients (each rank's tokens' share)
        groups.backend.collectives.all_reduce(p.grad, group=groups.cp.handle)
    with reference_kernels():
        want = ref(batch["tokens"], labels=batch["labels"])
        want.sum().backward()
    g_cp, g_ref = gather_full_state(cp, groups, grads=True), gather_full_state(ref, single, grads=True)
    return {"token_loss": relative_error(loss, want[:, local["position_ids"][0]]),
            "grads": max(relative_error(g_cp[k], g_ref[k]) for k in g_ref), "keys": g_cp.keys() == g_ref.keys(),
            "offset": float(local["position_ids"][0, 0])}


def _cp_worker() -> dict:
    from omnitron.backends import get_backend
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups

    torch.set_num_threads(1)
    spy = count_kernel_calls()
    groups = ParallelGroups.build(ParallelConfig(context_parallel_size=2), backend=get_backend())
    out = _cp_case(groups)
    out["calls"] = dict(spy.calls)
    return out


def test_context_parallel_fast_kernels():
    """cp2, float32: the C++ rope (forward and backward: rope_apply with -sin) at load-balanced chunk positions,
    against the float64 one-process model: TP32_TOL's analysis."""
    results = run_distributed(_cp_worker, 2, backend="cpu")
    assert results[1]["offset"] > 0, "cp rank 1's first chunk must start past position 0"
    for rank, res in enumerate(results):
        calls, offset = res.pop("calls"), res.pop("offset")
        assert calls.get("rope_apply", 0) >= 2 and calls.get("rms_norm_fwd", 0) > 0, (rank, calls)
        assert res.pop("keys"), "gradient names differ"
        assert max(res.values()) < TP32_TOL, (rank, offset, res)
