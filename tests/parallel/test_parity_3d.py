"""3D parity: every (tp, pp, dp) layout x pipeline schedule x --overlap-grad-reduce trains the tiny GPT
for 3 SGD steps with the same per-step losses and final weights as one process (gloo; float64 with the
reference kernels, so the comparison is of the parallel maths alone and no CPU's rounding moves it).

One spawned world per world size runs every layout and variant inside it (spawns cost seconds).
"""
import dataclasses

import pytest
import torch

from omnitron.core.config import ParallelConfig
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.core.parallel.tensor.sharding import to_device
from omnitron.testing.distributed import REFERENCE_KERNELS, run_distributed
from omnitron.testing.parity import reference_kernels
from omnitron.testing.sim import requires_sim

STEPS, MBS, M, SEQ, LR, SEED = 3, 2, 4, 16, 0.5, 1234
# float64, u = 1.1e-16. Layouts differ only in the order of sums (tp splits of n <= 64-term contractions,
# the dp/micro-batch gradient sums, pipeline stages change nothing): ~sqrt(n) u ~ 1e-15 relative on losses
# and gradients. An SGD step moves the weights by lr x g, so the weight error grows by lr ||dg|| per step,
# and with the loss's curvature over these weights (lr 0.5 keeps the run stable, so amplification is
# below 1 + lr ||H|| ~ 2 a step) three steps give at most 2^3 x 1e-15 ~ 1e-14. TOL leaves a factor 100.
# Three steps, not more: the second and third already start from weights the layouts updated themselves (a
# wrong gradient, reduction or stage hand-off shows from step 1 on); the steps past the third only cost time.
TOL = 1e-12


def _config(**kw):
    from omnitron.core.models.gpt import gpt2_tiny

    return gpt2_tiny(num_layers=8, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=SEQ,
                     max_position_embeddings=SEQ, vocab_size=96, hidden_dropout=0.0, attention_dropout=0.0,
                     params_dtype=torch.float64, **kw)


def _data(dp: int) -> torch.Tensor:
    """Token ids for every step: [STEPS, global batch, SEQ + 1]."""
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 96, (STEPS, MBS * M * dp, SEQ + 1), generator=g)


def _iterator(data: torch.Tensor, dp_rank: int, device=None):
    for step in data.to(device):
        mine = step.view(-1, MBS, SEQ + 1)[dp_rank * M:(dp_rank + 1) * M]  # this replica's micro-batches
        for mb in mine:
            yield {"tokens": mb[:, :-1], "labels": mb[:, 1:]}


def _gpt_step(chunk, batch, hidden):
    from omnitron.core.parallel.data import unwrap_model

    m = unwrap_model(chunk)
    return chunk(tokens=batch["tokens"] if m.pre_process else None, hidden=hidden,
                 labels=batch["labels"] if m.post_process else None)


def _sgd(chunks) -> None:
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                g = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
                p.add_(g, alpha=-LR)


def reference() -> tuple[list[float], dict]:
    """One process, whole global batch per step (dp=2 data; dp=1 layouts use its first half)."""
    return {dp: train_one_process(_data(dp)) for dp in (1, 2)}


def train_one_process(data: torch.Tensor, cfg=None) -> tuple[list[float], dict]:
    """(per-step losses, full state) of SGD on one process over ``data`` [steps, batch, SEQ + 1]; ``cfg``: the
    model (default: ``_config()``)."""
    from omnitron.core.models.gpt import GPTModel, gather_full_state

    groups = ParallelGroups.single()
    model = GPTModel(cfg or _config(), groups, seed=SEED)
    losses = []
    for step in data:
        model.zero_grad()
        loss = model(tokens=step[:, :-1], labels=step[:, 1:]).mean()
        loss.backward()
        losses.append(loss.item())
        _sgd([model])
    return losses, gather_full_state(model, groups)


def _variants(pp: int, tp: int):
    scheds = ["none"] if pp == 1 else ["1f1b", "interleaved", "zb-h1"]
    out = [(s, ov, False, False) for s in scheds for ov in (False, True)]
    if tp > 1:
        out.append((scheds[0], True, True, False))  # sequence parallel
    if pp == 2 and tp == 1:
        out.append(("zb-h1", True, False, True))  # full activation recompute under the B/W split
    return out


def parity_worker(layouts) -> dict:
    from omnitron.backends import get_backend
    from omnitron.core.models.gpt import GPTModel
    from omnitron.core.parallel.data import DataParallelConfig, DistributedDataParallel
    from omnitron.core.parallel.pipeline import pipeline_layer_ranges

    be = get_backend()
    dev = be.device()  # the model and data on the backend's device (a no-op on cpu)
    results = {}
    for tp, pp, dp in layouts:
        base = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
                                    backend=be)
        for sched, overlap, sp, recompute in _variants(pp, tp):
            vp = 2 if sched == "interleaved" else None
            cfg = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vp, sequence_parallel=sp)
            groups = dataclasses.replace(base, config=cfg)
            ranges = pipeline_layer_ranges(8, pp, vp)
            chunks = []
            for c in range(vp or 1):
                offset, n = ranges[(groups.pp.rank, c)]
                extra = dict(recompute_granularity="full", recompute_method="uniform",
                             recompute_num_layers=1) if recompute else {}
                model = GPTModel(_config(**extra), groups, pre_process=groups.pp.is_first and c == 0,
                                 post_process=groups.pp.is_last and c == (vp or 1) - 1, layer_offset=offset,
                                 num_layers=n, seed=SEED)
                to_device(model, dev)
                chunks.append(DistributedDataParallel(model, groups, DataParallelConfig(
                    overlap_grad_reduce=overlap, bucket_size=3000)))
            losses, state, _ = run_steps(sched, chunks, groups, _iterator(_data(dp)[:1], groups.dp.rank, dev),
                                         _iterator(_data(dp), groups.dp.rank, dev), M, MBS * SEQ * M * dp)
            results[(tp, pp, dp, sched, overlap, sp, recompute)] = (losses, state)
    return results


def run_steps(sched: str, chunks: list, groups, first, batches, m: int, tokens: int) -> tuple:
    """(losses: the forward-only evaluation of ``first`` (the first step's micro-batches: the first step's loss),
    then each of ``STEPS`` SGD steps' over ``batches``; this rank's part of the full state; the schedule) of
    ``chunks`` (data-parallel wrapped) with ``m`` micro-batches a step, each step's ``tokens`` checked."""
    from omnitron.core.models.gpt import gather_full_state
    from omnitron.core.parallel.data import finalize_model_grads
    from omnitron.core.parallel.pipeline import forward_backward

    kw = dict(num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS, hidden_size=32, forward_step_fn=_gpt_step,
              dtype=torch.float64)
    losses = [forward_backward(sched, chunks, first, groups, forward_only=True, **kw)["loss"]]
    for _ in range(STEPS):
        for c in chunks:
            c.zero_grad_buffer()
        out = forward_backward(sched, chunks, batches, groups, **kw)
        assert out["tokens"] == tokens
        finalize_model_grads(chunks, groups)
        _sgd(chunks)
        losses.append(out["loss"])
    state = {}
    for c in chunks:
        state.update({k: v.cpu() for k, v in gather_full_state(c.module, groups).items()})
    return losses, state, out["schedule"]


def _check(results_per_rank, ref) -> None:
    keys = results_per_rank[0].keys()
    for key in keys:
        assert_run_matches(key, [res[key] for res in results_per_rank], *ref[key[2]])


def assert_run_matches(key, per_rank: list, ref_losses: list[float], ref_state: dict, tol: float = TOL) -> None:
    """Every rank's (evaluation + per-step losses, its part of the state) against one process's."""
    merged = {}
    for losses, state in per_rank:
        assert losses == pytest.approx([ref_losses[0]] + ref_losses, rel=tol), (key, losses, ref_losses)
        merged.update(state)
    assert merged.keys() == ref_state.keys(), key
    for name, w in ref_state.items():
        torch.testing.assert_close(merged[name], w, rtol=tol, atol=tol, msg=lambda s: f"{key} {name}: {s}")


@pytest.fixture(scope="module")
def ref():
    torch.manual_seed(0)
    with reference_kernels():
        return reference()


def test_parity_pipeline_2(ref):
    _check(run_distributed(parity_worker, 2, [(1, 2, 1)], env=REFERENCE_KERNELS), ref)


def test_parity_3d_4(ref):
    """tp2 x pp2 and pp2 x dp2 (the suite's budget; pp4 and tp2 x dp2 in the slow variant below)."""
    _check(run_distributed(parity_worker, 4, [(2, 2, 1), (1, 2, 2)], env=REFERENCE_KERNELS), ref)


@pytest.mark.slow
def test_parity_3d_4_every_layout(ref):
    _check(run_distributed(parity_worker, 4, [(1, 4, 1), (2, 2, 1), (1, 2, 2), (2, 1, 2)], env=REFERENCE_KERNELS), ref)


@pytest.mark.slow  # NOTE: sim stays in the default suite through tests/sim (training on sim equals cpu)
@requires_sim()
def test_parity_pipeline_2_on_sim(ref):
    """Every pipeline schedule on the simulated device against the host reference (same tolerance: the
    device runs the same kernels; what it adds is placement, which moves nothing when right)."""
    _check(run_distributed(parity_worker, 2, [(1, 2, 1)], backend="sim", env=REFERENCE_KERNELS), ref)


@pytest.mark.slow
@requires_sim()
def test_parity_3d_4_on_sim(ref):
    _check(run_distributed(parity_worker, 4, [(1, 4, 1), (2, 2, 1), (1, 2, 2), (2, 1, 2)], backend="sim",
                           env=REFERENCE_KERNELS), ref)


@pytest.mark.slow
def test_parity_3d_8(ref):
    _check(run_distributed(parity_worker, 8, [(2, 2, 2)], timeout_s=600, env=REFERENCE_KERNELS), ref)
