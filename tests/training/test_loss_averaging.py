"""Loss and gradient averaging of one training step (``train_step``: schedule, data-parallel reduction,
``--calculate-per-token-loss`` scaling, clipping) against one process in float64, with loss masks as uneven as
they get: micro-batches with every token, a few, exactly one, and none.

The reference is the definition, computed here on the step's own micro-batches with the layout's initial
weights: the default loss is the mean over the global batch's micro-batches of each one's masked token mean
(a fully masked one contributes 0), the per-token loss the sum over every loss token divided by their count;
its gradients come from autograd on that one float64 graph. A one-token micro-batch under context parallelism
(fewer loss tokens than cp ranks) once had its mean halved there.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from omnitron.testing.distributed import REFERENCE_KERNELS, run_distributed
from omnitron.testing.parity import reference_kernels

# float64 with the reference kernels: a layout differs from one process only in the order of its sums (cp's
# split softmax, the dp x cp gradient sum, the per-token rescale by dp x cp / tokens), each ~sqrt(n) u ~ 1e-15
# relative on the loss and on every gradient (relative to the tensor's largest element). GRAD_TOL leaves 1000x.
GRAD_TOL = 1e-12
# the optimizer reports the norm of its float32 copies of the gradients: each element rounded (2^-24 relative)
# and the squares summed in float32 (pairwise, log2(3e4) ~ 15 rounding steps of 2^-24): < 16 x 6e-8 ~ 1e-6.
NORM_TOL = 1e-6
BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
        "--seq-length", "16", "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "100", "--num-workers", "0", "--train-iters", "1", "--lr", "1e-3", "--optimizer", "sgd",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--no-tensorboard", "--seed", "1234",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--eod-mask-loss", "--clip-grad", "1.0"]


def uneven_mask(like: torch.Tensor, dp_rank: int, mb: int) -> torch.Tensor:
    """A loss mask for micro-batch ``mb`` of data-parallel rank ``dp_rank``: all tokens, exactly one, none, or a
    random 20% / 70% of them (the kind cycles over ranks and micro-batches)."""
    g = torch.Generator().manual_seed(1000 * dp_rank + mb)
    kind = (3 * dp_rank + mb) % 5
    if kind in (0, 2):
        return torch.full_like(like, float(kind == 0))
    if kind == 1:
        m = torch.zeros_like(like)
        m.view(-1)[int(torch.randint(0, like.numel(), (1,), generator=g))] = 1
        return m
    return (torch.rand(like.shape, generator=g) < (0.2 if kind == 3 else 0.7)).to(like.dtype)


def _full(modules, groups, grads: dict | None = None) -> dict:
    """The full (tp-gathered) float64 tensors of this rank's chunks: parameters, or ``grads`` (by param id)."""
    from omnitron.core.models.gpt import gather_full_state

    out = {}
    for m in modules:
        saved = {id(p): getattr(p, "main_grad", None) for p in m.parameters()}
        if grads is not None:
            for p in m.parameters():
                p.main_grad = grads[id(p)]
        st = gather_full_state(m, groups, grads=grads is not None)
        for p in m.parameters():
            p.main_grad = saved[id(p)]
        out.update({k: v.detach().to("cpu", torch.float64, copy=True) for k, v in st.items()})
    return out


def _owned_grads(optimizer) -> dict:
    """Every optimized parameter's reduced gradient (float64), nan where this rank does not hold it (the
    distributed optimizer owns slices)."""
    slices = getattr(optimizer, "slices", None)
    out = {}
    for i, p in enumerate(optimizer.params):
        g = p.main_grad.detach().to(torch.float64, copy=True)
        if slices is not None:
            owned = torch.zeros(g.numel(), dtype=torch.bool, device=g.device)
            for s in (s for s in slices if s.param == i):
                owned[s.lo:s.hi] = True
            g = g.view(-1).masked_fill(~owned, math.nan).view(p.shape)
        out[id(p)] = g
    return out


def step_worker(layouts: list[list[str]]) -> list[dict]:
    """Per layout: one ``train_step`` in float64; the initial weights, the reduced gradients the optimizer
    receives, the logged loss and grad norm, and the micro-batches read (whole, before any cp slicing)."""
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.components import build_components
    from omnitron.core.training.loop import data_iterator
    from omnitron.core.training.step import train_step

    torch.set_num_threads(1)
    results = []
    for extra in layouts:
        s = parse_settings([*BASE, *extra], dist.get_world_size())
        s = dataclasses.replace(s, model=dataclasses.replace(s.model, params_dtype=torch.float64))
        c = build_components(s, get_backend())
        dp_rank = c.groups.dp.rank if c.groups.dp.size > 1 else 0
        init, read, got = _full(c.modules, c.groups), [], {}

        def batches(it=data_iterator(c, c.train_data, 0), read=read, dp_rank=dp_rank):
            for i, b in enumerate(it):
                mask = uneven_mask(b["loss_mask"].cpu(), dp_rank, i).to(b["loss_mask"].device)
                b = {**b, "loss_mask": b["loss_mask"] * mask}
                read.append({k: v.cpu() for k, v in b.items()})
                yield b

        step = c.optimizer.step

        def capture(*a, step=step, c=c, got=got, **kw):
            got["grads"] = _full(c.modules, c.groups, _owned_grads(c.optimizer))
            return step(*a, **kw)

        c.optimizer.step = capture
        out = train_step(c, batches())
        results.append({"init": init, "grads": got["grads"], "loss": out["lm_loss"], "norm": out["grad_norm"],
                        "batches": read, "dp_rank": dp_rank})
    return results


def reference(per_rank: list[dict], extra: list[str]) -> tuple[float, dict, float]:
    """(loss, full gradients, their norm) of one float64 process on the micro-batches the layout (``extra``, on
    ``len(per_rank)`` ranks) read."""
    from omnitron.core.models.gpt import GPTModel, gather_full_state, shard_full_state
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.training.arguments import parse_settings

    single = ParallelGroups.single()
    init = {k: v for r in per_rank for k, v in r["init"].items()}
    cfg = dataclasses.replace(parse_settings([*BASE, *extra], len(per_rank)).model, params_dtype=torch.float64,
                              vocab_size=init["embedding.word_embeddings.weight"].shape[0])
    model = GPTModel(cfg, single, seed=0)
    shard_full_state(model, init, single)
    by_dp = {r["dp_rank"]: r["batches"] for r in per_rank if r["batches"]}
    sums, counts = [], []
    for b in (b for d in sorted(by_dp) for b in by_dp[d]):
        # Megatron's GPTModel: RoPE turns at the sequence positions; --reset-position-ids restarts the learned ones
        pos = None if cfg.position_embedding_type == "rope" else b["position_ids"]
        loss = model(tokens=b["tokens"], position_ids=pos, labels=b["labels"]).double()
        sums.append((loss * b["loss_mask"].double()).sum())
        counts.append(b["loss_mask"].double().sum())
    if "--calculate-per-token-loss" in extra:
        total = sum(sums) / sum(counts)
    else:
        total = sum(sm / c if c > 0 else sm for sm, c in zip(sums, counts)) / len(sums)
    total.backward()
    grads = gather_full_state(model, single, grads=True)
    return total.item(), grads, math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))


def check_step(per_rank: list[dict], extra: list[str], name: str) -> None:
    """Every rank's logged loss and grad norm, and the gradients merged over ranks, against :func:`reference`."""
    with reference_kernels():
        loss, grads, norm = reference(per_rank, extra)
    assert sum(1 for r in per_rank for b in r["batches"] if b["loss_mask"].sum() == 1), "a one-token micro-batch"
    merged: dict[str, torch.Tensor] = {}
    for r in per_rank:
        for k, g in r["grads"].items():
            if k in merged:
                merged[k] = torch.where(torch.isnan(merged[k]), g, merged[k])
            else:
                merged[k] = g
        assert r["loss"] == pytest.approx(loss, rel=GRAD_TOL), (name, r["loss"], loss)
        assert r["norm"] == pytest.approx(norm, rel=NORM_TOL), (name, r["norm"], norm)
    assert merged.keys() == grads.keys(), name
    for k, want in grads.items():
        err = ((merged[k] - want).abs().max() / want.abs().max()).item()
        assert err <= GRAD_TOL, (name, k, err)  # a nan (an element no rank holds) fails here too


LAYOUTS_2 = {"cp2": ["--context-parallel-size", "2"],
             "cp2 per-token": ["--context-parallel-size", "2", "--calculate-per-token-loss"],
             # reduce-scatter into the distributed optimizer's shards, buckets launched from the backward hooks
             "dp2 distributed optimizer per-token": ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                                     "--ddp-bucket-size", "1000", "--calculate-per-token-loss"],
             # both tied embedding copies on one rank (the V), deferred weight gradients
             "pp2 zb-v": ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-v",
                          "--num-layers-per-virtual-pipeline-stage", "1"],
             # restarted positions (eods about every 64 tokens): the second stage's RoPE once turned at 0..s-1 while
             # the first's turned at the restarted positions
             "pp2 rope --reset-position-ids": ["--pipeline-model-parallel-size", "2", "--position-embedding-type",
                                               "rope", "--reset-position-ids", "--seq-length", "128",
                                               "--max-position-embeddings", "128"]}


def test_step_loss_and_gradients_match_one_process():
    per_rank = run_distributed(step_worker, 2, list(LAYOUTS_2.values()), env=REFERENCE_KERNELS, timeout_s=600)
    for i, name in enumerate(LAYOUTS_2):
        check_step([r[i] for r in per_rank], LAYOUTS_2[name], name)
    restarted = [b["position_ids"] for b in per_rank[0][-1]["batches"]]
    assert any((p != torch.arange(p.shape[1])).any() for p in restarted), "some positions restart"


_V = ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
      "--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "1000"]
LAYOUTS_4 = {  # dp2 x pp2, the V schedules: the distributed optimizer's buckets launched from the hooks W fires
    "zb-v": [*_V, "--pipeline-schedule", "zb-v"],
    "dualpipe-v full recompute": [*_V, "--pipeline-schedule", "dualpipe-v", "--global-batch-size", "16",
                                  "--recompute-granularity", "full", "--recompute-method", "uniform",
                                  "--recompute-num-layers", "1"],
    "zb-v moe selective": [*_V, "--pipeline-schedule", "zb-v", "--num-experts", "4", "--moe-router-topk", "2",
                           "--recompute-granularity", "selective"]}


@pytest.mark.slow
def test_v_schedules_at_dp2_step_match_one_process():
    """A weight gradient is complete only after its W: the reduce-scatter of a bucket must wait for it."""
    per_rank = run_distributed(step_worker, 4, list(LAYOUTS_4.values()), env=REFERENCE_KERNELS, timeout_s=600)
    for i, name in enumerate(LAYOUTS_4):
        check_step([r[i] for r in per_rank], LAYOUTS_4[name], name)


def test_per_token_step_without_loss_tokens():
    """A global batch whose every loss mask is 0 (all prompt, in SFT terms): its loss sum and every gradient are 0.
    Per token the step and an evaluation of such batches log 0 with a zero gradient norm, as the default mean does
    (they stopped on a bare ZeroDivisionError, the logged loss's 0 / 0 tokens)."""
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.components import build_components
    from omnitron.core.training.loop import data_iterator
    from omnitron.core.training.step import evaluate, train_step

    c = build_components(parse_settings([*BASE, "--calculate-per-token-loss"], 1), get_backend())

    def masked_out():
        for b in data_iterator(c, c.train_data, 0):
            yield {**b, "loss_mask": torch.zeros_like(b["loss_mask"])}

    out = train_step(c, masked_out())
    assert (out["lm_loss"], out["grad_norm"]) == (0.0, 0.0)
    assert evaluate(c, masked_out(), 1)["val_loss"] == 0.0
