"""Resume is bit-exact: 2N iterations == N, save, resume for N more (same layout), dropout on; the validation
evaluations (every 2 iterations and after training) too.

One spawn per layout runs fp32 and bf16: the uninterrupted run, the run stopped by
--exit-interval N (which saves), and the resumed run; per-iteration losses must be identical.
The same spawn also trains with dropout off (at tp2 x pp2 also interleaved + SP + recompute, and
with uneven stages via --decoder-first-pipeline-num-layers) and tight gradient clipping, whose losses must equal
the one-process run of the training loop (a float64 model, PARITY_REL): the loop's gradient reduction, clipping
norm and optimizer are layout-independent.
"""
from __future__ import annotations

import os

import pytest

from omnitron.testing.distributed import run_distributed
from omnitron.testing.parity import ADAM_LOOP_REL

N = 3
PARITY_REL = ADAM_LOOP_REL  # the parity runs: a float64 model, 2N = 6 AdamW steps (the bound's analysis)


def _args(tp, pp, dtype, save, extra=()):
    args = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--hidden-dropout", "0.2", "--attention-dropout", "0.2",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200", "--num-workers", "0",
            "--micro-batch-size", "1", "--global-batch-size", str(2 * (4 // (tp * pp))), "--train-iters", str(2 * N),
            "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "1", "--seed", "7", "--no-tensorboard",
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--save", save, "--data-cache-path", os.path.join(save, "cache"),
            "--eval-interval", "2", "--eval-iters", "1"]
    if dtype == "bf16":
        args.append("--bf16")
    return args + list(extra)


VP_SP_RECOMPUTE = ["--num-layers-per-virtual-pipeline-stage", "1", "--sequence-parallel", "--recompute-granularity",
                   "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]


UNEVEN = ["--decoder-first-pipeline-num-layers", "1"]


def _parity(tp, pp, root, world, be, extra=()) -> dict:
    """The parity run's losses: a float64 model, dropout off, tight clipping (``_parity_args``)."""
    import torch

    from omnitron.core.training.loop import train
    from omnitron.testing.training import settings_in

    return train(settings_in(_parity_args(tp, pp, root, extra), world, torch.float64), be)["losses"]


def _parity_args(tp, pp, root, extra=()):
    return _args(tp, pp, "fp32", os.path.join(root, f"parity{tp}{pp}{len(extra)}"),
                 ["--hidden-dropout", "0", "--attention-dropout", "0", "--clip-grad", "0.05",
                  "--global-batch-size", "4",
                  *extra])


def _stage_layers(settings, be) -> int:
    """Transformer layers this rank's stage holds under ``settings``' layout."""
    from dataclasses import replace

    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.training.components import build_model_chunks

    groups = ParallelGroups.build(settings.parallel, be.collectives)
    cfg = replace(settings.model, vocab_size=201)
    return sum(len(chunk.decoder.layers) for chunk in build_model_chunks(cfg, groups, 7, be))


def _worker(tp, pp, root):
    import torch.distributed as dist

    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    be = get_backend()
    out = {}
    for dtype in ("fp32", "bf16"):
        base = os.path.join(root, dtype)
        full = train(parse_settings(_args(tp, pp, dtype, os.path.join(base, "full")), dist.get_world_size()), be)
        part = os.path.join(base, "part")
        first = train(parse_settings(_args(tp, pp, dtype, part, ["--exit-interval", str(N)]), dist.get_world_size()),
                      be)
        second = train(parse_settings(_args(tp, pp, dtype, part, ["--load", part]), dist.get_world_size()), be)
        out[dtype] = (full["losses"], first["losses"], second["losses"])
        out[dtype + "_validation"] = (full["validation"], first["validation"] + second["validation"])
    out["parity"] = _parity(tp, pp, root, dist.get_world_size(), be)
    if (tp, pp) == (2, 2):  # interleaved schedule, sequence parallelism and full recomputation on top
        out["parity_vp"] = _parity(tp, pp, root, dist.get_world_size(), be, VP_SP_RECOMPUTE)
        # uneven stages: 1 layer (+ embedding) on the first stage, 3 (+ output layer) on the last
        out["parity_uneven"] = _parity(tp, pp, root, dist.get_world_size(), be, UNEVEN)
        out["uneven_layers"] = _stage_layers(parse_settings(_parity_args(tp, pp, root, UNEVEN), dist.get_world_size()),
                                             be)
    return out


@pytest.mark.parametrize("tp,pp", [(2, 2), pytest.param(1, 1, marks=pytest.mark.slow)])  # one process: slow (every
# torch_dist round-trip test resumes one-process layouts too)
def test_resume_bit_exact(tp, pp, tmp_path):
    world = 4 if (tp, pp) == (2, 2) else 2
    results = run_distributed(_worker, world, tp, pp, str(tmp_path), timeout_s=600)
    for dtype in ("fp32", "bf16"):
        full, first, second = results[0][dtype]
        assert sorted(full) == list(range(1, 2 * N + 1))
        assert sorted(first) == list(range(1, N + 1)) and sorted(second) == list(range(N + 1, 2 * N + 1))
        resumed = {**first, **second}
        assert resumed == full, (dtype, full, resumed)  # exact float equality, every iteration
        assert len(set(full.values())) > 1
        for r in results[1:]:
            assert r[dtype][0] == full  # every rank reports the same losses
        # the validation stream (Megatron's one iterator, --eval-iters new batches an evaluation) resumes where the
        # evaluations before the checkpoint left it: the resumed run's evaluations at 4 and 6 and the final one
        # read the uninterrupted run's batches, so their losses are equal (dropout is off in evaluation)
        whole, pieces = results[0][dtype + "_validation"]
        assert [v["iteration"] for v in whole] == [2, 4, 6, 6] and [v["iteration"] for v in pieces] == [2, 4, 6, 6]
        assert [v["val_loss"] for v in pieces] == [v["val_loss"] for v in whole], (dtype, whole, pieces)
        assert len({v["val_loss"] for v in whole}) == 4  # each evaluation read other batches
    from omnitron.backends import get_backend

    single = _parity(1, 1, str(tmp_path / "single"), 1, get_backend("cpu"))
    if (tp, pp) == (2, 2):  # ranks 0-1 are the first stage, 2-3 the last
        assert [r["uneven_layers"] for r in results] == [1, 1, 3, 3]
    for key in ("parity", "parity_vp", "parity_uneven"):
        if key not in results[0]:
            continue
        got = results[0][key]
        assert sorted(single) == sorted(got)
        for it, loss in single.items():
            assert abs(got[it] - loss) <= PARITY_REL * abs(loss), (key, it, got, single)
