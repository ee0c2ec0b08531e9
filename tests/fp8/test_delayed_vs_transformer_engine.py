"""Per-step delayed scaling against Transformer Engine's update rule and timing as Megatron runs it.

The reference (te_delayed_reference.py) is TE's schedule and arithmetic transcribed from its source. It is fed the
amaxes omnitron observed, use by use (a log taken by wrapping ``AmaxReducer.observe`` and ``.step``): if every
scale omnitron quantizes with equals the one TE's rule has in force at that use, both runs compute the same
tensors, so the same amaxes, step after step. Compared exactly: the histories are maxima of the logged floats and
the scale is one float32 division in both (te_delayed_reference.te_scale). Not compared: step 1's scales (TE starts
from 1, omnitron from each tensor's own amax: scaling.py's NOTE); they only enter through the logged amaxes.
"""
from __future__ import annotations

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.core.precision.fp8 import FP8Config, FP8Linear, linear_modules
from omnitron.core.precision.fp8.linear import FP8Linear as _Exec
from omnitron.core.precision.fp8.scaling import AmaxReducer
from omnitron.testing.distributed import run_distributed
from omnitron.testing.threads import torch_threads
from te_delayed_reference import Slot, replay

HIST = 3
ROLE_FMT = {"input": "e4m3", "weight": "e4m3", "grad_output": "e5m2"}  # hybrid


class _Log:
    """Wraps observe (the amax a use saw, the scale it quantized with, training forward / eval / backward) and step
    (every role's history and scale after the push) for one process's run; undone on exit."""

    def __init__(self) -> None:
        self.entries, self.grad = [], True

    def __enter__(self) -> "_Log":
        self.saved = AmaxReducer.observe, AmaxReducer.step, _Exec.__call__
        observe, step, call = self.saved
        log = self

        def logged_call(ex, *a, **k):
            log.grad = torch.is_grad_enabled()  # inside the autograd function grad mode is always off
            return call(ex, *a, **k)

        def logged_observe(reducer, state, amax):
            role = "grad_output" if state.fmt == "e5m2" else "fwd"
            kind = "bwd" if role == "grad_output" else ("fwd" if log.grad else "eval")
            used = float(state.scale) if reducer.primed else None
            log.entries.append(("obs", state, kind, float(amax), used))
            observe(reducer, state, amax)

        def logged_step(reducer):
            step(reducer)
            log.entries.append(("step", {s: (s.amax_history.tolist(), float(s.scale)) for s in reducer.states}))

        AmaxReducer.observe, AmaxReducer.step, _Exec.__call__ = logged_observe, logged_step, logged_call
        return self

    def __exit__(self, *exc) -> None:
        AmaxReducer.observe, AmaxReducer.step, _Exec.__call__ = self.saved


def _compare(entries: list, names: dict, roles=tuple(ROLE_FMT)) -> tuple[list, list]:
    """Replay the log through TE's rule; returns (mismatches of the roles ``roles``, per-step windows by key)."""
    slots = {names[s]: Slot(ROLE_FMT[names[s][1]], HIST, "max", 0) for s in names}
    keyed = [(e[0], names[e[1]], *e[2:]) if e[0] == "obs" else e for e in entries]
    steps, te_used = replay(keyed, slots)
    bad, k, primed = [], 0, False
    for e, te in zip([e for e in keyed if e[0] == "obs"], te_used):
        if e[4] is not None and e[1][1] in roles and e[4] != te:
            bad.append(("scale in force", e[1], e[4], te))
    marks = [e[1] for e in entries if e[0] == "step"]
    for k, (mine, theirs) in enumerate(zip(marks, steps)):
        for s, (hist, scale) in mine.items():
            key = names[s]
            if key[1] in roles and (hist, scale) != theirs[key]:
                bad.append((f"after step {k + 1}", key, (hist, scale), theirs[key]))
    return bad, steps


def _args(root, micro: int, *extra) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "128", "--num-workers", "0", "--micro-batch-size", "1", "--global-batch-size",
            str(micro), "--train-iters", "4", "--lr", "3e-3", "--seed", "7", "--no-tensorboard", "--bf16",
            "--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", str(HIST),
            "--fp8-amax-compute-algo", "max", "--eval-interval", "2", "--eval-iters", "1", "--log-interval", "1",
            "--data-cache-path", str(root), *extra]


def _train_logged(root: str, micro: int, world: int, *extra) -> tuple[list, dict]:
    """One rank's log and {state: (linear name, role)} of a CLI training run (evaluation after step 2)."""
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    # one thread for this run only: set and left, it changed the rounding of every later in-process training
    # (test_training.py's FP8-vs-bf16 losses moved by up to 0.2% after this file)
    with torch_threads(1), _Log() as log:
        result = train(parse_settings(_args(root, micro, *extra), world), get_backend())
    names = {s: (n, r) for n, m in linear_modules(result["components"].modules)
             if isinstance(getattr(m, "fp8", None), FP8Linear) for r, s in m.fp8.states.items()}
    return log.entries, names


def _kinds(entries: list) -> list[str]:
    out = []
    for e in entries:
        k = e[2] if e[0] == "obs" else "step"
        if not out or out[-1] != k:
            out.append(k)
    return out


def test_one_micro_batch_with_an_evaluation_agrees_with_transformer_engine(tmp_path):
    """One micro-batch per step, an evaluation after step 2: every role's history and scale after every step, and
    every scale used from step 2 on, equal TE's (the evaluation's forward amaxes folded into step 3's update)."""
    entries, names = _train_logged(str(tmp_path), 1, 1)
    # the schedule: evaluations after steps 2 and 4 (then the validation and test sets', merged into one run)
    assert _kinds(entries) == (["fwd", "bwd", "step"] * 2 + ["eval"]) * 2
    bad, _ = _compare(entries, names)
    assert not bad, bad[:6]


def test_four_micro_batches_agree_on_the_weights_only(tmp_path):
    """Four micro-batches per step: TE updates the inputs' and output gradients' scales after each micro-batch,
    omnitron once per step (docs/megatron-flags.md); the weights' histories and scales agree, as TE sees a
    weight's amax in the first micro-batch only. The inputs' do differ (the documented difference exists)."""
    entries, names = _train_logged(str(tmp_path), 4, 1)
    assert _kinds(entries)[:9] == ["fwd", "bwd"] * 4 + ["step"]  # four micro-batches a step
    bad, _ = _compare(entries, names, roles=("weight",))
    assert not bad, bad[:6]
    bad, _ = _compare(entries, names, roles=("input",))
    assert any(b[0].startswith("after step") for b in bad)


def _pp2(root: str) -> tuple:
    """(mismatches, roles, schedule) with one micro-batch per step, then weight mismatches with four (1F1B)."""
    entries, names = _train_logged(root + "/one", 1, 2, "--pipeline-model-parallel-size", "2")
    bad, _ = _compare(entries, names)
    four, names4 = _train_logged(root + "/four", 4, 2, "--pipeline-model-parallel-size", "2")
    return bad, len(names), _kinds(entries), _compare(four, names4, roles=("weight",))[0]


def test_two_pipeline_stages_agree_with_transformer_engine(tmp_path):
    """pp2, an evaluation after step 2: each stage updates its own roles (the amax group has no pipeline dimension,
    in TE as here) and agrees with TE's rule on each, every role with one micro-batch, the weights with four
    (1F1B merges the warm-up forwards into one run of the log; TE's weight update is the same either way: the
    later micro-batches see no weight amax)."""
    for bad, roles, kinds, bad4 in run_distributed(_pp2, 2, str(tmp_path), timeout_s=300):
        assert kinds == (["fwd", "bwd", "step"] * 2 + ["eval"]) * 2, kinds
        assert roles > 0 and not bad, bad[:6]
        assert not bad4, bad4[:6]


def _te_run(amaxes: list[float], algo: str) -> list[tuple[list, float]]:
    slot, out = Slot("e4m3", HIST, algo, 0), []
    for a in amaxes:
        slot.observe(a)
        slot.update()
        out.append((slot.window, slot.scale))
    return out


def _per_step_histories(algo: str, w: torch.Tensor, xs: list[torch.Tensor]) -> list[tuple[list[float], float]]:
    """(the input role's amax history, its scale) after each of omnitron's per-step delayed updates, one FP8Linear
    forward and backward on each ``x``."""
    cfg = FP8Config(fp8_recipe="delayed", fp8_format="hybrid", fp8_amax_history_len=HIST, fp8_amax_compute_algo=algo)
    reducer = AmaxReducer((), None, per_step=True)
    ex = FP8Linear(cfg, get_backend("cpu").fp8, reducer=reducer)
    got = []
    for x in xs:
        ex(x, w, None).sum().backward()
        reducer.step()
        s = ex.states["input"]
        got.append((s.amax_history.tolist(), float(s.scale)))
    return got


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_a_zero_amax_leaves_history_and_scale_as_transformer_engine_does(algo):
    """A step whose input is all zeros (amax 0): TE's fused update rolls nothing and keeps the scale
    (delayed_scaling.cu:186), so under ``max`` the step after still sees the oldest amax. Omnitron pushed the 0
    (history [0, a2, a1], then [a4, 0, a2]: a1 dropped a step early and the scale moved)."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(8, 8, generator=g) * 0.1).requires_grad_()
    xs = [torch.randn(4, 8, generator=g) * c for c in (9.0, 2.0, 0.0, 1.0)]  # the oldest the largest
    assert _per_step_histories(algo, w, xs) == _te_run([float(x.abs().max()) for x in xs], algo)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_an_inf_amax_rolls_in_and_keeps_the_scale_as_transformer_engine_does(algo):
    """A step whose input holds an inf (amax inf): TE rolls it into the history and keeps the previous scale while
    the amax it scales from is not finite (delayed_scaling.cu:238-249), under ``max`` until the inf ages out of the
    window. A scale of fp8_max / inf = 0 instead would quantize every later input to zero."""
    g = torch.Generator().manual_seed(torch.randint(0, 2 ** 31, ()).item())
    w = (torch.randn(8, 8, generator=g) * 0.1).requires_grad_()
    xs = [torch.randn(4, 8, generator=g) * c for c in (9.0, 2.0, 1.0, 3.0, 0.5)]
    xs[1][2, 3] = float("inf")
    assert _per_step_histories(algo, w, xs) == _te_run([float(x.abs().max()) for x in xs], algo)


def test_a_tiny_amax_gives_the_largest_float32_scale_and_divisions_round_once():
    """TE's scale is one float32 division, the largest float32 where it overflows (delayed_scaling.cu:238-249):
    a reciprocal times fp8_max is an ulp off for some amaxes, and inf for an amax below ~1e-36."""
    cfg = FP8Config(fp8_recipe="delayed", fp8_format="hybrid", fp8_amax_history_len=1)
    reducer = AmaxReducer((), None, per_step=True)
    g = torch.Generator().manual_seed(4)
    amaxes = (torch.rand(64, generator=g) * 10.0 ** torch.randint(-30, 30, (64,), generator=g)).tolist() + [1e-38]
    exs = [FP8Linear(cfg, get_backend("cpu").fp8, reducer=reducer) for _ in amaxes]
    w = torch.ones(2, 2, requires_grad=True)
    for ex, a in zip(exs, amaxes):
        ex(torch.full((2, 2), a), w, None).sum().backward()
    reducer.step()
    got = [float(ex.states["input"].scale) for ex in exs]
    want = [_te_run([float(torch.tensor(a, dtype=torch.float32))], "most_recent")[0][1] for a in amaxes]
    assert got == want
