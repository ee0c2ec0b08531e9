"""``--use-torch-fsdp2`` (:mod:`omnitron.core.parallel.data.fsdp`): the path users run (``omnitron train``:
parse_settings + train, so every step goes through the pipeline schedule, FSDP2's all-gathers and
reduce-scatters, the finalize step, the sharded optimizer, clipping by the global norm) at dp4, tp2 x dp2
and pp2 x dp2 against the same command on one process without FSDP2; the final weights and optimizer state
are compared through each run's torch_dist checkpoint (read back as full tensors). Also: resume is
bit-exact, each rank holds ~1/dp of the state, and the combinations that cannot work are refused.

The model: 2 layers, hidden 32, GQA, RoPE, RMSNorm, SwiGLU (a partition stride), tied embeddings (across
the two stages at pp2), global batch 8 in micro-batches of 2 (two micro-batches per replica at dp2, so the
gradients accumulate unsharded before the one reduce-scatter of the step), 3 steps, fp32.
"""
from __future__ import annotations

import math

import pytest
import torch

from omnitron.core.config.parallel import ConfigError
from omnitron.testing.distributed import run_distributed

STEPS = 3
LR = 0.05

# fp32, u = 2^-24 = 6e-8. The layouts differ only in the order of sums (tp splits of n <= 128-term
# contractions, FSDP's fp32 reduce-scatter over dp against one process's sum over the batch, the micro-batch
# accumulation): ~sqrt(n) u = d = 7e-7 relative on the loss and on each gradient entry (random-rounding
# model). SGD with momentum 0.9 and clipping at 1.0: each step moves the weights by lr x buf, buf a sum of
# <= 3 clipped gradients (||g|| <= 1, clip factor relative error d), so the weights' absolute error after 3
# steps is <= lr x (1 + 2 + 3) x d x max|g_i| <= 0.05 x 6 x 7e-7 = 2.1e-7 (|g_i| <= ||g|| <= 1), the momentum
# buffers' <= 6 x d = 4.2e-6 ... relative to entries of size <= 1: ATOL 1e-5 on buffers, 1e-6 on weights.
# The loss after those updates moves by |dL| <= ||g||_2 ||dw||_2 <= sqrt(N) x 2.1e-7 (N = 2.8e4 parameters)
# = 3.5e-5 absolute on a loss of ~4.6, i.e. 7.6e-6 relative at most; REL = 1e-5 per step. A layout bug (a
# missing or doubled reduction, a shard in the wrong rows) moves the first step's update by O(lr) = 5e-2.
REL, W_ATOL, BUF_ATOL = 1e-5, 1e-6, 1e-5


def _argv(root: str, *extra: str) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
            "--ffn-hidden-size", "64", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
            "--seq-length", "16", "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "100", "--num-workers", "0", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--train-iters", str(STEPS), "--eval-interval", "0",
            "--optimizer", "sgd", "--sgd-momentum", "0.9", "--lr", str(LR), "--clip-grad", "1.0",
            "--weight-decay", "0.01", "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
            "--no-tensorboard", "--data-cache-path", root + "/cache", "--seed", "1234", "--save", root + "/ckpt",
            "--save-interval", str(STEPS), *extra]


def _train(root: str, world: int, *extra: str) -> tuple[list[float], float]:
    """Per-step losses and the final weights' global norm (``--log-params-norm``'s)."""
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import params_norm, train

    torch.set_num_threads(1)
    res = train(parse_settings(_argv(root, *extra), world), get_backend())
    return [res["losses"][i] for i in sorted(res["losses"])], params_norm(res["components"])


def _final(root: str):
    from omnitron.core.checkpoint import find_latest, reshard

    return reshard.read_full_state(find_latest(root + "/ckpt"))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("one"))
    losses, norm = _train(root, 1)
    assert len(losses) == STEPS and len(set(losses)) == STEPS
    return losses, norm, _final(root)


def _check_parity(one_process, root: str, world: int, *layout: str) -> None:
    ref_losses, ref_norm, ref = one_process
    ranks = run_distributed(_train, world, root, world, "--use-torch-fsdp2", *layout, timeout_s=600)
    for rank, (losses, norm) in enumerate(ranks):
        assert losses == pytest.approx(ref_losses, rel=REL), (rank, losses, ref_losses)
        # ||w|| ~ 8 (the init's sqrt(N) x 0.02 x ...); its error <= ||dw||_2 <= sqrt(N) x W_ATOL = 1.7e-4
        assert norm == pytest.approx(ref_norm, abs=math.sqrt(2.8e4) * W_ATOL), (rank, norm, ref_norm)
    got = _final(root)
    assert got.model.keys() == ref.model.keys()
    for name, w in ref.model.items():
        torch.testing.assert_close(got.model[name], w, rtol=0, atol=W_ATOL, msg=lambda s: f"{name}: {s}")
    buf = ref.optimizer["momentum"]
    assert got.optimizer["momentum"].keys() == buf.keys()
    for name, b in buf.items():
        torch.testing.assert_close(got.optimizer["momentum"][name], b, rtol=0, atol=BUF_ATOL,
                                   msg=lambda s: f"momentum {name}: {s}")


def test_fsdp2_dp4_matches_one_process(one_process, tmp_path):
    _check_parity(one_process, str(tmp_path), 4)


def test_fsdp2_pp2_dp2_matches_one_process(one_process, tmp_path):
    _check_parity(one_process, str(tmp_path), 4, "--pipeline-model-parallel-size", "2")


@pytest.mark.slow
def test_fsdp2_tp2_dp2_matches_one_process(one_process, tmp_path):
    _check_parity(one_process, str(tmp_path), 4, "--tensor-model-parallel-size", "2", "--sequence-parallel")


# ---- resume ------------------------------------------------------------------------------------------------
def _resume_worker(root: str) -> tuple:
    """At dp2 with --bf16 and AdamW: 4 steps straight, against 2 steps, save, load, 2 more (one world)."""
    common = ("--use-torch-fsdp2", "--bf16", "--optimizer", "adam", "--lr", "1e-2", "--lr-decay-iters", "4")
    straight, _ = _train(root + "/a", 2, "--train-iters", "4", "--save-interval", "4", *common)
    first, _ = _train(root + "/b", 2, "--train-iters", "2", "--save-interval", "2", *common)
    resumed, _ = _train(root + "/b", 2, "--train-iters", "4", "--save-interval", "4", "--load", root + "/b/ckpt",
                        *common)
    return straight, first + resumed


def test_fsdp2_resume_is_bit_exact(tmp_path):
    """The same losses, weights and optimizer state, bit for bit, as the uninterrupted run (the same sums in
    the same order: nothing about the run may depend on where it was restarted)."""
    for straight, pieced in run_distributed(_resume_worker, 2, str(tmp_path), timeout_s=600):
        assert pieced == straight
    a, b = _final(str(tmp_path / "a")), _final(str(tmp_path / "b"))
    assert int(a.meta["iteration"]) == int(b.meta["iteration"]) == 4
    for name, w in a.model.items():
        assert torch.equal(b.model[name], w), name
    assert a.optimizer.keys() == b.optimizer.keys() == {"exp_avg", "exp_avg_sq"}
    for kind, tensors in a.optimizer.items():
        for name, t in tensors.items():
            assert torch.equal(b.optimizer[kind][name], t), (kind, name)


# ---- what each rank holds ----------------------------------------------------------------------------------
def _held_worker(root: str) -> dict:
    """Element counts of what this rank holds after a step: sharded parameters, gradients, optimizer states
    (from the tensors themselves), the full (unsharded) counts, and the bytes FSDP's unsharded parameters
    keep between steps."""
    from omnitron.backends import get_backend
    from omnitron.core.parallel.data.fsdp import local_shard
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    torch.set_num_threads(1)
    argv = _argv(root, "--use-torch-fsdp2", "--optimizer", "adam", "--train-iters", "1")
    c = train(parse_settings(argv, 4), get_backend())["components"]
    params = [p for m in c.modules for p in m.parameters()]
    unsharded = 0
    for m in c.modules:
        for unit in m.modules():
            group = getattr(unit, "_get_fsdp_state", None) and unit._get_fsdp_state()._fsdp_param_group
            for fp in (group.fsdp_params if group else []):
                unsharded += fp._unsharded_param.untyped_storage().nbytes()
    return {"params": sum(local_shard(p).numel() for p in params),
            "grads": sum(local_shard(p.grad).numel() for p in params if p.grad is not None),
            "state": sum(t.numel() for bufs in c.optimizer.state.values() for t in bufs),
            "full": sum(p.numel() for p in params),
            "bound": sum(math.ceil(p.shape[0] / 4) * math.prod(p.shape[1:]) for p in params),
            "unsharded_bytes": unsharded, "kinds": sorted(c.optimizer.state)}


def test_fsdp2_each_rank_holds_a_quarter_at_dp4(tmp_path):
    """At dp4 the ranks' shards partition every parameter (their counts sum to the model's) and no rank holds
    more than its dim-0 share (ceil(rows / 4) rows of each parameter) of weights, gradients or either Adam
    moment; between steps FSDP keeps no unsharded parameter storage."""
    ranks = run_distributed(_held_worker, 4, str(tmp_path), timeout_s=600)
    full = ranks[0]["full"]
    assert all(r["full"] == full for r in ranks) and full > 2e4
    assert sum(r["params"] for r in ranks) == full
    assert sum(r["grads"] for r in ranks) == full
    assert sum(r["state"] for r in ranks) == 2 * full
    for r in ranks:
        assert r["kinds"] == ["exp_avg", "exp_avg_sq"]
        assert r["params"] == r["grads"] == r["state"] // 2 <= r["bound"]
        assert r["bound"] <= 1.05 * full / 4  # this model's rows divide nearly evenly: ~1/dp each
        assert r["unsharded_bytes"] == 0


# ---- refusals ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, world, says", [
    ((), 1, "nothing to shard"),
    (("--use-distributed-optimizer",), 4, "FSDP2 already shards optimizer state; drop --use-distributed-optimizer"),
    (("--overlap-grad-reduce",), 4, "drop --overlap-grad-reduce"),
    (("--use-distributed-optimizer", "--overlap-param-gather"), 4, "drop --use-distributed-optimizer"),
    (("--ddp-bucket-size", "1000"), 4, "drop --ddp-bucket-size"),
    (("--fp8-format", "hybrid"), 4, "FP8 linears"),
    (("--num-experts", "4", "--moe-router-topk", "2"), 4, "experts are replicated"),
    (("--ckpt-format", "torch"), 4, "--ckpt-format torch_dist"),
    (("--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1"), 4, "zero-bubble"),
    (("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"), 4,
     "full-layer recompute"),
])
def test_fsdp2_refuses_what_it_cannot_run(tmp_path, extra, world, says):
    from omnitron.core.training.arguments import parse_settings

    with pytest.raises(ConfigError, match="--use-torch-fsdp2") as err:
        parse_settings(_argv(str(tmp_path), "--use-torch-fsdp2", *extra), world)
    assert says in str(err.value)
