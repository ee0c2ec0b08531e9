"""FP8 with ``--use-torch-fsdp2`` (:mod:`omnitron.core.precision.fp8.fsdp`): ``omnitron train`` at dp2 (and dp4,
slow; sim, slow) against the same FP8 command on one process, the bytes FSDP2's all-gathers carry (counted at
``torch.distributed.all_gather_single`` on torch 2.13, ``all_gather_into_tensor`` before: what FSDP2 calls) and the amax
all-reduces of each step (counted at the backend's collectives) at 2 and 4 layers.

The model and run are tests/parallel/test_fsdp2.py's (2 layers, hidden 32, 3 SGD steps, fp32 outside the GEMMs),
with ``--fp8-format hybrid --fp8-recipe tensorwise`` on the emulated FP8 GEMM path (same codes and fp32
accumulation as scaled_mm; CPU scaled_mm is slow).
"""
from __future__ import annotations

import math

import pytest
import torch

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim
from tests.parallel.test_fsdp2 import _argv

FP8 = ("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise")
ENV = {"OMNITRON_FP8_PATH": "emulated"}

# Bound, FSDP2 + FP8 against one process + FP8 (per-step and validation losses, relative). Both quantize every
# weight with the same scale: the scale comes from the max over the shards, which is the whole weight's amax
# exactly, and the cast is elementwise, so a gathered weight is bit-identical to the one-process cast of the same
# fp32 weight. The runs differ only in fp32 summation order (FSDP's reduce-scatter over dp against one sum over
# the batch): tests/parallel/test_fsdp2.py bounds that at d = 7e-7 relative per gradient entry and REL = 1e-5 on
# the losses. FP8 adds: an operand that differs by d relative crosses an FP8 rounding midpoint for a fraction
# <= 2d/s of its elements (s the format's step), each moving by s: a relative change <= 2d per FP8 GEMM whatever
# the format. 2 layers x 4 linears x 3 GEMMs (forward, data- and weight-gradient) = 24 GEMMs a step, compounded
# linearly over 3 steps: 24 x 3 x 2d = 1.0e-4; with the fp32 part, FP8_REL = 1.1e-4. A weight all-gathered
# with a wrong scale or stale codes moves the loss by ~e4m3's step, 2^-3 relative on the GEMMs: percents.
FP8_REL = 1.1e-4
GATHER_NAME = "all_gather_single" if hasattr(torch.distributed, "all_gather_single") else "all_gather_into_tensor"
"""What FSDP2 calls for its all-gathers: torch 2.13 renamed ``all_gather_into_tensor``."""


def _train_recorded(root: str, world: int, layers: int, extra: tuple = ()) -> dict:
    """``omnitron train`` with FSDP2 and FP8 at ``layers`` layers; per step, the all-reduces the backend issued
    (op, numel) and the all-gathers' input bytes; plus the bytes one layer unit's all-gather should carry."""
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.training import loop
    from omnitron.core.training.arguments import parse_settings

    torch.set_num_threads(1)
    be = get_backend()
    steps, current = [], None
    name = GATHER_NAME
    reduce, gather, train_step = be.collectives.all_reduce, getattr(dist, name), loop.train_step

    def counted_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if current is not None:
            current["reduces"].append((str(op), tensor.numel()))
        return reduce(tensor, op=op, group=group, async_op=async_op)

    def counted_gather(out, inp, group=None, async_op=False):
        if current is not None:
            current["gathers"].append(inp.numel() * inp.element_size())
        return gather(out, inp, group=group, async_op=async_op)

    def step(*a, **kw):
        nonlocal current
        current = {"reduces": [], "gathers": []}
        try:
            return train_step(*a, **kw)
        finally:
            steps.append(current)
            current = None

    be.collectives.all_reduce, loop.train_step = counted_reduce, step
    setattr(dist, name, counted_gather)
    try:
        res = loop.train(parse_settings(_argv(root, "--use-torch-fsdp2", *FP8, "--num-layers", str(layers), *extra),
                                        world),
                         be)
    finally:
        be.collectives.all_reduce, loop.train_step = reduce, train_step
        setattr(dist, name, gather)
    c = res["components"]
    return {"losses": [res["losses"][i] for i in sorted(res["losses"])],
            "val": [v["val_loss"] for v in res["validation"]], "steps": steps, **_unit_bytes(c, c.groups.dp_cp.size)}


def _unit_bytes(c, world: int) -> dict:
    """Per-rank all-gather input bytes of one transformer layer, from its parameters' full shapes (FSDP2 pads each
    to ceil(rows / world) rows): 1 byte per element of an FP8 linear's weight, else 4 (fp32); and the fp32 size."""
    from omnitron.core.precision.fp8 import FP8Linear

    layers = c.modules[0].decoder.layers
    layer = next(iter(layers.values())) if hasattr(layers, "values") else layers[0]
    fp8 = {id(m.weight) for m in layer.modules() if isinstance(getattr(m, "fp8", None), FP8Linear)}
    sizes = [(math.ceil(p.shape[0] / world) * math.prod(p.shape[1:]), id(p) in fp8) for p in layer.parameters()]
    return {"unit_fp8": sum(n * (1 if f else 4) for n, f in sizes), "unit_fp32": sum(4 * n for n, _ in sizes),
            "fp8_weights": sum(f for _, f in sizes) * len(layers)}


def _worker(root: str, layer_counts: tuple, extra: tuple = ()) -> dict:
    import torch.distributed as dist

    return {n: _train_recorded(f"{root}/l{n}", dist.get_world_size(), n, extra) for n in layer_counts}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Per-step and validation losses of the FP8 run on one process (no FSDP2)."""
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    mp = pytest.MonkeyPatch()
    for k, v in ENV.items():
        mp.setenv(k, v)
    try:
        res = train(parse_settings(_argv(str(tmp_path_factory.mktemp("one")), *FP8), 1), get_backend())
    finally:
        mp.undo()
    return [res["losses"][i] for i in sorted(res["losses"])], [v["val_loss"] for v in res["validation"]]


def _check_parity(one_process, ranks: list[dict]) -> None:
    losses, val = one_process
    for r in ranks:
        assert r["losses"] == pytest.approx(losses, rel=FP8_REL), (r["losses"], losses)
        assert r["val"] == pytest.approx(val, rel=FP8_REL), (r["val"], val)


def _check_gathers(r: dict) -> None:
    """Every all-gather of a step is a layer unit's, carrying its FP8 weights as 1 byte per element, or the root
    unit's (embedding, final norm: no FP8 linear), which is neither layer size."""
    assert r["unit_fp8"] < 0.5 * r["unit_fp32"], r  # the four linears dominate a layer
    for step in r["steps"]:
        layers = [b for b in step["gathers"] if b == r["unit_fp8"]]
        assert layers and r["unit_fp32"] not in step["gathers"], step["gathers"]
        # the root unit; torch 2.9's FSDP2 also all-gathers a few hundred bytes that are no unit's weights (every
        # unit's parameters go in one flat buffer, so no weight of this model is gathered alone at that size)
        assert len({b for b in step["gathers"] if b > 1024} - {r["unit_fp8"]}) <= 1, step["gathers"]


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    return run_distributed(_worker, 2, str(tmp_path_factory.mktemp("dp2")), (2, 4), env=ENV, timeout_s=600)


def test_fsdp2_fp8_dp2_trains_as_one_process(one_process, dp2):
    _check_parity(one_process, [r[2] for r in dp2])


def test_fsdp2_fp8_gathers_carry_fp8_bytes(dp2):
    for r in dp2:
        _check_gathers(r[2])
        _check_gathers(r[4])


def test_fsdp2_fp8_one_amax_all_reduce_per_step_at_any_layer_count(dp2):
    """Each step issues exactly one MAX all-reduce over as many amaxes as FP8 weights (the scales of the next
    step's gathers), and the same all-reduces at 4 layers as at 2 apart from that one's length: no per-layer
    or per-weight reduction (at dp2 the inputs' and gradients' amaxes have nothing to be reduced over)."""
    for r in dp2:
        for n in (2, 4):
            for step in r[n]["steps"]:
                batched = [x for x in step["reduces"]
                           if x == (str(torch.distributed.ReduceOp.MAX), r[n]["fp8_weights"])]
                assert len(batched) == 1, step["reduces"]
        assert r[4]["fp8_weights"] == 2 * r[2]["fp8_weights"] == 16
        for s2, s4 in zip(r[2]["steps"], r[4]["steps"]):
            assert len(s2["reduces"]) == len(s4["reduces"]), (s2["reduces"], s4["reduces"])


@pytest.mark.slow
def test_fsdp2_fp8_dp4_trains_as_one_process(one_process, tmp_path):
    ranks = run_distributed(_worker, 4, str(tmp_path), (2,), env=ENV, timeout_s=900)
    _check_parity(one_process, [r[2] for r in ranks])
    for r in ranks:
        _check_gathers(r[2])


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("--tensor-model-parallel-size", "2"), ("--pipeline-model-parallel-size", "2")])
def test_fsdp2_fp8_with_tp2_or_pp2_trains_as_one_process(one_process, tmp_path, layout):
    """tp2 x dp2 (each weight's amax reduced over its tp shards and dp shards in the one all-reduce) and pp2 x dp2
    (each stage its own reduction group); same bound: the layouts differ from one process only in fp32 sums."""
    ranks = run_distributed(_worker, 4, str(tmp_path), (2,), layout, env=ENV, timeout_s=900)
    _check_parity(one_process, [r[2] for r in ranks])


@requires_sim()
@pytest.mark.slow
def test_fsdp2_fp8_dp2_on_sim(one_process, tmp_path):
    ranks = run_distributed(_worker, 2, str(tmp_path), (2,), backend="sim", env=ENV, timeout_s=900)
    _check_parity(one_process, [r[2] for r in ranks])
    for r in ranks:
        _check_gathers(r[2])


def _resume_worker(root: str) -> tuple[list, list]:
    """3 steps saving after each, then a second run loading iteration 2: (first run's losses, the resumed run's)."""
    import shutil

    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    torch.set_num_threads(1)
    flags = (*FP8, "--use-torch-fsdp2")
    a = train(parse_settings(_argv(root + "/a", *flags, "--save-interval", "1"), 2), get_backend())["losses"]
    if dist.get_rank() == 0:
        shutil.copytree(root + "/a/ckpt/iter_0000002", root + "/b/ckpt/iter_0000002")
        with open(root + "/b/ckpt/latest", "w") as f:
            f.write("iter_0000002")
    dist.barrier()
    b = train(parse_settings(_argv(root + "/b", *flags, "--load", root + "/b/ckpt"), 2), get_backend())["losses"]
    return [a[i] for i in sorted(a)], [b[i] for i in sorted(b)]


@pytest.mark.slow
def test_fsdp2_fp8_resume_is_bit_exact(tmp_path):
    """Resuming from iteration 2 repeats step 3 bit for bit: the gathered weights are scaled from the loaded ones."""
    for straight, resumed in run_distributed(_resume_worker, 2, str(tmp_path), env=ENV, timeout_s=600):
        assert resumed == straight[2:], (straight, resumed)
