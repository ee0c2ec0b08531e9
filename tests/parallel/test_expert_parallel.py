"""Expert parallelism against one process, in ONE spawned world of 4 gloo ranks.

(b) The MoE layer (8 experts, top-2, uneven and empty expert groups) under ep 2 / ep 4 with
edp > 1, tp 2 x ep 2 with and without sequence parallelism, tp 2 x ep 1, and expert tensor
parallelism 2 (tp 2 x etp 2 x ep 2 with SP, tp 2 x etp 2 x ep 1 without): outputs, input
gradients, router and expert gradients equal the single-process layer (all experts local) run on
each data-parallel rank's tokens.
(c) A GPT whose MLPs are MoE layers, trained 3 SGD steps with global-norm clipping (data-parallel
wrapper with overlapped bucket reduction) under ep 2 x dp 4 (edp 2), tp 2 x ep 2 with sequence
parallelism and pp 2 x ep 2; and a GPT with the extras (--moe-layer-freq 2: layer 1 dense, a shared
expert, capacity factor 1 with drops, z-loss) under ep 2 x dp 4 and tp 2 x etp 2 x ep 2 with SP:
per-step losses, gradient norms, logged aux loss and final weights equal the single-process run
over the same micro-batches.
The one-process references themselves: the layer against a float64 MoE layer written from the maths, and the
logged aux loss against the routers' losses computed by test_moe's token-by-token reference.

(b) and (c) run in float64 with the reference kernels on both sides, so every layout must equal one process to
TOL (derivation beside it): a layout bug that moves a value by 1e-6, invisible to a float32 bound, fails here.
"""
from __future__ import annotations

import pytest
import torch

from omnitron.core.config import ParallelConfig
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.testing.distributed import REFERENCE_KERNELS, run_distributed
from omnitron.testing.parity import assert_training_matches, reference_kernels
from omnitron.testing.sim import requires_sim

S, B, H, E = 8, 2, 16, 8  # layer test: tokens [S, B, H] per data-parallel rank, 8 experts
STEPS, MBS, M, SEQ, LR, SEED = 3, 2, 2, 16, 1.0, 1234
LAYER_LAYOUTS = [(1, 2, False, 1), (1, 4, False, 1), (2, 2, False, 1), (2, 2, True, 1), (2, 1, True, 1),
                 (2, 2, True, 2), (2, 1, False, 2)]  # (tp, ep, sp, etp)
GPT_LAYOUTS = [(1, 1, 2, False, 1, False), (2, 1, 2, True, 1, False), (1, 2, 2, False, 1, False),
               (1, 1, 2, False, 1, True), (2, 1, 2, True, 2, True)]  # (tp, pp, ep, sp, etp, extras)
SIM_LAYOUT = (1, 1, 2, False, 1, False)  # ep 2 on 2 ranks: experts 0-1 on rank 0, 2-3 on rank 1
# float64, u = 2**-53 = 1.1e-16. A layout differs from one process only in the order of sums: an expert's
# gradient adds the same <= MBS*SEQ*M*dp = 128 token products (layer: <= 4*S*B = 64) in another grouping, tp
# splits contractions of <= 64 terms, the dp / edp all-reduces add 2-4 partial sums where one process adds the
# micro-batches in turn. Reordering n terms moves a sum by <= n u times the sum of their magnitudes: 128 u =
# 1.4e-14 relative to those magnitudes, a few times that relative to a value after sign cancellation
# (sqrt(n) u ~ 1.3e-15 typical). The routing is the same in both: float64 logits (router_dtype keeps the
# model's) err by ~1e-15 against top-k gaps > 1e-4 (test_layer_reference_is_the_plain_float64_layer checks the
# gaps), and capacity drops rank the same scores. Training (c): 3 SGD steps at lr 1, clipped to norm 0.5, move a
# weight by lr x (a gradient error of <= 1e-14 relative) a step, and a weight error feeds the next gradient at
# gain ~1 (the curvature times lr, the clipped step bounding the update): <= 3 x 3 x 1.4e-14 ~ 1.3e-13 after 3
# steps. TOL = 1e-12 leaves a factor ~8 over those worst cases (~100 over typical); absolute TOL / 10 covers
# entries near zero (e.g. the biases of an expert few tokens reach). float32 (u = 6e-8) would need 1e-5.
TOL = 1e-12
EXTRAS = dict(moe_layer_freq=2, moe_shared_expert_intermediate_size=40, moe_expert_capacity_factor=1.0,
              moe_z_loss_coeff=1e-3)


# ---- (b) the layer ------------------------------------------------------------------------
def _layer_config():
    """The MoE layer's model config, float64 (the bound TOL)."""
    from omnitron.core.models.gpt import gpt2_tiny

    return gpt2_tiny(num_layers=1, hidden_size=H, num_attention_heads=2, ffn_hidden_size=24, seq_length=S,
                     max_position_embeddings=S, vocab_size=64, num_experts=E, moe_router_topk=2,
                     moe_ffn_hidden_size=12, moe_aux_loss_coeff=0.1, params_dtype=torch.float64)


def _layer_data(dp: int):
    """Per data-parallel rank: tokens [S, B, H] (a shift makes expert 5 unpopular) and output weights."""
    g = torch.Generator().manual_seed(21)
    return (torch.randn(dp, S, B, H, generator=g, dtype=torch.float64) + 0.7,
            torch.randn(dp, S, B, H, generator=g, dtype=torch.float64))


def _build_layer(groups, sp: bool):
    from omnitron.backends import get_backend
    from omnitron.core.parallel.tensor import mappings as M
    from omnitron.core.parallel.tensor.sharding import full_shape, init_full, shard_param
    from omnitron.core.transformer.moe import MoELayer

    layer = MoELayer(_layer_config(), groups=groups, sequence_parallel=sp, backend=get_backend(), out_std=0.02)
    etp = groups.etp
    with torch.no_grad():
        for name, p in layer.named_parameters():  # names are global: the same values in every layout
            full = init_full(name, full_shape(p, etp.size), ("normal", 0.3), SEED)
            p.copy_(shard_param(full, p, etp.size, M.local_rank(etp)))  # etp shards of the experts
        layer.router.weight[5] -= 0.5  # expert 5: few or no tokens on some ranks
    return layer


def _layer_grads(layer) -> dict[str, torch.Tensor]:
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).clone() for n, p in layer.named_parameters()}


def layer_reference(dp: int) -> dict:
    """One process, all experts: each data-parallel rank's tokens through the layer; grads summed."""
    layer = _build_layer(ParallelGroups.single(), sp=False)
    xs, ws = _layer_data(dp)
    xs.requires_grad_(True)
    ys = [layer(xs[d])[0] for d in range(dp)]
    sum((y * w).sum() for y, w in zip(ys, ws)).backward()
    return {"y": torch.stack(ys).detach(), "dx": xs.grad.clone(), "grads": _layer_grads(layer),
            "aux": layer.aux_loss_total.item()}


def _layer_run(coll, tp: int, ep: int, sp: bool, etp: int) -> dict:
    from omnitron.core.parallel.tensor import mappings as M
    from omnitron.core.parallel.tensor.sharding import gather_param

    groups = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                                 expert_tensor_parallel_size=etp, sequence_parallel=sp), coll)
    from omnitron.backends import get_backend
    from omnitron.core.parallel.tensor.sharding import to_device

    dev = get_backend().device()  # the backend under test (the reference stays on the host)
    layer = to_device(_build_layer(groups, sp and tp > 1), dev)
    xs, ws = _layer_data(groups.dp.size)
    d = M.local_rank(groups.dp)
    x, w = xs[d].to(dev), ws[d].to(dev)
    if sp and tp > 1:
        x, w = M.split_first(x, groups.tp), M.split_first(w, groups.tp)
    x = x.clone().requires_grad_(True)
    y, _ = layer(x)
    (y * w).sum().backward()
    grads = _layer_grads(layer)
    router = {k: grads.pop(k) for k in [k for k in grads if k.startswith("router.")]}  # weight, and bias (biases on)
    for group in ((groups.tp,) if sp and tp > 1 else ()) + (groups.dp_cp,):  # router: partial over tokens
        router = {k: M.all_reduce(g, group) for k, g in router.items()}
    params = dict(layer.named_parameters())
    for name, g in grads.items():  # experts: summed over the ranks holding the same experts, etp shards merged
        if groups.edp.handle is not None:
            coll.all_reduce(g, group=groups.edp.handle)
        grads[name] = gather_param(g, params[name], groups.etp)
    layer.fuse_full_state("", grads)  # every rank gets all experts' gradients
    return {"y": y.detach(), "dx": x.grad, "router": router, "experts": grads, "dp": d, "tp": M.local_rank(groups.tp),
            "aux": layer.aux_loss_total.item()}


# ---- (c) GPT training -----------------------------------------------------------------------
def _gpt_config(extras: bool = False, dtype: torch.dtype = torch.float32):
    """The MoE GPT's config in ``dtype`` (float64 for the layout parity, float32 for test_expert_fp8's runs)."""
    from omnitron.core.models.gpt import gpt2_tiny

    return gpt2_tiny(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=SEQ,
                     max_position_embeddings=SEQ, vocab_size=96, hidden_dropout=0.0, attention_dropout=0.0,
                     num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_aux_loss_coeff=0.05,
                     params_dtype=dtype, **(EXTRAS if extras else {}))


def _gpt_data(dp: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 96, (STEPS, MBS * M * dp, SEQ + 1), generator=g)


def _optimizer(named, groups):
    from omnitron.backends import get_backend
    from omnitron.core.config.training import OptimizerConfig
    from omnitron.core.optim import MixedPrecisionOptimizer

    cfg = OptimizerConfig(optimizer="sgd", lr=LR, sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.5)
    dup = [p for _, p in named if getattr(p, "shared_embedding", False)]  # the last stage's tied copy
    return MixedPrecisionOptimizer(named, cfg, groups, backend=get_backend(), duplicates=dup)


def _enable_fp8(model, groups, fp8: str | None) -> None:
    """FP8 GEMMs (recipe ``fp8``, hybrid formats) for every linear but the output layer, experts included."""
    if fp8 is not None:
        from omnitron.core.precision.fp8 import FP8Config, enable_fp8

        # delayed: the max of a 4-step history (not Megatron's default, the most recent amax), so a growing amax
        # rarely saturates: test_expert_fp8's bound models rounding, not clipping
        cfg = FP8Config(fp8_recipe=fp8, fp8_format="hybrid", fp8_amax_history_len=4, fp8_amax_compute_algo="max")
        enable_fp8(model, cfg, groups, num_layers=2)


def gpt_reference(dp: int, extras: bool = False, fp8: str | None = None, dtype: torch.dtype = torch.float32) -> dict:
    """One process; each step runs the dp x M micro-batches in turn, each weighted 1 / (dp x M)."""
    from omnitron.core.models.gpt import GPTModel, gather_full_state
    from omnitron.core.transformer.moe import moe_aux_loss, set_aux_loss_scale

    groups = ParallelGroups.single()
    model = GPTModel(_gpt_config(extras, dtype), groups, seed=SEED)
    _enable_fp8(model, groups, fp8)
    opt = _optimizer(list(model.named_parameters()), groups)
    set_aux_loss_scale([model], 1.0 / (dp * M))
    losses, norms, aux = [], [], []
    for step in _gpt_data(dp):
        opt.zero_grad()
        total = 0.0
        for mb in step.view(-1, MBS, SEQ + 1):
            loss = model(tokens=mb[:, :-1], labels=mb[:, 1:]).mean()
            (loss / (dp * M)).backward()
            total += loss.item() / (dp * M)
        aux.append(moe_aux_loss([model], groups, None, dp * M))
        losses.append(total)
        norms.append(opt.step(LR).grad_norm)
    return {"losses": losses, "norms": norms, "aux": aux, "state": gather_full_state(model, groups)}


def _gpt_iterator(data: torch.Tensor, dp_rank: int, device=None):
    for step in data.to(device):
        for mb in step.view(-1, MBS, SEQ + 1)[dp_rank * M:(dp_rank + 1) * M]:
            yield {"tokens": mb[:, :-1], "labels": mb[:, 1:]}


def _gpt_step(chunk, batch, hidden):
    from omnitron.core.parallel.data import unwrap_model

    m = unwrap_model(chunk)
    return chunk(tokens=batch["tokens"] if m.pre_process else None, hidden=hidden,
                 labels=batch["labels"] if m.post_process else None)


def _gpt_run(coll, tp: int, pp: int, ep: int, sp: bool, etp: int, extras: bool, fp8: str | None = None,
             dtype: torch.dtype = torch.float32) -> dict:
    from omnitron.backends import get_backend
    from omnitron.core.models.gpt import GPTModel, gather_full_state
    from omnitron.core.parallel.tensor.sharding import to_device
    from omnitron.core.parallel.data import DataParallelConfig, DistributedDataParallel, finalize_model_grads
    from omnitron.core.parallel.pipeline import forward_backward
    from omnitron.core.transformer.moe import moe_aux_loss, set_aux_loss_scale

    groups = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                                                 sequence_parallel=sp), coll, backend=get_backend())
    n = 2 // pp
    model = GPTModel(_gpt_config(extras, dtype), groups, pre_process=groups.pp.is_first, post_process=groups.pp.is_last,
                     layer_offset=groups.pp.rank * n if pp > 1 else 0, num_layers=n, seed=SEED)
    dev = get_backend().device()  # the model and data on the backend's device (a no-op on cpu)
    to_device(model, dev)
    _enable_fp8(model, groups, fp8)
    chunk = DistributedDataParallel(model, groups, DataParallelConfig(overlap_grad_reduce=True, bucket_size=4000))
    opt = _optimizer(list(model.named_parameters()), groups)
    set_aux_loss_scale([model], 1.0 / M)  # the data-parallel wrapper averages over dp
    data = _gpt_iterator(_gpt_data(groups.dp.size), groups.dp.rank if groups.dp.size > 1 else 0, dev)
    losses, norms, aux = [], [], []
    for _ in range(STEPS):
        chunk.zero_grad_buffer()
        out = forward_backward("1f1b" if pp > 1 else "none", [chunk], data, groups, num_microbatches=M,
                               seq_length=SEQ, micro_batch_size=MBS, hidden_size=32, forward_step_fn=_gpt_step,
                               dtype=dtype)
        finalize_model_grads([chunk], groups)
        aux.append(moe_aux_loss([model], groups, coll, M))
        losses.append(out["loss"])
        norms.append(opt.step(LR).grad_norm)
    return {"losses": losses, "norms": norms, "aux": aux, "state": gather_full_state(model, groups)}


def expert_parallel_sim_worker() -> dict:
    """ep 2 (dp 2, edp 1) MoE GPT training on this worker's backend (the sim device)."""
    from omnitron.backends import get_backend

    return _gpt_run(get_backend().collectives, *SIM_LAYOUT, dtype=torch.float64)


def expert_parallel_worker() -> dict:
    from omnitron.backends import get_backend

    torch.manual_seed(0)
    coll = get_backend().collectives
    out = {"layer": {k: _layer_run(coll, *k) for k in LAYER_LAYOUTS}}
    out["gpt"] = {k: _gpt_run(coll, *k, dtype=torch.float64) for k in GPT_LAYOUTS}
    return out


# ---- checks -----------------------------------------------------------------------------------
def _check_layer(ranks: list[dict], refs: dict) -> None:
    for (tp, ep, sp, etp) in LAYER_LAYOUTS:
        dp = 4 // tp
        ref = refs[dp]
        for r in ranks:
            res = r["layer"][(tp, ep, sp, etp)]
            d, t = res["dp"], res["tp"]
            y, dx = ref["y"][d], ref["dx"][d]
            if sp and tp > 1:
                y, dx = y.chunk(tp)[t], dx.chunk(tp)[t]
            where = f"tp{tp} ep{ep} sp{sp} etp{etp}"
            torch.testing.assert_close(res["y"], y, rtol=TOL, atol=TOL / 10, msg=lambda m: f"{where} y: {m}")
            torch.testing.assert_close(res["dx"], dx, rtol=TOL, atol=TOL / 10, msg=lambda m: f"{where} dx: {m}")
            assert res["router"].keys() == {k for k in ref["grads"] if k.startswith("router.")}, where
            for name, g in res["router"].items():
                torch.testing.assert_close(g, ref["grads"][name], rtol=TOL, atol=TOL / 10)
            assert res["aux"] == pytest.approx(ref["aux_per_dp"][d], rel=TOL), where
            assert res["experts"].keys() == {k for k in ref["grads"] if k.startswith("experts.")}, where
            for name, g in res["experts"].items():
                torch.testing.assert_close(g, ref["grads"][name], rtol=TOL, atol=TOL / 10,
                                           msg=lambda m: f"{where} {name}: {m}")


def _check_gpt(ranks: list[dict], refs: dict) -> None:
    for key in GPT_LAYOUTS:
        tp, pp, ep, _, _, extras = key
        assert_training_matches([r["gpt"][key] for r in ranks], refs[(4 // (tp * pp), extras)], key, rel=TOL)


def test_expert_parallel_matches_one_process():
    layer_refs = {}
    with reference_kernels():
        for dp in (2, 4):
            layer_refs[dp] = layer_reference(dp)
            layer_refs[dp]["aux_per_dp"] = [layer_reference_aux(dp, d) for d in range(dp)]
        gpt_refs = {key: gpt_reference(*key, dtype=torch.float64)
                    for key in sorted({(4 // (k[0] * k[1]), k[5]) for k in GPT_LAYOUTS})}
    assert len(set(gpt_refs[(4, False)]["losses"])) == STEPS and gpt_refs[(4, False)]["aux"][0] > 0
    assert {"decoder.layers.1.mlp.linear_fc1.weight", "decoder.layers.0.mlp.shared_experts.linear_fc1.weight",
            "decoder.layers.0.mlp.experts.3.linear_fc2.bias"} <= gpt_refs[(4, True)]["state"].keys()
    ranks = run_distributed(expert_parallel_worker, 4, env=REFERENCE_KERNELS)
    _check_layer(ranks, layer_refs)
    _check_gpt(ranks, gpt_refs)


def layer_reference_aux(dp: int, d: int) -> float:
    """The load-balancing loss of data-parallel rank ``d``'s tokens alone (one process)."""
    layer = _build_layer(ParallelGroups.single(), sp=False)
    layer(_layer_data(dp)[0][d])
    return layer.aux_loss_total.item()


def plain_moe_layer(W: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer of ``_layer_config`` written from the maths in float64, token by token for the routing
    (tests/models/test_moe.py's ``_ref_routing``), every token through every expert for the rest: ``(y, aux)``.
    Shares no code with the MoE layer, so it checks what every layout above shares (the one-process reference)."""
    import torch.nn.functional as F

    from tests.models.test_moe import _ref_routing

    c = _layer_config()
    tokens = x.reshape(-1, H)
    logits = tokens @ W["router.weight"].t() + W.get("router.bias", 0.0)
    probs, experts, aux = _ref_routing(logits, c.moe_router_topk, False, c.moe_aux_loss_coeff)
    y = torch.zeros_like(tokens)
    for e in range(E):
        p = f"experts.{e}."
        hdn = F.gelu(tokens @ W[p + "linear_fc1.weight"].t() + W[p + "linear_fc1.bias"], approximate="tanh")
        weight = (probs * (experts == e)).sum(dim=1, keepdim=True)  # [T, 1]: 0 where e is not picked
        y = y + weight * (hdn @ W[p + "linear_fc2.weight"].t() + W[p + "linear_fc2.bias"])
    return y.view_as(x), aux


def test_layer_reference_is_the_plain_float64_layer():
    """``layer_reference`` (the MoE layer, all experts local: the expected values of every layout in
    test_expert_parallel_matches_one_process) against :func:`plain_moe_layer` on the same weights and tokens:
    outputs, input gradients, every parameter gradient (the load-balancing loss's included, at the layer's
    default weight 1) and the logged aux loss. A bug in code every layout shares (the routing, the combine's
    weights, an expert's GEMMs) passes the layout comparison; it fails here."""
    dp = 4
    with reference_kernels():
        ref = layer_reference(dp)
    layer = _build_layer(ParallelGroups.single(), sp=False)
    W = {n: p.detach().double().requires_grad_(True) for n, p in layer.named_parameters()}
    assert {"router.weight", "router.bias", "experts.7.linear_fc2.bias"} <= W.keys() and len(W) == 2 + 4 * E
    xs, ws = _layer_data(dp)
    x = xs.double().requires_grad_(True)
    outs = [plain_moe_layer(W, x[d]) for d in range(dp)]
    sum((y * w.double()).sum() + aux for (y, aux), w in zip(outs, ws)).backward()
    # the routing is the same in both: the router's float64 logits round at ~1e-16, the 2nd and 3rd largest are
    # further apart on every token
    logits = x.detach().reshape(-1, H) @ W["router.weight"].detach().t() + W["router.bias"].detach()
    top3 = logits.topk(3, dim=-1).values
    assert float((top3[:, 1] - top3[:, 2]).min()) > 1e-4
    # float64 against float64 (u = 1.1e-16), the same maths in another order: each compared value is a sum of
    # n <= 4 x 16 x 24 = 1536 products (the gradients of the experts' weights over every rank's tokens; outputs
    # fewer), so reordering moves it by <= n u = 1.7e-13 relative to the sum of magnitudes (sqrt(n) u = 4e-15
    # typical), which cancellation between signs makes a few times the value's norm; tanh-GELU and softmax
    # formulas differ by a few u per element. 1e-12 norm-wise leaves a factor ~2 over the worst case with
    # cancellation 3. Dropped gate weights or a misrouted token move a tensor by > 1e-2; a 1e-6 slip fails.
    def rel(a, b):  # an expert no token reaches (5, see _build_layer): both gradients exactly 0
        return float((a.double() - b).norm() / b.norm()) if b.norm() > 0 else float(a.abs().max())

    assert rel(ref["y"], torch.stack([y for y, _ in outs]).detach()) < 1e-12
    assert rel(ref["dx"], x.grad) < 1e-12
    for name, w in W.items():
        assert rel(ref["grads"][name], w.grad) < 1e-12, name
    assert ref["aux"] == pytest.approx(float(sum(aux.detach() for _, aux in outs)), rel=1e-12)


def test_logged_aux_loss_is_the_routers_losses_averaged():
    """The aux loss every layout above logs (``moe_aux_loss``, compared there only with itself at one process)
    against its definition: the load-balancing losses of every MoE layer summed, averaged over the step's
    micro-batches, each computed from the router's input by the token-by-token float64 reference of
    tests/models/test_moe.py. A logged value scaled or averaged wrongly passed every layout comparison."""
    from omnitron.core.models.gpt import GPTModel
    from omnitron.core.transformer.moe import moe_aux_loss
    from tests.models.test_moe import _ref_routing

    groups, c = ParallelGroups.single(), _gpt_config()
    model = GPTModel(c, groups, seed=SEED)
    seen = []  # (router, its input tokens [T, h]) for every MoE layer of every micro-batch
    routers = [m for n, m in model.named_modules() if n.endswith("mlp.router")]
    assert len(routers) == c.num_layers
    for r in routers:
        r.register_forward_pre_hook(lambda mod, args: seen.append((mod, args[0].detach().double())))
    mbs = _gpt_data(2)[0].view(-1, MBS, SEQ + 1)  # one step's 4 micro-batches
    for mb in mbs:
        model(tokens=mb[:, :-1], labels=mb[:, 1:]).mean().backward()
    got = moe_aux_loss([model], groups, None, len(mbs))
    want = sum(_ref_routing(x @ r.weight.detach().double().t() + r.bias.detach().double(), c.moe_router_topk, False,
                            c.moe_aux_loss_coeff)[2] for r, x in seen) / len(mbs)
    assert len(seen) == len(mbs) * c.num_layers
    # fp32 router logits (rounding ~1e-7 relative) through a softmax and a mean over 32 tokens: ~1e-6 relative
    assert got == pytest.approx(float(want), rel=1e-5), (got, float(want))


@requires_sim()
def test_expert_parallel_training_on_sim_matches_one_cpu_process():
    """The MoE GPT under ep 2 on the sim device (token dispatch by all-to-all over simccl, device-side
    routing with data-dependent shapes) against the one-process cpu run over the same micro-batches."""
    with reference_kernels():
        ref = gpt_reference(2, dtype=torch.float64)
    ranks = run_distributed(expert_parallel_sim_worker, 2, backend="sim", env=REFERENCE_KERNELS)
    # float64 with the reference kernels on both devices: the ranks differ from the one process only in the
    # order of sums (TOL's derivation: 128-token expert gradients, the dp all-reduce of two partial sums where
    # the reference accumulates four micro-batches). A misrouted token or a lost expert gradient moves losses
    # by > 1e-3.
    assert_training_matches(ranks, ref, ("sim",) + SIM_LAYOUT, rel=TOL)
