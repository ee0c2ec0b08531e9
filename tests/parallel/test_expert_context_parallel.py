"""MoE with context parallelism against one process, in ONE spawned world of 4 gloo ranks.

A GPT whose MLPs are MoE layers (aux loss, z-loss, a shared expert), trained 3 SGD steps with
global-norm clipping (data-parallel wrapper with overlapped bucket reduction) under cp 2 x ep 2 x
dp 2 (the ep group is the cp group, edp 2), cp 2 x ep 4 x dp 2 (ep spans cp and dp, edp 1) and
tp 2 x cp 2 x ep 2 with sequence parallelism (router statistics over tp x cp): per-step losses,
gradient norms, logged aux loss and final weights equal the single-process run over the same
micro-batches. Then the training loop (``omnitron train`` flags, step.py) at cp 2 x ep 2 x dp 2 with the
distributed optimizer: per-iteration and validation losses equal the one-process loop's. Everything in float64
with the reference kernels on both sides, to TOL.
"""
from __future__ import annotations

import pytest
import torch

from omnitron.core.config import ParallelConfig
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.testing.distributed import REFERENCE_KERNELS, run_distributed
from omnitron.testing.parity import assert_training_matches, reference_kernels

STEPS, MBS, GBS, SEQ, LR, SEED = 3, 2, 4, 16, 1.0, 1234
LAYOUTS = [(1, 2, 2, False), (1, 2, 4, False), (2, 2, 2, True)]  # (tp, cp, ep, sp)
# float64, u = 2**-53 = 1.1e-16: the analyses of test_expert_parallel's TOL (experts' token sums in another grouping,
# 3 SGD steps at lr 1 clipped to 0.5) and test_context_parallel's (cp's <= 2 partial softmaxes merged, cp's loss
# from the ranks' token sums) add: <= ~1e-13 relative after 3 steps (the loop: 4 iterations, test_context_parallel's
# 4.5e-13). TOL = 1e-12 leaves a factor >= 2 over the worst cases; a float32 run needed 1e-5.
TOL = 1e-12


def _config():
    from omnitron.core.models.gpt import gpt2_tiny

    return gpt2_tiny(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=SEQ,
                     max_position_embeddings=SEQ, vocab_size=96, hidden_dropout=0.0, attention_dropout=0.0,
                     num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_aux_loss_coeff=0.05,
                     moe_z_loss_coeff=1e-2, moe_shared_expert_intermediate_size=40, params_dtype=torch.float64)


def _data() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 96, (STEPS, GBS, SEQ + 1), generator=g)


def _optimizer(model, groups):
    from omnitron.backends import get_backend
    from omnitron.core.config.training import OptimizerConfig
    from omnitron.core.optim import MixedPrecisionOptimizer

    cfg = OptimizerConfig(optimizer="sgd", lr=LR, sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.5)
    return MixedPrecisionOptimizer(list(model.named_parameters()), cfg, groups, backend=get_backend())


def reference() -> dict:
    """One process; each step runs the GBS / MBS micro-batches in turn, each weighted MBS / GBS."""
    from omnitron.core.models.gpt import GPTModel, gather_full_state
    from omnitron.core.transformer.moe import moe_aux_loss, set_aux_loss_scale

    groups = ParallelGroups.single()
    model = GPTModel(_config(), groups, seed=SEED)
    opt = _optimizer(model, groups)
    n = GBS // MBS
    set_aux_loss_scale([model], 1.0 / n)
    losses, norms, aux = [], [], []
    for step in _data():
        opt.zero_grad()
        total = 0.0
        for mb in step.view(-1, MBS, SEQ + 1):
            loss = model(tokens=mb[:, :-1], labels=mb[:, 1:]).mean()
            (loss / n).backward()
            total += loss.item() / n
        aux.append(moe_aux_loss([model], groups, None, n))
        losses.append(total)
        norms.append(opt.step(LR).grad_norm)
    return {"losses": losses, "norms": norms, "aux": aux, "state": gather_full_state(model, groups)}


def _step(chunk, batch, hidden):
    from omnitron.core.parallel.data import unwrap_model

    m = unwrap_model(chunk)
    return chunk(tokens=batch["tokens"], position_ids=batch["position_ids"], hidden=hidden,
                 labels=batch["labels"] if m.post_process else None)


def _loss(output, batch):
    from omnitron.core.parallel.context import context_parallel_loss
    from omnitron.core.parallel.pipeline import default_loss_fn

    return context_parallel_loss(*default_loss_fn(output, batch), batch)


def _run(coll, tp: int, cp: int, ep: int, sp: bool) -> dict:
    from omnitron.core.models.gpt import GPTModel, gather_full_state
    from omnitron.core.parallel.context import context_parallel_batch
    from omnitron.core.parallel.data import DataParallelConfig, DistributedDataParallel, finalize_model_grads
    from omnitron.core.parallel.pipeline import forward_backward
    from omnitron.core.transformer.moe import moe_aux_loss, set_aux_loss_scale

    from omnitron.backends import get_backend
    from omnitron.core.parallel.tensor.sharding import to_device

    be = get_backend()  # the backend under test (coll's): the model and batches on its device
    groups = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                                 expert_model_parallel_size=ep, sequence_parallel=sp), coll, backend=be)
    model = to_device(GPTModel(_config(), groups, seed=SEED), be.device())
    chunk = DistributedDataParallel(model, groups, DataParallelConfig(overlap_grad_reduce=True, bucket_size=4000))
    opt = _optimizer(model, groups)
    dp = groups.dp.size
    per_dp = GBS // dp
    m = per_dp // MBS
    set_aux_loss_scale([model], 1.0 / m)  # the data-parallel wrapper averages over dp (x cp)
    lo = (groups.dp.rank if dp > 1 else 0) * per_dp
    losses, norms, aux = [], [], []
    for step in _data():
        chunk.zero_grad_buffer()
        mbs = step[lo:lo + per_dp].view(-1, MBS, SEQ + 1).to(be.device())
        data = (context_parallel_batch({"tokens": mb[:, :-1], "labels": mb[:, 1:]}, groups.cp) for mb in mbs)
        out = forward_backward(None, [chunk], data, groups, num_microbatches=m, seq_length=SEQ,
                               micro_batch_size=MBS, hidden_size=32, forward_step_fn=_step, loss_fn=_loss,
                               dtype=torch.float64)
        finalize_model_grads([chunk], groups)
        aux.append(moe_aux_loss([model], groups, coll, m))
        losses.append(out["loss"])
        norms.append(opt.step(LR).grad_norm)
    return {"losses": losses, "norms": norms, "aux": aux, "state": gather_full_state(model, groups)}


MOE_FLAGS = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.05",
             "--moe-z-loss-coeff", "0.01"]
LOOP_FLAGS = ["--context-parallel-size", "2", "--expert-model-parallel-size", "2", "--use-distributed-optimizer"]


def _loop(root: str, world: int, *extra: str):
    from test_context_parallel import _train, _train_args

    from omnitron.backends import get_backend

    # workers: the backend under test; the one-process reference: cpu (this process has run a backward before
    # any device was loaded, and autograd sizes its device queues at the first backward)
    return _train(_train_args(root, *MOE_FLAGS, *extra), world, get_backend().name if world > 1 else "cpu",
                  torch.float64)


def worker(root: str) -> dict:
    from omnitron.backends import get_backend

    torch.set_num_threads(1)
    coll = get_backend().collectives
    out = {k: _run(coll, *k) for k in LAYOUTS}
    out["loop"] = _loop(root, 4, *LOOP_FLAGS)
    return out


def test_moe_context_parallel_matches_one_process(tmp_path):
    torch.set_num_threads(1)
    with reference_kernels():
        ref = reference()
        loop_ref = _loop(str(tmp_path / "one"), 1)
    assert len(set(ref["losses"])) == STEPS and ref["aux"][0] > 0
    ranks = run_distributed(worker, 4, str(tmp_path / "cp"), env=REFERENCE_KERNELS)
    for got in (ranks[0]["loop"], ranks[-1]["loop"]):
        assert got[0] == pytest.approx(loop_ref[0], rel=TOL) and got[1] == pytest.approx(loop_ref[1], rel=TOL)
    for key in LAYOUTS:
        assert_training_matches([r[key] for r in ranks], ref, key, rel=TOL)


def test_moe_context_parallel_refuses_capacity():
    from omnitron.core.config.parallel import ConfigError
    from omnitron.core.transformer.moe import validate_moe

    c = _config()
    c = type(c)(**{**c.__dict__, "moe_expert_capacity_factor": 1.0})
    with pytest.raises(ConfigError, match="--moe-expert-capacity-factor"):
        validate_moe(c, ParallelConfig(context_parallel_size=2, expert_model_parallel_size=2))
