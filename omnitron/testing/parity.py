"""Helpers the model-family tests share to compare a parallel run with one process.

:func:`relative_error` is the norm-wise error every parity test reports;
:func:`tp_sp_parity` runs one forward + backward per configuration on a tensor-parallel group
(without and with sequence parallelism) and on one process, a float64 model on the reference kernels, and returns
the errors of every compared tensor; :func:`assert_parity` checks every rank's result against a tolerance;
:func:`reference_kernels` puts this process on the reference kernels for a block;
:func:`on_groups_device` moves a step's model and batch to the device its groups run on.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch

# tp_sp_parity's bound. Both sides compute in float64 (u = 2**-53 = 1.1e-16) and differ only in the order of sums:
# tp splits each contraction (<= 4 x hidden = 256 terms in these tiny models) into 2 partial sums added by an
# all-reduce, sequence parallelism's reduce-scatter adds the same 2 partial sums, the all-gathers are exact, and a
# weight gradient sums its b x s <= 64 tokens' products in another grouping. Reordering n <= 256 terms moves a sum
# by <= n u = 2.8e-14 of the sum of its terms' magnitudes; one forward + backward chains a few such sums at gain
# ~1 (layer norms and softmaxes are well conditioned at these scales), so a norm-wise error (relative_error) stays
# <= ~1e-13 at worst (sqrt(n) u ~ 2e-15 typical). TP_SP_TOL = 1e-12 leaves a factor 10; a float32 run needed 1e-5,
# and a tp or sp slip of 1e-6 (a partial sum counted with weight 1 +- 1e-6, a float32 all-reduce) fails here.
TP_SP_TOL = 1e-12

# A training loop's losses at a layout against one process, both a float64 model (C++ kernels decline float64, so
# both sides run the references) under Adam / AdamW (lr <= 1e-2) for <= 6 steps. The layouts differ only in the
# order of sums: tp / sp split contractions of <= 128 terms in 2 partial sums, pp / vp / zb-v / recompute change
# none, cp merges <= 2 partial softmaxes, dp / ep add <= 2 partial gradients: <= 128 u = 1.4e-14 relative on a
# gradient (u = 2**-53), and the clipping norm's positive sum of squares ~log2(n) u. Adam's update takes a
# gradient's relative error at gain ~1 (a clip factor scales m and sqrt(v) alike), and a later loss takes the
# weights' errors at gain ~1: <= 6 steps x 6 x 1.4e-14 = 5e-13 relative on the sixth loss (1.3e-13 on the third).
# ADAM_LOOP_REL = 1e-12 leaves a factor >= 2 (~100 over the sqrt(n) u typical); float32 runs needed 1e-5.
ADAM_LOOP_REL = 1e-12


@contextlib.contextmanager
def reference_kernels():
    """In this process, every fused op on its reference while the block runs (the one-process side of a
    float64 parity test whose workers run with ``distributed.REFERENCE_KERNELS``)."""
    from omnitron.backends import get_backend
    from omnitron.core.parallel.groups import host_backend
    from omnitron.kernels.registry import REFERENCE, KernelTable

    # the environment's backend, the cpu backend a reference names (a different instance when the suite runs
    # on another backend) and the host backend that modules built without one resolve to
    backends = {id(b): b for b in (get_backend(), get_backend("cpu"), host_backend())}.values()
    saved = [(be, be.kernels) for be in backends]
    for be, _ in saved:
        be._kernel_table = KernelTable(be.name, (REFERENCE,))
    try:
        yield
    finally:
        for be, table in saved:
            be._kernel_table = table


def on_groups_device(groups, model: torch.nn.Module, batch: dict) -> tuple[torch.nn.Module, dict]:
    """``model`` and ``batch``'s tensors on the device of the backend ``groups`` run on (the backend under
    test for built groups, the host for one process): a parity step's parallel side runs where the suite's
    ``--backend`` says, its one-process reference on the host."""
    from omnitron.core.parallel.groups import resolve_backend
    from omnitron.core.parallel.tensor.sharding import to_device

    dev = resolve_backend(None, groups).device()
    return to_device(model, dev), {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (``b`` the reference; either may be on a device)."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def tp_sp_parity(tp: int, configs: dict, step: Callable) -> dict:
    """Collective over the default world: for sequence parallelism off and on, and each ``configs``
    entry (run as a float64 model on the reference kernels: :data:`TP_SP_TOL`'s analysis), ``step(cfg, groups)``
    runs one forward + backward and returns ``{name: tensor}`` plus ``"grads"``: the full gradient state
    (``gather_full_state(..., grads=True)``). Returns
    ``{(config name, sp): {name: relative error, "grads": worst gradient error, "keys": same names}}``."""
    from omnitron.backends import get_backend
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups

    torch.set_num_threads(1)
    single, out = ParallelGroups.single(), {}
    for sp in (False, True):
        groups = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp),
                                      backend=get_backend())
        for name, cfg in configs.items():
            cfg = dataclasses.replace(cfg, params_dtype=torch.float64)
            with reference_kernels():
                got, want = step(cfg, groups), step(cfg, single)
            gg, gw = got.pop("grads"), want.pop("grads")
            err = {k: relative_error(got[k], want[k]) for k in want}
            err.update(grads=max(relative_error(gg[k], gw[k]) for k in gw), keys=gg.keys() == gw.keys())
            out[(name, sp)] = err
    get_backend().collectives.barrier()
    return out


def assert_parity(rank_results: list[dict], tol: float = TP_SP_TOL) -> None:
    """Every rank's :func:`tp_sp_parity` result: the same gradient names, every error below ``tol``."""
    for result in rank_results:
        for case, err in result.items():
            assert err.pop("keys"), f"{case}: gradient names differ from one process"
            assert max(err.values()) < tol, (case, err)


def assert_training_matches(per_rank: list[dict], ref: dict, label, scalars=("losses", "norms", "aux"),
                            rel: float = 1e-5) -> None:
    """A parallel training run against one process: every rank's per-step ``scalars`` equal ``ref``'s
    to ``rel``, and the ranks' ``state`` dicts (each the tensors it owns, by global name) merge into
    exactly ``ref["state"]``'s names and values."""
    import pytest

    merged = {}
    for res in per_rank:
        for name in scalars:
            assert res[name] == pytest.approx(ref[name], rel=rel), (label, name, res[name], ref[name])
        merged.update(res["state"])
    assert merged.keys() == ref["state"].keys(), label
    for name, w in ref["state"].items():
        torch.testing.assert_close(merged[name], w, rtol=rel, atol=rel / 10, msg=lambda m: f"{label} {name}: {m}")
