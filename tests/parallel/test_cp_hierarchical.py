"""--cp-comm-type a2a+p2p (hierarchical context parallelism, --hierarchical-context-parallel-sizes A P): the attention
function against plain causal attention on the whole sequence (float64, forward and gradients; GQA, attention dropout,
the degenerate 4x1 and 1x4 splits), the rank grid's sub-groups, the training loop against one process (a float64 model,
test_cp_comm_types' LOOP_REL per step) at cp4 = 2x2 (slow: 2x2 with GQA kv heads repeated, 4x1, 1x4, cp4 2x2 x dp2 with
the distributed optimizer: 8 ranks; tp2 x 2x2 with SP, 2x2 x pp2, MoE with ep1 and ep2), and the refusals."""
from __future__ import annotations

import pytest
import torch

from omnitron.core.config import ParallelConfig
from omnitron.core.config.parallel import ConfigError
from omnitron.core.parallel.context import split_sequence
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.core.parallel.grid import rank_grid
from omnitron.testing.distributed import run_distributed
# the same tiny GQA/RoPE model, settings and float64 loop comparison as the other comm types
from test_cp_comm_types import LOOP_REL, _train_args, one_process_losses, run_layouts

# (hq, hkv, dtype, dropout p)
CASES = [(4, 4, torch.float64, 0.0), (4, 2, torch.float64, 0.0), (4, 1, torch.float64, 0.0),
         (8, 2, torch.float64, 0.0), (4, 2, torch.float32, 0.0), (4, 2, torch.float64, 0.3)]
SIZES = [(2, 2), (4, 1), (1, 4)]
DROP_SEED = 1234


def _full(q, k, v, drop=None):
    """softmax(q k^T / sqrt(d), causal) (* dropout) v on the whole sequence, key/value heads repeated."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    n = q.shape[2]
    p = torch.softmax(s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf")), -1)
    return (p if drop is None else p * drop) @ v


def _full_dropout(shape, p: float) -> torch.Tensor:
    """The hash dropout multipliers ``[b, hq, s, s]`` of the whole sequence: a2a+p2p's ring numbers member ``j``'s
    heads from ``j hq / A`` at the super-chunks' global positions, so it draws exactly these."""
    from omnitron.kernels.hash_dropout import HashDropout

    b, hq, s, _ = shape
    pos = torch.arange(s)
    return HashDropout(DROP_SEED, p, pos, pos).multiplier(b, hq, slice(None), torch.float64)


def attention_worker(sizes: list) -> list:
    from omnitron.backends import get_backend
    from omnitron.core.parallel.context.hierarchical import a2a_p2p_attention

    torch.set_num_threads(1)
    coll, out = get_backend().collectives, []
    for a, p2p in sizes:
        cp = a * p2p
        groups = ParallelGroups.build(ParallelConfig(context_parallel_size=cp, cp_comm_type="a2a+p2p",
                                                     hierarchical_context_parallel_sizes=[a, p2p]), coll)
        rank = groups.cp.rank
        for n, (hq, hkv, dtype, p) in enumerate(CASES):
            if p and p2p == 1:
                continue  # no ring: the caller's attention kernel draws the masks (tested with a2a)
            g = torch.Generator().manual_seed(1000 * a + 10 * p2p + n)  # the same full tensors on every rank
            b, s, d = 2, 8 * cp, 8
            q, dout = (torch.randn(b, hq, s, d, generator=g, dtype=torch.float64) for _ in range(2))
            k, v = (torch.randn(b, hkv, s, d, generator=g, dtype=torch.float64) for _ in range(2))
            full = [t.clone().requires_grad_(True) for t in (q, k, v)]
            drop = _full_dropout(q.shape, p) if p else None
            ref = _full(*full, drop)
            ref.backward(dout)
            want = [split_sequence(t, 2, cp, rank) for t in [ref] + [t.grad for t in full]]
            dev = get_backend().device()  # the backend under test's device; the reference above on the host
            mine = [split_sequence(t, 2, cp, rank).to(dev, dtype).requires_grad_(True) for t in (q, k, v)]
            o = a2a_p2p_attention(*mine, a2a_group=groups.cp_a2a, p2p_group=groups.cp_p2p, collectives=coll,
                                  attend=_full, dropout_p=p, seed=DROP_SEED)
            o.backward(split_sequence(dout, 2, cp, rank).to(dev, dtype))
            got = [t.cpu() for t in [o] + [t.grad for t in mine]]
            err = max(((x.double() - w).abs().max() / w.abs().max()).item() for x, w in zip(got, want))
            dropped = p == 0 or 0.2 < (drop == 0)[:, :, torch.ones(s, s, dtype=torch.bool).tril()].double().mean() < 0.4
            out.append(((a, p2p, hq, hkv, str(dtype), p), err, o.dtype == dtype and bool(dropped)))
    return out


def test_a2a_p2p_attention_matches_full_attention():
    # float64: the collectives move values exactly; the only difference from the reference is the order of the
    # softmax's and the GEMMs' sums over s <= 32 keys (~1e-15); fp32 inputs run the ring's blocks in fp32:
    # rounding the inputs (u = 6e-8) and summing k <= 32 terms of O(1) values gives ~sqrt(k) u ~ 3.4e-7 per
    # element (random-walk rounding), a few times that through softmax, its merge and backward; the error is
    # taken relative to each tensor's largest element, so 2e-6 holds with margin (a misplaced chunk gives ~1)
    results = run_distributed(attention_worker, 4, SIZES)
    for rank_result in results:
        assert len(rank_result) == len(SIZES) * len(CASES) - 1
        for case, err, ok in rank_result:
            tol = 1e-12 if case[4] == "torch.float64" else 2e-6
            assert ok and err < tol, (case, err)


def test_sub_groups_split_each_cp_group():
    """a2a groups: A consecutive ranks of a cp group; p2p groups: the ranks A apart; tp-strided world ranks."""
    cfg = ParallelConfig(tensor_model_parallel_size=2, context_parallel_size=4, cp_comm_type="a2a+p2p",
                         hierarchical_context_parallel_sizes=[2, 2])
    grid = rank_grid(cfg, 16)
    assert grid["cp"][0] == [0, 2, 4, 6]
    assert [0, 2] in grid["cp_a2a"] and [4, 6] in grid["cp_a2a"] and [0, 4] in grid["cp_p2p"]
    assert [2, 6] in grid["cp_p2p"] and len(grid["cp_a2a"]) == len(grid["cp_p2p"]) == 8
    for cp_group in grid["cp"]:
        a2a = [m for m in grid["cp_a2a"] if m[0] in cp_group]
        p2p = [m for m in grid["cp_p2p"] if m[0] in cp_group]
        assert sorted(r for m in a2a for r in m) == cp_group == sorted(r for m in p2p for r in m)
    assert "cp_a2a" not in rank_grid(ParallelConfig(context_parallel_size=4), 4)


def _hier(a: int, p: int, *extra: str) -> tuple:
    return ("--context-parallel-size", str(a * p), "--cp-comm-type", "a2a+p2p",
            "--hierarchical-context-parallel-sizes", str(a), str(p), *extra)


def _check_against_one_process(tmp_path, runs: dict, world: int, ref_flags: tuple = ()) -> None:
    one = one_process_losses(str(tmp_path / "one"), *ref_flags)
    for res in run_layouts(str(tmp_path / "cp"), runs, world):
        for name, losses in res.items():
            # float64: LOOP_REL's analysis (the a2a and p2p levels' block-wise softmax merges are more orders of
            # the same <= 16-key sums)
            assert losses == pytest.approx(one, rel=LOOP_REL), (name, losses, one)


def test_training_a2a_p2p_cp4_matches_one_process(tmp_path):
    _check_against_one_process(tmp_path, {"a2a+p2p cp4 2x2": _hier(2, 2)}, 4)


@pytest.mark.slow
def test_training_a2a_p2p_variants_match_one_process(tmp_path):
    # 2x2 with one query group (kv heads repeated before the all-to-all); the degenerate splits
    _check_against_one_process(tmp_path, {"2x2 gqa1": _hier(2, 2, "--num-query-groups", "1")}, 4,
                               ("--num-query-groups", "1"))
    _check_against_one_process(tmp_path / "deg", {"4x1": _hier(4, 1), "1x4": _hier(1, 4)}, 4)


@pytest.mark.slow
def test_training_a2a_p2p_with_distributed_optimizer_matches_one_process(tmp_path):
    _check_against_one_process(tmp_path, {"2x2 dp2 zero": _hier(2, 2, "--use-distributed-optimizer")}, 8)


def test_refusals_name_the_constraint():
    from omnitron.core.training.arguments import parse_settings

    base = _train_args("/tmp/x")
    cases = [
        (("--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2",
          "1"), 4, "a2a size x p2p size = 2 is not --context-parallel-size 4"),
        (("--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "4"),
         4, "takes two sizes \\(a2a, p2p\\), got 1"),
        (("--context-parallel-size", "8", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2",
          "2", "2"), 8, "takes two sizes \\(a2a, p2p\\), got 3"),
        (("--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p"), 4,
         "a2a\\+p2p needs --hierarchical-context-parallel-sizes A P"),
        (("--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "2"), 4,
         "only applies to --cp-comm-type a2a\\+p2p"),
        (("--tensor-model-parallel-size", "2", *_hier(4, 1)), 8,
         "a2a\\+p2p splits each tensor-parallel rank's 2 attention heads over the a2a size 4"),
        ((*_hier(2, 2), "--reset-attention-mask"), 4, "--reset-attention-mask with --context-parallel-size 4"),
        (("--cp-comm-type", "ring"), 1, "not one of p2p, a2a, allgather, a2a\\+p2p"),
    ]
    for flags, world, msg in cases:
        with pytest.raises(ConfigError, match=msg):
            parse_settings(base + list(flags), world)
    with pytest.raises(ConfigError, match="must be positive integers"):
        ParallelConfig(context_parallel_size=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[0, 4])


MOE = ("--num-experts", "4", "--moe-router-topk", "2")


@pytest.mark.slow
def test_training_a2a_p2p_with_tp_sp_and_pp_matches_one_process(tmp_path):
    # 8 ranks: tp2 (one head pair and one kv head per tp rank, repeated for the a2a of size 2) with sequence
    # parallelism, and a pipeline of two one-layer stages, each around cp4 = 2x2
    _check_against_one_process(tmp_path, {
        "tp2 sp x 2x2": ("--tensor-model-parallel-size", "2", "--sequence-parallel", *_hier(2, 2)),
        "2x2 x pp2": (*_hier(2, 2), "--pipeline-model-parallel-size", "2")}, 8)


@pytest.mark.slow
def test_training_a2a_p2p_with_moe_matches_one_process(tmp_path):
    # 4 experts, top-2: whole experts on every rank, and experts split over ep2 inside the 4 cp ranks
    _check_against_one_process(tmp_path, {"moe 2x2": (*_hier(2, 2), *MOE),
                                          "moe 2x2 ep2": (*_hier(2, 2), "--expert-model-parallel-size", "2", *MOE)},
                               4, MOE)
