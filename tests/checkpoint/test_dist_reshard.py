"""torch_dist checkpoints resumed under other layouts through the users' path (``train --load``), 8 gloo ranks.

One spawn, tiny Llama-style GPT (GQA with 2 query groups, SwiGLU, RoPE, padded vocabulary, tied embedding,
dropout off), global batch 8. Each case trains 2 iterations uninterrupted under layout S, saving at both
(the save does not change the run: it is the reference), then resumes S's iteration 1 under layout T and
trains iteration 2, saving it:

* dense: S = tp2 x pp2 x dp2 with the distributed optimizer; T = tp1 x pp2 x dp4, tp1 x dp8 (distributed
  optimizer), and (``slow``) tp1 x pp2 x vp2 x dp4 and S without the distributed optimizer;
* MoE: 4 experts routed as DeepSeek's (sigmoid, expert biases: per-rank buffers), S = tp2 x dp4 x ep2 (experts
  split over etp = tp = 2), T = tp1 x dp8 x ep1 (whole experts),
  and (``slow``) tp1 x dp8 x ep4 without the distributed optimizer;
* formats: S's iteration 1 through ``omnitron checkpoint convert`` to the torch format (tp1 x pp2) and back
  to torch_dist (tp2), then T = dp8 loads each (the torch one with the default --ckpt-format torch_dist:
  the format is the checkpoint's);
* replicated KV: S = tp4 x dp2 (2 query groups < tp: linear_kv replicated), T = tp2 x dp4 (one group per rank).

Asserted: iteration 2's loss under T equals S's, and the parameters T saved after iteration 2 equal S's
(both read back by ``read_full_state``), within the bounds below; loading T from S's iteration 1 and saving
at once (no step) reproduces S's iteration-1 checkpoint bit for bit (every weight and optimizer tensor).
"""
from __future__ import annotations

import os

import pytest
import torch

from omnitron.testing.distributed import run_distributed
from test_reshard import _same  # bit-for-bit nested comparison

DENSE_S = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"]
ZERO = ["--use-distributed-optimizer"]
# DeepSeek's routing: sigmoid scores and expert biases (buffers in the ranks' files, not DCP pieces), updated by 0.05
# a step so that iteration 1's biases are far from zero and move picks: a resume that drops them is caught below
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-router-score-function", "sigmoid",
       "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05"]
CASES = {  # name: (S, T)
    "tp1_pp2_dp4": (DENSE_S, ["--pipeline-model-parallel-size", "2", *ZERO]),
    "moe_ep2_to_ep1": (["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2", *MOE, *ZERO],
                       [*MOE, *ZERO]),
    "torch_format_dp8": (DENSE_S, ZERO),  # ... loading that torch-format intermediate (the flag says torch_dist)
}
SLOW = {
    # replicated KV in the suite's budget: tests/checkpoint/test_dist_layout.py tiles the canonical qkv from them
    "kv_tp4_to_tp2": (["--tensor-model-parallel-size", "4", *ZERO], ["--tensor-model-parallel-size", "2", *ZERO]),
    "dp8": (DENSE_S, ZERO),  # the same save resumed at dp8 directly (torch_format_dp8 reaches dp8 in the default set)
    "vpp_tp1_pp2_dp4": (DENSE_S, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                                  "1", *ZERO]),
    "zero_off": (DENSE_S, DENSE_S[:-1]),
    # S's iteration 1 converted to --ckpt-format torch (tp1) and back first (slow since 2026-12-04, for the
    # suite's 10 minutes: torch_format_dp8 still loads the converted intermediate in the default set)
    "via_torch_dp8": (DENSE_S, ZERO),
    "moe_zero_off_ep4": (CASES["moe_ep2_to_ep1"][0], ["--expert-model-parallel-size", "4", *MOE]),
}
# Loss bound (fp32, u = 2^-24 ~ 6e-8): T reorders the sums of every matmul (length k <= 128) and of the
# gradient reductions; one reordered sum differs by <= gamma_k ~ k*u ~ 8e-6 relative worst case, ~sqrt(k)*u ~
# 7e-7 typically. Iteration 2's loss is computed from the identical iteration-1 state (read exactly), so only
# its own forward reorders: 4 layers give O(layers * sqrt(k) * u) ~ 3e-6 relative. 1e-5: 3x margin, 100x below
# one training step's change of the loss here (~1e-3 relative).
LOSS_RTOL = 1e-5
# Parameter bound after iteration 2: the difference is relative to the step's own update ||w2 - w1||. The
# gradient differs by ~sqrt(k)*u ~ 1e-6 relative; clipping (coefficient from the global norm) and Adam's
# step (m/sqrt(v) with iteration 1's gradient already in m and v, identical) are Lipschitz in it with
# constant O(1) except where |g| is below its own error, where Adam's update is still bounded by ~3 lr: such
# elements are ~1e-6 of all and add <= 3*sqrt(1e-6) ~ 3e-3 at most in the norm ratio, ~1e-6 typically. 5e-3
# bounds the worst case; a misplaced tensor or a wrong optimizer state gives a ratio of O(1).
PARAM_RTOL = 5e-3


def _args(layout, save, extra=()):
    return ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
            "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--seq-length", "16",
            "--max-position-embeddings", "16", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200", "--num-workers", "0",
            "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "2", "--lr", "3e-3",
            "--lr-warmup-iters", "0", "--lr-decay-style", "constant", "--clip-grad", "0.05", "--log-interval", "1",
            "--seed", "7", "--no-tensorboard",
            "--save-interval", "1", "--save", save, "--data-cache-path", os.path.join(os.path.dirname(save), "cache"),
            *layout, *extra]


def _worker(root, cases):
    import shutil

    import torch.distributed as dist

    from omnitron.core.training import checkpointing
    from omnitron.testing.training import worker_runner

    run = worker_runner(_args, root)
    out, sources = {}, {}
    for name, (src, dst) in cases.items():
        key = tuple(src)
        if key not in sources:  # S, uninterrupted, saving at iterations 1 and 2
            sources[key] = f"S_{name}"
            out[sources[key]] = run(src, sources[key])["losses"]
            if dist.get_rank() == 0:  # a --load directory holding only iteration 1
                shutil.copytree(os.path.join(root, sources[key], "iter_0000001"),
                                os.path.join(root, sources[key] + "_1", "iter_0000001"))
            dist.barrier()
        ck = os.path.join(root, sources[key] + "_1")
        if name.endswith("_dp8") and name != "dp8":
            if "converted" not in out:
                out["converted"] = _via_torch(root, ck)
            ck = out["converted"][name.startswith("via_torch")]
        checkpointing.save(run(dst, "L_" + name, "--load", ck, "--train-iters", "1")["components"])
        out["T_" + name] = run(dst, "T_" + name, "--load", ck)["losses"]
        out["S_of_" + name] = sources[key]
    return out


def _via_torch(root: str, ck: str) -> list[str]:
    """``omnitron checkpoint convert`` of ``ck`` to the torch format at tp1 x pp2, then back to torch_dist
    at tp2 (rank 0; the others wait); returns both --save directories."""
    import torch.distributed as dist

    from omnitron.cli import main

    out = [os.path.join(root, f"converted_{fmt}") for fmt in ("torch", "torch_dist")]
    if dist.get_rank() == 0:
        for src, dst, fmt, tp, pp in ((ck, out[0], "torch", "1", "2"), (out[0], out[1], "torch_dist", "2", "1")):
            assert main(["checkpoint", "convert", "--load", src, "--save", dst, "--target-ckpt-format", fmt,
                         "--target-tensor-model-parallel-size", tp, "--target-pipeline-model-parallel-size", pp]) == 0
    dist.barrier()
    return out


def _run(tmp_path_factory, cases):
    root = tmp_path_factory.mktemp("dist_reshard")
    return root, run_distributed(_worker, 8, str(root), cases, timeout_s=900)[0]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _run(tmp_path_factory, CASES)


def _check_loaded(root, res, name):
    """S ran 2 iterations, T only iteration 2, and T's save of S's iteration 1 (no step) holds S's weights and
    optimizer tensors bit for bit; returns (S's losses, T's losses, S's full states at iterations 1 and 2)."""
    from omnitron.core.checkpoint import find_latest, read_metadata
    from omnitron.core.checkpoint.reshard import read_full_state

    src = root / res["S_of_" + name]
    want, got = res[res["S_of_" + name]], res["T_" + name]
    assert sorted(want) == [1, 2] and want[1] != want[2] and sorted(got) == [2], (name, want, got)
    s1, s2 = (read_full_state(str(src / f"iter_000000{i}")) for i in (1, 2))
    assert read_metadata(str(src / "iter_0000001"))["ckpt_format"] == "torch_dist"
    loaded = read_full_state(find_latest(str(root / ("L_" + name))))  # T's copy of S's iteration 1, no step
    assert s1.model and s1.optimizer["exp_avg"]
    _same({"model": loaded.model, **loaded.optimizer}, {"model": s1.model, **s1.optimizer}, name + " loaded")
    return want, got, s1, s2


def _check(root, res, name) -> None:
    from omnitron.core.checkpoint import find_latest
    from omnitron.core.checkpoint.reshard import read_full_state

    want, got, s1, s2 = _check_loaded(root, res, name)
    assert abs(got[2] - want[2]) <= LOSS_RTOL * abs(want[2]), (name, got, want)
    t2 = read_full_state(find_latest(str(root / ("T_" + name))))
    assert sorted(t2.model) == sorted(s2.model) and t2.optimizer_meta["step"] == 2
    num = sum(float((t2.model[n].double() - w.double()).norm() ** 2) for n, w in s2.model.items()) ** 0.5
    step = sum(float((w.double() - s1.model[n].double()).norm() ** 2) for n, w in s2.model.items()) ** 0.5
    assert step > 0 and num <= PARAM_RTOL * step, (name, num, step)


@pytest.mark.parametrize("name", sorted(CASES))
def test_resume_under_another_layout(results, name):
    from omnitron.core.checkpoint.reshard import read_full_state

    root, res = results
    _check(root, res, name)
    if name.startswith("moe"):  # every expert of both ep ranks was written, as whole tensors
        model = read_full_state(str(root / res["S_of_" + name] / "iter_0000001")).model
        want = {f"decoder.layers.{i}.mlp.experts.{e}.linear_fc{j}.{kind}" for i in range(4) for e in range(4)
                for j in (1, 2) for kind in ("weight", "bias")}
        assert {n for n in model if ".mlp.experts." in n} == want
        biases = [t for n, t in model.items() if n.endswith("router.expert_bias")]  # _check_loaded: T kept them
        assert len(biases) == 4 and all(float(b.abs().max()) > 0 for b in biases)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW))
def test_resume_under_another_layout_slow(tmp_path_factory, name):
    root, res = _run(tmp_path_factory, {name: SLOW[name]})
    _check(root, res, name)
