"""Parameter, gradient and optimizer bytes predicted by omnitron.plan equal the tensors a real built
``Components`` holds, byte for byte, in one process and on 4 gloo ranks (tp2 x pp2; pp2 x dp2 with the
distributed optimizer and small buckets, so bucket padding and the tied embedding's isolated bucket count; the
same under the V-shaped zb-v schedule, whose rank 0 holds both tied copies, and with the embedding and the loss
counted as layers, whose end chunks hold no layer).
The reference is measured on the live objects: parameter storages, the gradient buffers' tensors and
``optimizer.state_bytes()`` (storages of masters and moments). Exact: both sides are integer byte counts."""
from __future__ import annotations

import os

import pytest

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim


def _args(root: str, tp: int, pp: int, extra: list[str]) -> list[str]:
    return ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            "200", "--num-workers", "0", "--micro-batch-size", "1", "--train-iters", "2", "--no-tensorboard",
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--data-cache-path", os.path.join(root, "cache"), *extra]


def _measured(args: list[str], world: int) -> tuple[int, tuple[int, int, int]]:
    """(pipeline rank, (params, grads, optimizer) bytes) of this rank's built components."""
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.components import build_components

    c = build_components(parse_settings(args, world), get_backend())
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for m in c.modules for p in m.parameters()}
    grads = sum(b.data.numel() * b.data.element_size() for ch in c.chunks for b in ch.buffers)
    return c.groups.pp.rank, (sum(storages.values()), grads, c.optimizer.state_bytes())


def _predicted(args: list[str], world: int, pp_rank: int) -> tuple[int, int, int]:
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.memory import model_config
    from omnitron.plan.state import state_bytes

    s = parse_settings(args, world)
    st = state_bytes(s, model_config(s), pp_rank)
    return st.params, st.grads, st.optimizer


BUCKETS = ["--overlap-grad-reduce", "--ddp-bucket-size"]  # small buckets (Megatron's: only with overlap)
ONE = {"fp32": [], "bf16": ["--bf16"], "fp16_sgd": ["--fp16", "--optimizer", "sgd"],
       "bf16_distopt_small_buckets": ["--bf16", "--use-distributed-optimizer", *BUCKETS, "3000"],
       "bf16_muon_distopt": ["--bf16", "--optimizer", "muon", "--use-distributed-optimizer"],
       "fp16_moments": ["--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer", "--exp-avg-dtype",
                        "fp16", "--exp-avg-sq-dtype", "fp16"],
       "bf16_moments_distopt": ["--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer",
                                "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16", *BUCKETS, "3000"]}


@pytest.mark.parametrize("name", list(ONE))
def test_one_process_exact(name, tmp_path):
    args = _args(str(tmp_path), 1, 1, ONE[name])
    rank, real = run_distributed(_measured, 1, args, 1)[0]
    assert _predicted(args, 1, rank) == real


FOUR = {"tp2_pp2_bf16": (2, 2, ["--bf16", "--sequence-parallel"]),
        "pp2_dp2_distopt": (1, 2, ["--bf16", "--use-distributed-optimizer", *BUCKETS, "3000",
                                   "--global-batch-size", "4"]),
        "dp4_distopt_fp32": (1, 1, ["--use-distributed-optimizer", *BUCKETS, "1000",
                                    "--global-batch-size", "4"]),
        # fp32 weights are their own masters; only the moments (exp_avg bf16, exp_avg_sq fp32) are stored
        "dp4_distopt_bf16_exp_avg": (1, 1, ["--use-distributed-optimizer", *BUCKETS, "1000",
                                            "--global-batch-size", "4", "--use-precision-aware-optimizer",
                                            "--exp-avg-dtype", "bf16"]),
        # fp16 moments: one fp32 scale per owned slice (parameters straddling the small buckets' shards count twice)
        "pp2_dp2_distopt_fp16_moments": (1, 2, ["--bf16", "--use-distributed-optimizer", *BUCKETS, "3000",
                                                "--global-batch-size", "4", "--use-precision-aware-optimizer",
                                                "--exp-avg-dtype", "fp16", "--exp-avg-sq-dtype", "fp16"]),
        # the V placement: rank 0 holds the embedding, the head's tied copy and layers 0 and 3
        "pp2_dp2_zb_v_distopt": (1, 2, ["--pipeline-schedule", "zb-v", "--num-layers-per-virtual-pipeline-stage", "1",
                                        "--bf16", "--use-distributed-optimizer", *BUCKETS, "3000",
                                        "--global-batch-size", "4"]),
        # the embedding and the loss counted as layers: 6 slots at pp2 x vpp3, the end chunks hold no layer
        "pp2_dp2_account_vp3_distopt": (1, 2, ["--account-for-embedding-in-pipeline-split",
                                               "--account-for-loss-in-pipeline-split",
                                               "--num-layers-per-virtual-pipeline-stage", "1", "--bf16",
                                               "--use-distributed-optimizer", *BUCKETS, "3000",
                                               "--global-batch-size", "4"])}


@pytest.mark.parametrize("name", list(FOUR))
def test_four_ranks_exact(name, tmp_path):
    tp, pp, extra = FOUR[name]
    args = _args(str(tmp_path), tp, pp, extra)
    results = run_distributed(_measured, 4, args, 4)
    for rank, real in results:
        # the distributed optimizer's slices differ by rank: the model reports the largest of them
        assert _predicted(args, 4, rank)[:2] == real[:2]
    for stage in {r for r, _ in results}:
        assert _predicted(args, 4, stage)[2] == max(real[2] for r, real in results if r == stage)


def _allocated_by_a_second_optimizer(args: list[str], world: int) -> tuple[int, int, int, int, int]:
    """(pipeline rank, a second copy of this rank's optimizer: its state bytes, its tensors' 512-byte blocks, the
    bytes the backend's allocator holds for it and the peak's rise while building it)."""
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.components import build_components, build_optimizer

    be = get_backend()
    s = parse_settings(args, world)
    c = build_components(s, be)
    opt = c.optimizer
    named = list(zip(opt.names, opt.params))
    dups = [p for p in opt.params if id(p) in opt.duplicates]
    before = be.memory_stats()["allocated"]
    be.reset_peak_memory_stats()
    second = build_optimizer(named, s, c.groups, be, c.chunks, dups)
    stats = be.memory_stats()
    blocks = sum(-(-t.untyped_storage().nbytes() // 512) * 512  # the sim allocator's 512-byte blocks
                 for t in [*(m if r is None else r for m, r in zip(second.masters, second.remainders)),
                           *(t for v in second.state.values() for t in v)] if t.numel())
    return (c.groups.pp.rank, second.state_bytes(), blocks, stats["allocated"] - before,
            stats["peak_allocated"] - before)


@requires_sim()
def test_sim_allocator_holds_the_planned_optimizer_bytes(tmp_path):
    """On the sim accelerator building the optimizer (bf16 moments, masters as int16 remainders beside the bf16
    parameters; dp2: each rank's slices) raises
    the allocator's held bytes and its peak alike (no transient copy) by the tensors' 512-byte blocks, and those
    tensors' bytes are the plan's optimizer bytes (the largest rank's)."""
    args = _args(str(tmp_path), 1, 1, ONE["bf16_moments_distopt"] + ["--global-batch-size", "2"])
    results = run_distributed(_allocated_by_a_second_optimizer, 2, args, 2, backend="sim")
    for rank, _, blocks, held, peak in results:
        assert held == peak == blocks, (rank, held, peak, blocks)
    assert max(r[1] for r in results) == _predicted(args, 2, 0)[2]


BOUND = {"adam_fp32": [], "adam_bf16_distopt": ["--bf16", "--use-distributed-optimizer"],
         "muon_bf16": ["--bf16", "--optimizer", "muon"], "muon_fp32_untied": ["--optimizer", "muon",
                                                                             "--untie-embeddings-and-output-weights"],
         "sgd": ["--optimizer", "sgd"], "onebit": ["--optimizer", "onebit_adam"],
         "bf16_moments": ["--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer",
                          "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "fp16"]}


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("name", list(BOUND))
def test_the_searchs_state_bound_is_below_every_layouts_state(name, pp, tmp_path):
    """``recommend`` drops a layout whose ``state_lower_bound`` exceeds the memory, so the bound must not exceed the
    largest stage's parameter + gradient + optimizer bytes (Muon keeps one fp32 word for the matrices it
    orthogonalises, two for the rest: the bound may count one). Exact integer byte counts on both sides."""
    _bound_below_state(_args(str(tmp_path), 1, pp, BOUND[name]), pp, pp)


def _bound_below_state(args: list[str], world: int, pp: int) -> None:
    """``state_lower_bound`` of these settings is at most the largest stage's predicted state (exact integers)."""
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.memory import model_config
    from omnitron.plan.recommend import state_lower_bound
    from omnitron.plan.state import state_bytes

    s = parse_settings(args, world)
    most = max(st.params + st.grads + st.optimizer for st in (state_bytes(s, model_config(s), r) for r in range(pp)))
    assert state_lower_bound(s) <= most, (state_lower_bound(s), most)


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("name", [n for n, flags in BOUND.items() if "--use-distributed-optimizer" in flags])
def test_the_state_bound_shares_the_optimizer_over_data_parallel_ranks(name, pp, tmp_path):
    """At dp 4 the distributed optimizer's state is a quarter of it on each rank: the bound divides it too (one that
    did not would exceed the layout's state and drop layouts that fit)."""
    _bound_below_state(_args(str(tmp_path), 1, pp, [*BOUND[name], "--global-batch-size", "4"]), 4 * pp, pp)


def held(args: list[str], world: int, float64: bool = False) -> tuple[int, tuple[int, int, int], tuple]:
    """(pipeline rank, measured bytes, predicted bytes) of this rank's built components (a float64 model with
    ``float64``): parameters (every local tensor's storage: FSDP2's shards are DTensors), gradient buffers
    (``main_grad``; FSDP2, which has none before a backward: its gradient shards, as large as the parameter
    shards) and ``optimizer.state_bytes()``, against :func:`state_bytes` on the same settings."""
    import dataclasses

    import torch

    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.components import build_components
    from omnitron.plan.memory import model_config
    from omnitron.plan.state import state_bytes

    s = parse_settings(args, world)
    if float64:
        s = dataclasses.replace(s, model=dataclasses.replace(s.model, params_dtype=torch.float64))
    c = build_components(s, get_backend())
    local = [getattr(p, "_local_tensor", p) for m in c.modules for p in m.parameters()]
    assert not float64 or all(t.dtype == torch.float64 for t in local)
    params = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in local}.values())
    buffers = [b for ch in c.chunks if isinstance(getattr(ch, "buffers", None), list) for b in ch.buffers]
    grads = sum(b.data.numel() * b.data.element_size() for b in buffers)
    if not buffers:  # FSDP2: a gradient shard per parameter, as large as its parameter shard
        grads = params
    st = state_bytes(s, model_config(s), c.groups.pp.rank)
    return c.groups.pp.rank, (params, grads, c.optimizer.state_bytes()), (st.params, st.grads, st.optimizer)


F64 = {"one": (1, []), "sgd": (1, ["--optimizer", "sgd"]),
       "fp32_accumulation": (1, ["--accumulate-allreduce-grads-in-fp32"]),
       "dp2_distopt": (2, ["--use-distributed-optimizer", *BUCKETS, "1000", "--global-batch-size", "2"]),
       "dp2_fsdp2": (2, ["--use-torch-fsdp2", "--global-batch-size", "2"])}


@pytest.mark.parametrize("name", list(F64))
def test_float64_model_exact(name, tmp_path):
    """A float64 parameter is its own master, its gradient and moments float64: the count equals what the built
    float64 run holds (it counted fp32 masters and moments and fp32 FSDP2 shards: 28 bytes a parameter for the
    32 Adam holds). Exact: integer byte counts; the distributed optimizer's largest slice over the ranks."""
    world, extra = F64[name]
    results = run_distributed(held, world, _args(str(tmp_path), 1, 1, extra), world, True)
    real = tuple(max(r[1][i] for r in results) for i in range(3))
    assert results[0][2] == real


def _bound_and_held(args: list[str]) -> tuple[float, tuple[int, int, int]]:
    """(``state_lower_bound``, the bytes a built float64 run holds: parameters, gradient buffers, optimizer)."""
    import dataclasses

    import torch

    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.recommend import state_lower_bound

    s = parse_settings(args, 1)
    bound = state_lower_bound(dataclasses.replace(s, model=dataclasses.replace(s.model, params_dtype=torch.float64)))
    return bound, held(args, 1, True)[1]


@pytest.mark.parametrize("name", ["one", "sgd", "fp32_accumulation", "muon"])
def test_float64_state_bound_counts_float64_words(name, tmp_path):
    """The search's state bound of a float64 model against the bytes the built float64 run holds (one rank, one
    stage, no bucket padding): equal for AdamW and SGD, whose every element keeps the same words (parameter,
    gradient -- float64 also under --accumulate-allreduce-grads-in-fp32, which widens bf16 / fp16 only -- and
    moments, all float64); Muon's counts every element's parameter, gradient and one optimizer word (its matrices'
    momentum; the rest keep two), 24 bytes. The bound counted the moments (and Muon's word, and the fp32-accumulated
    gradient) as fp32: 2/3 of AdamW's held bytes. Exact integer byte counts."""
    extra = {"one": [], "sgd": ["--optimizer", "sgd"], "muon": ["--optimizer", "muon"],
             "fp32_accumulation": ["--accumulate-allreduce-grads-in-fp32"]}[name]
    bound, real = _bound_and_held(_args(str(tmp_path), 1, 1, [*extra, "--make-vocab-size-divisible-by", "8"]))
    assert bound == (3 * real[0] if name == "muon" else sum(real))  # real[0]: 8 bytes an element


@pytest.mark.parametrize("tp,pp,ep,etp", [(2, 1, 2, 2), (2, 2, 2, 2), (2, 2, 2, 1), (2, 1, 4, 2)])
def test_expert_replica_group_is_the_rank_grids(tp, pp, ep, etp, tmp_path):
    """The planner's expert data-parallel size (the replica group its expert gradients and distributed-optimizer
    slices are counted over) is the size of the engine's own ``edp`` group on a 16-rank grid, expert tensor
    parallelism included (a size that left out etp counted the expert slices over twice the ranks at etp 2)."""
    from omnitron.core.parallel.grid import rank_grid
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.state import expert_data_parallel_size

    world = 16
    s = parse_settings(_args(str(tmp_path), tp, pp, ["--num-experts", "4", "--moe-router-topk", "2",
                                                     "--expert-model-parallel-size", str(ep),
                                                     "--expert-tensor-parallel-size", str(etp)]), world)
    sizes = {len(members) for members in rank_grid(s.parallel, world)["edp"]}
    assert sizes == {expert_data_parallel_size(s)}, (sizes, expert_data_parallel_size(s))


def _onebit_measured(args: list[str], world: int) -> tuple[int, int, int, int]:
    """The built 1-bit Adam's (state bytes, server error bytes, worker error bytes, parameter elements)."""
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.components import build_components

    c = build_components(parse_settings(args, world), get_backend())
    opt, elements = c.optimizer, sum(p.numel() for m in c.modules for p in m.parameters())
    return (opt.state_bytes(), sum(e.server.untyped_storage().nbytes() for e in opt.errors),
            sum(e.worker.untyped_storage().nbytes() for e in opt.errors), elements)


@pytest.mark.parametrize("dp", [1, 2])
def test_onebit_adam_state_is_the_built_optimizers(dp, tmp_path):
    """1-bit Adam's predicted optimizer bytes (bf16: fp32 masters, two moments and the worker error, a word each per
    parameter element, and the server error, a word per element of the 1/dp of them this rank owns) equal the built
    optimizer's storages on every rank with its error buffers counted unpadded (the built ones pad each compressed
    buffer to a multiple of dp x 256 elements: the worker's 4 bytes an element, the server's 4 / dp). The server
    error was left out of the plan before (4 bytes an element at dp1, 2 at dp2: this fails then)."""
    args = _args(str(tmp_path), 1, 1, ["--bf16", "--optimizer", "onebit_adam"])
    for real, server, worker, elements in run_distributed(_onebit_measured, dp, args, dp):
        assert server * dp == worker  # the owned chunk of the worker's padded buffer
        want = real - server - worker + 4 * elements + 4 * -(-elements // dp)
        assert _predicted(args, dp, 0)[2] == want, (real, server, worker, elements)


@pytest.mark.parametrize("dp_cp", [2, 3, 5])
def test_fsdp2_rank_0_shard_is_the_first_chunk_of_every_parameters_rows(dp_cp):
    """FSDP2 shards every parameter on dim 0 as ``torch.chunk`` does (rank 0's chunk the largest, ceil(rows / n)
    rows): on random shapes whose rows the data-parallel size mostly does not divide, the planned fp32 parameter
    and gradient bytes are rank 0's chunks' bytes (reference: torch.chunk of a tensor of each shape), and the
    optimizer's the same elements times Adam's per-element bytes."""
    import random

    import torch

    from omnitron.core.config.training import OptimizerConfig
    from omnitron.plan.state import _fsdp2_bytes, master_bytes, moment_bytes

    rng = random.Random()
    seed = rng.randrange(2**31)
    rng.seed(seed)
    shapes = [(rng.randrange(1, 40),) + ((rng.randrange(1, 9),) if rng.random() < 0.7 else ()) for _ in range(6)]
    module = torch.nn.Module()
    for i, shape in enumerate(shapes):
        module.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros(shape)))
    n = sum(torch.chunk(torch.empty(shape), dp_cp, 0)[0].numel() for shape in shapes)
    optim = OptimizerConfig()
    got = _fsdp2_bytes([module], dp_cp, optim)
    per = moment_bytes(optim, dtype=torch.float32) + master_bytes(optim, torch.float32)
    assert (got.params, got.grads, got.optimizer) == (4 * n, 4 * n, per * n), (seed, shapes)
