"""--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split train the tiny GPT with the
same per-step losses and final weights as one process (gloo; float64 with the reference kernels, as
``test_parity_3d.py``), at pp2 under 1F1B (embedding or loss alone: 7 layers, 3 + 4 or 4 + 3), interleaved
(both: 6 layers in 8 slots, vpp2 1-2-2-1 and vpp4, whose first and last chunks hold no layer: the embedding
alone, the output layer alone) and the V of zb-v (both ends on rank 0); the interleaved runs again with block
recomputation of each chunk's first layer (what ``omnitron plan`` recommends where a layout does not fit without:
chunks of 0, 1 and 2 layers recompute 0, 1 and 1). The chunks come from the training
code's ``build_model_chunks`` over a ParallelConfig carrying the flags, and each run reports its chunks' layer
counts, checked against hand-worked Megatron numbers.
"""
import dataclasses

import pytest
import torch

from omnitron.core.config import ParallelConfig
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.testing.distributed import REFERENCE_KERNELS, run_distributed
from omnitron.testing.parity import reference_kernels
from omnitron.testing.sim import requires_sim
from tests.parallel.test_parity_3d import SEED, _config, assert_run_matches, train_one_process
from tests.parallel.test_parity_vshape import MBS, SEQ, STEPS, TOL, train_chunks

M = 4
# TOL: test_parity_vshape.py's error analysis holds as it is (the same model, steps and sums; a chunk without
# layers adds no arithmetic)

# (schedule, layers, vpp, embedding, loss) -> layers of each (pp rank, chunk), worked by hand from Megatron's
# rule: N = layers + embedding + loss slots, N / (pp x vpp) per virtual stage, one fewer on the first (last)
RUNS = {
    ("1f1b", 7, None, True, False): {(0, 0): 3, (1, 0): 4},
    ("1f1b", 7, None, False, True): {(0, 0): 4, (1, 0): 3},
    ("interleaved", 6, 2, True, True): {(0, 0): 1, (1, 0): 2, (0, 1): 2, (1, 1): 1},
    ("interleaved", 6, 4, True, True): {(0, 0): 0, (1, 0): 1, (0, 1): 1, (1, 1): 1, (0, 2): 1, (1, 2): 1,
                                        (0, 3): 1, (1, 3): 0},
    ("zb-v", 6, 2, True, True): {(0, 0): 1, (1, 0): 2, (1, 1): 2, (0, 1): 1},  # stages 0, 1, 2, 3
}
BLOCK = {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1}
RUNS.update({(*key, "block1"): want for key, want in list(RUNS.items()) if key[0] == "interleaved"})


def _model(layers: int, recompute: str | None = None):
    return dataclasses.replace(_config(), num_layers=layers, **(BLOCK if recompute else {}))


def _data(layers: int) -> torch.Tensor:
    """Token ids: [STEPS, M micro-batches x MBS, SEQ + 1], fresh per model."""
    g = torch.Generator().manual_seed(200 + layers)
    return torch.randint(0, 96, (STEPS, MBS * M, SEQ + 1), generator=g)


def account_worker(runs) -> dict:
    from omnitron.backends import get_backend
    from omnitron.core.training.components import build_model_chunks

    be = get_backend()
    pp = torch.distributed.get_world_size()
    base = ParallelGroups.build(ParallelConfig(pipeline_model_parallel_size=pp), backend=be)
    out = {}
    for key in runs:
        sched, layers, vp, embedding, loss, *recompute = key
        groups = dataclasses.replace(base, config=ParallelConfig(
            pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
            account_for_embedding_in_pipeline_split=embedding, account_for_loss_in_pipeline_split=loss))
        built = build_model_chunks(_model(layers, *recompute), groups, SEED, be, sched)
        counts = {(groups.pp.rank, c): len(m.decoder.layers) for c, m in enumerate(built)}
        losses, state, _ = train_chunks(built, groups, sched, _data(layers), be)
        out[key] = (losses, state, counts)
    return out


def _check(per_rank: list[dict]) -> None:
    for key, want in RUNS.items():
        counts = {}
        for res in per_rank:
            counts.update(res[key][2])
        assert counts == want, (key, counts)
        with reference_kernels():
            ref = train_one_process(_data(key[1]), _model(key[1]))
        assert_run_matches(key, [res[key][:2] for res in per_rank], *ref, tol=TOL)


def test_parity_account_pp2():
    _check(run_distributed(account_worker, 2, list(RUNS), env=REFERENCE_KERNELS))


@pytest.mark.slow  # NOTE: sim stays in the default suite through tests/sim (training on sim equals cpu)
@requires_sim()
def test_parity_account_pp2_on_sim():
    _check(run_distributed(account_worker, 2, list(RUNS), backend="sim", env=REFERENCE_KERNELS))
