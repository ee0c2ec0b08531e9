"""--cp-comm-type a2a (Ulysses) and allgather: attention over the cp-split sequence against plain attention on the whole
sequence (float64, forward and gradients), and the training loop under each type against one process (a float64 model
with the reference kernels, LOOP_REL per step) at cp2, tp2 x cp2 with sequence parallelism, cp2 x dp2 with the
distributed optimizer and cp4; refusals name the binding constraint."""
from __future__ import annotations

import pytest
import torch

from omnitron.core.config import ParallelConfig
from omnitron.core.config.parallel import ConfigError
from omnitron.core.parallel.context import split_sequence
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.testing.distributed import REFERENCE_KERNELS, run_distributed
from omnitron.testing.parity import reference_kernels
from omnitron.testing.training import settings_in

# The loop in float64 (u = 2**-53 = 1.1e-16): a layout sums the same per-token terms as one process in other
# orders (attention over <= 16 gathered or exchanged keys, tp contractions of <= 64 terms, gradient reductions
# over <= 4 ranks where one process adds 2 micro-batches, the MoE's token dispatch): <= 64 x 4 u = 2.8e-14
# relative on a gradient. 3 SGD steps at lr 0.5, clipped to norm 0.5, carry a gradient error into the weights at
# lr and back at gain < 1 + lr ||H|| ~ 2 (a stable run): <= 2^3 x 2.8e-14 = 2.3e-13 on the third loss.
# LOOP_REL = 1e-12 leaves a factor 4 (~100 over sqrt(n) u typical); the float32 loop needed 1e-5. The MoE runs
# route the same: float64 router logits err by ~1e-15, far below the top-2 gaps of random logits.
LOOP_REL = 1e-12
CASES = [(hq, hkv) for hq, hkv in ((4, 4), (4, 2), (4, 1), (8, 2))]


def _full(q, k, v):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    n = q.shape[2]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax(s.masked_fill(causal, float("-inf")), -1) @ v


def _masked(q, k, v, keep):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~keep, float("-inf"))
    return torch.softmax(s, -1) @ v


def attention_worker(cps) -> list:
    from omnitron.backends import get_backend
    from omnitron.core.parallel.context.ulysses import a2a_attention, allgather_attention

    torch.set_num_threads(1)
    coll, out = get_backend().collectives, []
    dev = get_backend().device()  # the backend under test's device
    for cp in cps:
        groups = ParallelGroups.build(ParallelConfig(context_parallel_size=cp), coll)
        for n, (hq, hkv) in enumerate(CASES):
            g = torch.Generator().manual_seed(10 * cp + n)  # the same full tensors on every rank
            b, s, d = 2, 8 * cp, 8
            q, dout = (torch.randn(b, hq, s, d, generator=g, dtype=torch.float64) for _ in range(2))
            k, v = (torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64) for _ in range(2))
            full = [t.clone().requires_grad_(True) for t in (q, k, v)]
            ref = _full(*full)
            ref.backward(dout)
            want = [split_sequence(t, 2, cp, groups.cp.rank) for t in [ref] + [t.grad for t in full]]
            for kind in ("a2a", "allgather"):
                mine = [split_sequence(t, 2, cp, groups.cp.rank).to(dev).requires_grad_(True) for t in (q, k, v)]
                if kind == "a2a":
                    o = a2a_attention(*mine, group=groups.cp, attend=_full)
                else:
                    o = allgather_attention(*mine, group=groups.cp, attend_masked=_masked)
                o.backward(split_sequence(dout, 2, cp, groups.cp.rank).to(dev))
                got = [t.cpu() for t in [o] + [t.grad for t in mine]]  # the reference above is on the host
                err = max(((a - w).abs().max() / w.abs().max()).item() for a, w in zip(got, want))
                out.append(((cp, kind, hq, hkv), err))
    return out


def test_a2a_and_allgather_attention_match_full_attention():
    # float64 throughout: the collectives move values exactly and the only difference from the reference is
    # the order of the softmax's and the GEMMs' sums over s <= 32 keys: relative error ~ s * 2^-53 < 1e-13
    for rank_result in run_distributed(attention_worker, 4, [2, 4]):
        assert len(rank_result) == 2 * 2 * len(CASES)
        for case, err in rank_result:
            assert err < 1e-12, (case, err)


def _train_args(root: str, *extra: str) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
            "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--seq-length", "16",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--num-workers", "0",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--optimizer", "sgd",
            "--lr", "0.5", "--clip-grad", "0.5", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--log-interval", "1", "--no-tensorboard", "--data-cache-path", root + "/cache", *extra]


MOE = ("--num-experts", "4", "--moe-router-topk", "2")
RUNS = {"a2a cp2": ("--context-parallel-size", "2", "--cp-comm-type", "a2a"),
        "allgather cp2": ("--context-parallel-size", "2", "--cp-comm-type", "allgather"),
        "per layer a2a, p2p cp2": ("--context-parallel-size", "2", "--cp-comm-type", "a2a", "p2p"),
        "per layer p2p, a2a cp2 pp2": ("--context-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                       "--cp-comm-type", "p2p", "a2a"),
        "a2a tp2 cp2 sp": ("--tensor-model-parallel-size", "2", "--context-parallel-size", "2", "--sequence-parallel",
                           "--cp-comm-type", "a2a"),
        "allgather cp2 dp2 zero": ("--context-parallel-size", "2", "--cp-comm-type", "allgather",
                                   "--use-distributed-optimizer"),
        "a2a cp4": ("--context-parallel-size", "4", "--cp-comm-type", "a2a"),
        "a2a cp2 pp2": ("--context-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--cp-comm-type", "a2a"),
        "moe: allgather cp2": ("--context-parallel-size", "2", "--cp-comm-type", "allgather", *MOE),
        "moe: a2a cp2 ep2": ("--context-parallel-size", "2", "--cp-comm-type", "a2a", "--expert-model-parallel-size",
                             "2", *MOE)}


def loop_worker(root: str, runs: dict, world: int) -> dict:
    """Each of ``runs`` ({name: flags}) trained by the loop at ``world`` ranks, a float64 model: its losses."""
    from omnitron.backends import get_backend
    from omnitron.core.training.loop import train

    torch.set_num_threads(1)
    return {name: list(train(settings_in(_train_args(f"{root}/{i}", *flags), world, torch.float64), get_backend())
                       ["losses"].values()) for i, (name, flags) in enumerate(runs.items())}


def one_process_losses(root: str, *flags: str) -> list[float]:
    """The loop's losses at one process on the host, a float64 model on the reference kernels."""
    from omnitron.backends import get_backend
    from omnitron.core.training.loop import train

    with reference_kernels():
        return list(train(settings_in(_train_args(root, *flags), 1, torch.float64), get_backend("cpu"))
                    ["losses"].values())


def run_layouts(root: str, runs: dict, world: int) -> list[dict]:
    """:func:`loop_worker` on ``world`` spawned ranks with the reference kernels (per rank: {name: losses})."""
    return run_distributed(loop_worker, world, root, runs, world, env=REFERENCE_KERNELS)


def test_training_under_each_type_matches_one_process(tmp_path):
    refs = {"dense": one_process_losses(str(tmp_path / "one")), "moe": one_process_losses(str(tmp_path / "m"), *MOE)}
    for res in run_layouts(str(tmp_path / "cp"), RUNS, 4):
        for name, losses in res.items():
            one = refs["moe" if name.startswith("moe") else "dense"]
            assert losses == pytest.approx(one, rel=LOOP_REL), (name, losses, one)


def test_refusals_name_the_constraint():
    from omnitron.core.training.arguments import parse_settings

    base = _train_args("/tmp/x")
    with pytest.raises(ConfigError, match="a2a splits each tensor-parallel rank's 2 attention heads over "
                                          "--context-parallel-size 4"):
        parse_settings(base + ["--tensor-model-parallel-size", "2", "--context-parallel-size", "4",
                               "--cp-comm-type", "a2a"], 8)
    with pytest.raises(ConfigError, match="a2a\\+p2p needs --hierarchical-context-parallel-sizes"):
        parse_settings(base + ["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"], 2)
    with pytest.raises(ConfigError, match="not one of p2p, a2a, allgather"):
        parse_settings(base + ["--cp-comm-type", "ring"], 1)


def test_per_layer_types_parse_and_refusals_name_the_constraint():
    """Megatron's ``--cp-comm-type`` list (nargs='+'): one value is every layer's type, several are one per layer
    (as many as --num-layers, TransformerConfig's assertion); each type's own constraints hold where it is used."""
    from omnitron.core.training.arguments import parse_settings

    base = _train_args("/tmp/x") + ["--context-parallel-size", "2"]
    assert parse_settings(base + ["--cp-comm-type", "a2a"], 2).parallel.cp_comm_type == "a2a"
    assert parse_settings(base + ["--cp-comm-type", "allgather", "p2p"], 2).parallel.cp_comm_type == ["allgather",
                                                                                                       "p2p"]
    with pytest.raises(ConfigError, match="--cp-comm-type gives 3 types for --num-layers 2"):
        parse_settings(base + ["--cp-comm-type", "p2p", "a2a", "p2p"], 2)
    with pytest.raises(ConfigError, match="a2a\\+p2p needs --hierarchical-context-parallel-sizes"):
        parse_settings(base + ["--cp-comm-type", "p2p", "a2a+p2p"], 2)
    with pytest.raises(ConfigError, match="a2a splits each tensor-parallel rank's 2 attention heads"):
        parse_settings(base + ["--tensor-model-parallel-size", "2", "--cp-comm-type", "p2p", "a2a",
                               "--context-parallel-size", "4"], 8)
    with pytest.raises(ConfigError, match="'ring' is not one of"):
        parse_settings(base + ["--cp-comm-type", "p2p", "ring"], 2)


def test_the_planner_refuses_a_per_layer_list_in_one_line(capsys):
    """``omnitron plan`` prices one type for every layer: a list is one error line (exit 2); the training log's
    memory table (--log-memory-estimate) raises the same one-line ConfigError, which the loop logs before training
    on (tests/plan/test_plan_cli.py's model-family case checks that log line)."""
    from omnitron.cli import main
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.memory import memory_table

    argv = _train_args("/tmp/x") + ["--context-parallel-size", "2", "--cp-comm-type", "p2p", "a2a"]
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "one --cp-comm-type for every layer" in err[0], err
    with pytest.raises(ConfigError, match="one --cp-comm-type for every layer") as info:
        memory_table(parse_settings(argv, 2))
    assert "\n" not in str(info.value)
