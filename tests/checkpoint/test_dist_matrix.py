"""torch_dist round trips for the rest of the parity matrix: context parallelism, FP8, the interleaved and
ZB-H1 pipeline schedules (4 gloo ranks; the model, data and S -> T protocol of test_dist_reshard.py).

Each case trains 2 iterations uninterrupted under layout S, saving at both, then resumes S's iteration 1
under layout T (loading and saving at once, and training iteration 2):

* same layout (S = T): the save of the loaded state reproduces S's iteration-1 checkpoint bit for bit --
  every weight and optimizer tensor and every rank's own file (RNG streams, tensor-parallel trackers, FP8
  amax histories and scales) -- and iteration 2 gives S's loss exactly and S's iteration-2 checkpoint bit
  for bit (so the restored RNG and FP8 state were the ones in use);
* another layout: test_dist_reshard's checks (the loaded state bit for bit, the loss and parameters after
  iteration 2 within its LOSS_RTOL / PARAM_RTOL); FP8 additionally: the log says the histories restart,
  and the loss is within FP8_LOSS_RTOL below.

Default: cp2 x dp2 with the distributed optimizer, resumed under itself and under dp4 (no cp). ``slow``:
dp4 -> cp2 x dp2, cp2 x tp2 under itself and -> dp4, cp2 x dp2 with the plain optimizer -> dp4, FP8
(delayed, hybrid) at tp2 x dp2 under itself and -> tp1 x dp4, pp2 x vp2 x dp2 and pp2 x dp2 with ZB-H1 under
themselves (test_dist_reshard's vpp case changes the layout; no same-layout pipeline-schedule round trip
existed), FP8 with the stateless recipes (tensorwise, blockwise; emulated on CPU) at cp2 x dp2 and at pp2 x dp2
under themselves, and --async-save in S at cp2 x dp2 and with FP8 (delayed, tp2 x dp2) under themselves: T's
synchronous saves must equal S's background ones bit for bit. ``slow``, 8 ranks: a cp change, cp2 x tp2 x dp2
-> cp4 x dp2 (test_dist_reshard's model and protocol; its bound below).

Context parallelism and LOSS_RTOL (fp32, u = 2^-24): cp2 splits each sequence of 16 into 4 chunks of 4
(cp rank r holds chunks r and 3 - r) and ring attention computes each query's softmax over each kv block
separately (sums of <= 8 terms instead of <= 16: gamma_8 ~ 8u), then merges the 2 block results with their
log-sum-exps (ring.py: new = logaddexp(lse, l); out <- out * exp(lse - new) + o * exp(l - new)). One merge
costs the exps' arguments an absolute error ~ u * |lse| (|lse| <= ~5 here: small scores, log 16 = 2.8),
i.e. ~5u relative in each exp, plus a multiply-add: <= ~12u. So the attention output differs from the unsplit
one by <= ~20u ~ 1.2e-6 relative, below the gamma_128 ~ 8e-6 per reordered sum that LOSS_RTOL's derivation
already allows per layer. The loss's token sum over cp (an all-reduce of 2 partial sums) and the gradient
reductions over dp x cp are reorderings of sums of length <= 128 as well. So the cp cases reuse LOSS_RTOL and
PARAM_RTOL unchanged. Same-layout cases train with dropout (DROP below) so that the restored RNG streams are
in use.
"""
from __future__ import annotations

import contextlib

import pytest

from omnitron.testing.distributed import run_distributed
from test_dist_checkpoint import _late_first_write  # delays DCP's writes of iteration 1 past iteration 2's step
from test_dist_reshard import LOSS_RTOL, ZERO, _check, _check_loaded
from test_dist_reshard import _run as _run8
from test_reshard import _same

CP = ["--context-parallel-size", "2", *ZERO]  # cp2 x dp2
CP_TP = ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", *ZERO]  # cp2 x tp2
FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "4"]
FP8_S = ["--tensor-model-parallel-size", "2", *ZERO, *FP8]  # tp2 x dp2
VPP = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1", *ZERO]
ZBH1 = ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1", *ZERO]
PP = ["--pipeline-model-parallel-size", "2", *ZERO]  # pp2 x dp2
FP8_TW = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]  # stateless: scales from each tensor's own amax
FP8_BW = ["--fp8-format", "hybrid", "--fp8-recipe", "blockwise"]
ASYNC = ["--async-save"]  # S saves in the background (T synchronously: the checks compare the two)
# Same-layout cases train with dropout: the RNG streams and trackers they restore are then in use (without
# it nothing draws from them, and a resume that dropped them would still reproduce S).
DROP = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


def _same_layout(layout):
    return [*layout, *DROP], [*layout, *DROP]


CASES = {"cp2_same": _same_layout(CP), "cp2_to_dp4": (CP, ZERO)}  # name: (S, T); *_same: S = T
SLOW = {"dp4_to_cp2": (ZERO, CP), "cp2_tp2_same": _same_layout(CP_TP), "cp2_tp2_to_dp4": (CP_TP, ZERO),
        "cp2_plain_to_dp4": (CP[:2], ZERO),  # the plain optimizer's replicated state, written by dp x cp rank 0
        "fp8_same": _same_layout(FP8_S), "fp8_tp2_to_tp1": (FP8_S, [*ZERO, *FP8]),
        "vpp_same": _same_layout(VPP), "zbh1_same": _same_layout(ZBH1),
        "fp8_tensorwise_cp2_same": _same_layout([*CP, *FP8_TW]), "fp8_blockwise_cp2_same": _same_layout([*CP, *FP8_BW]),
        "fp8_tensorwise_pp2_same": _same_layout([*PP, *FP8_TW]), "fp8_blockwise_pp2_same": _same_layout([*PP, *FP8_BW]),
        # --async-save in S: iteration 1 is written (late: _late_first_write) while iteration 2 trains; T's
        # synchronous saves of the same states must equal S's background ones bit for bit
        "cp2_async_same": ([*CP, *DROP, *ASYNC], [*CP, *DROP]),
        "fp8_async_same": ([*FP8_S, *DROP, *ASYNC], [*FP8_S, *DROP])}
RESTART = ("FP8 amax histories and scales belong to the layout they were reduced in and do not carry to another "
           "layout")
# FP8 across a layout change (hybrid: the forward in e4m3, step s = 2^-3 relative; the loss is a forward
# only). T reads S's iteration-1 weights exactly but restarts the delayed scaling: its first use of each
# tensor is scaled from its own amax, S's from the max of iteration 1's history. The amaxes are reduced over
# tp, so the scales do not depend on the split, but the two ratios (own amax vs. history max: activations of
# another batch, 0.7 - 1.3 here) are not powers of 2, so the two runs' FP8 rounding errors are independent:
# rms s/sqrt(12) = 3.6% per element. As tests/fp8/test_training.py's block-wise bound: a GEMM output's
# relative error is the same (signal and error add as sqrt(k) alike), the mean loss averages 8 x 16 = 128
# tokens and the 4 layers x 4 FP8 GEMMs = 16 forward GEMMs add in quadrature: sqrt(2) x 0.036 x
# sqrt(16 / 128) = 1.8e-2 for one step, plus LOSS_RTOL's fp32 reordering (1e-5). This bound is loose for a
# model whose loss is still ~ln(vocab) (its logits are small); the restarted state itself is checked exactly
# (:func:`_check_fp8_restart`).
FP8_LOSS_RTOL = 1.8e-2 + LOSS_RTOL


def _worker(root, cases):
    """test_dist_reshard's worker at this world size, keeping rank 0's ``omnitron.train`` log lines."""
    import logging

    from test_dist_reshard import _worker as reshard_worker

    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    log, keep = logging.getLogger("omnitron.train"), Keep(logging.INFO)
    level = log.level
    log.addHandler(keep)
    log.setLevel(logging.INFO)
    late = any(ASYNC[0] in s for s, _ in cases.values())
    try:
        with _late_first_write() if late else contextlib.nullcontext():
            out = reshard_worker(root, cases)
    finally:
        log.removeHandler(keep)
        log.setLevel(level)
    out["log"] = lines
    return out


def _run(tmp_path_factory, cases):
    root = tmp_path_factory.mktemp("dist_matrix")
    return root, run_distributed(_worker, 4, str(root), cases, timeout_s=600,
                                 env={"OMNITRON_FP8_PATH": "emulated"})


def _check_same(root, res, name) -> None:
    """S = T: T's saves of iteration 1 (no step) and of iteration 2 equal S's bit for bit, every rank's own
    file included, and iteration 2's loss is S's exactly."""
    from omnitron.core.checkpoint import find_latest
    from omnitron.core.checkpoint.io import read_shard
    from omnitron.core.checkpoint.reshard import read_full_state

    want, got, _, _ = _check_loaded(root, res[0], name)
    assert got[2] == want[2], (name, got, want)
    src = root / res[0]["S_of_" + name]
    for it, mine in ((1, "L_"), (2, "T_")):
        s, t = str(src / f"iter_000000{it}"), find_latest(str(root / (mine + name)))
        assert t.endswith(f"iter_000000{it}"), t
        fs, ft = read_full_state(s), read_full_state(t)
        for part in ("model", "optimizer", "optimizer_meta", "scheduler"):
            _same(getattr(ft, part), getattr(fs, part), f"{name} iteration {it} {part}")
        for r in range(len(res)):
            want_r, got_r = read_shard(s, r), read_shard(t, r)
            assert want_r["rng"] and ("fp8" in want_r) == name.startswith("fp8"), (name, r)
            _same(got_r, want_r, f"{name} iteration {it} rank {r}'s own state")


def _check_fp8_restart(root, res, name: str) -> None:
    """Under another layout every rank's FP8 state restarts: T's save of the loaded iteration 1 holds a fresh
    delayed-scaling state (no use, zero history, scale 1) for every FP8 linear of S, and T's iteration 2
    exactly one push (training reduces and pushes the amaxes once per step, whatever the micro-batches) with a
    positive amax."""
    from omnitron.core.checkpoint import find_latest
    from omnitron.core.checkpoint.io import read_shard

    saved = read_shard(str(root / res[0]["S_of_" + name] / "iter_0000001"), 0)["fp8"]
    loaded, t2 = (find_latest(str(root / (d + name))) for d in ("L_", "T_"))
    uses = 1  # one optimizer step since the restart: one history push (scaling.py, per step)
    for r in range(len(res)):
        fresh, after = read_shard(loaded, r)["fp8"], read_shard(t2, r)["fp8"]
        assert sorted(fresh) == sorted(after) == sorted(saved) and len(saved) == 16, (r, sorted(fresh))
        for lin, roles in fresh.items():
            for role, st in roles.items():
                assert int(st["uses"]) == 0 and not st["amax_history"].any() and float(st["scale"]) == 1, (lin, role)
                a = after[lin][role]
                assert int(a["uses"]) == uses and (a["amax_history"][:uses] > 0).all(), (r, lin, role, a)
                assert not a["amax_history"][uses:].any(), (r, lin, role, a)


def _check_case(root, res, name) -> None:
    if "async" in name:  # S's two saves went through the background writer, into buffers staged once
        log = res[0]["log"]
        assert sum("torch_dist, written in the background" in line for line in log) == 2, log
        assert sum("--async-save: allocated host staging buffers" in line for line in log) == 1, log
    if name.endswith("_same"):
        _check_same(root, res, name)
        assert not any(RESTART in line for line in res[0]["log"]), name
    elif name.startswith("fp8"):
        want, got, _, _ = _check_loaded(root, res[0], name)
        assert abs(got[2] - want[2]) <= FP8_LOSS_RTOL * abs(want[2]), (name, got, want)
        assert sum(RESTART in line for line in res[0]["log"]) == 2, res[0]["log"]  # the L_ and T_ loads
        _check_fp8_restart(root, res, name)
    else:
        _check(root, res[0], name)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _run(tmp_path_factory, CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_round_trip_and_resume(results, name):
    _check_case(*results, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW))
def test_round_trip_and_resume_slow(tmp_path_factory, name):
    _check_case(*_run(tmp_path_factory, {name: SLOW[name]}), name)


# A cp change at 8 ranks (test_dist_reshard's 8-rank model and protocol): cp2 x tp2 x dp2 -> cp4 x dp2. cp4
# splits each sequence of 16 into 8 chunks of 2 (cp rank r holds chunks r and 7 - r); each query's softmax is
# merged over up to 8 kv blocks instead of cp2's 4: 7 merges of <= ~12u each (the module docstring's per-merge
# bound), <= ~90u ~ 5e-6 relative in the attention output, still within the gamma_128 ~ 8e-6 per reordered
# sum that LOSS_RTOL's derivation allows per layer; tp1 instead of tp2 reorders the matmul sums the same way as
# test_dist_reshard's tp changes. So LOSS_RTOL and PARAM_RTOL (test_dist_reshard's _check) apply unchanged.
CP8 = {"cp2_tp2_dp2_to_cp4_dp2": (CP_TP, ["--context-parallel-size", "4", *ZERO])}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CP8))
def test_cp_change_at_8_ranks_slow(tmp_path_factory, name):
    root, res = _run8(tmp_path_factory, {name: CP8[name]})
    _check(root, res, name)
