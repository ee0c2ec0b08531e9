"""Megatron-LM's legacy ``distrib_optim.pt`` read into per-parameter Adam state, on checkpoints written by
Megatron's own code (tests/checkpoint/megatron_optim/make_fixtures.py, which says how to re-run it): megatron-core
GPT models at tp 1 / 2, pp 1 / 2 with virtual chunks, dp 1 / 2, with and without --overlap-grad-reduce buckets.
Each rank's decoded ``exp_avg`` / ``exp_avg_sq`` equal, bit for bit, what that rank's optimizer held
(``held.pt``, written beside the files), and the fp32 main parameters equal the saved weights."""
from __future__ import annotations

import os
import tarfile

import pytest
import torch

from omnitron.core.checkpoint.megatron import read_shards, resolve_dir
from omnitron.core.checkpoint.megatron_base import MegatronConversionError
from omnitron.core.checkpoint.megatron_optim import read_rank_moments

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_optim")
CASES = ["tp1_dp1", "tp2_dp2", "pp2_vp2_dp2"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron_optim")
    with tarfile.open(os.path.join(HERE, "megatron_checkpoints.tar.xz")) as tar:
        tar.extractall(out, filter="data")
    return str(out)


@pytest.mark.parametrize("case", CASES)
def test_moments_are_what_megatron_held(root, case):
    iter_dir = resolve_dir(os.path.join(root, case))
    args, shards = read_shards(iter_dir)
    got = read_rank_moments(iter_dir, args, shards)
    pp = int(args.get("pipeline_model_parallel_size") or 1)
    for (t, p), chunks in shards.items():
        rank = os.path.join(iter_dir, f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else ""))
        held = torch.load(os.path.join(rank, "held.pt"), weights_only=True)
        assert len(held) == len(chunks) == len(got["exp_avg"][(t, p)])
        for c, (want, sd) in enumerate(zip(held, chunks)):
            assert set(got["exp_avg"][(t, p)][c]) == set(want), (t, p, c)
            for name, moments in want.items():
                for key, ref in moments.items():
                    assert torch.equal(got[key][(t, p)][c][name], ref), (case, t, p, c, name, key)
                assert torch.equal(got["param"][(t, p)][c][name], sd[name].float()), (case, name)


def test_a_file_of_another_model_is_refused_in_one_line(root):
    """The file's buffer sizes checked against this model's layout: a model one layer norm short (or a file of
    another run) is refused naming the file, the expected and the found sizes, before anything is written."""
    iter_dir = resolve_dir(os.path.join(root, "tp1_dp1"))
    args, shards = read_shards(iter_dir)
    sd = shards[(0, 0)][0]
    shards[(0, 0)][0] = {n: t for n, t in sd.items() if n != "decoder.final_layernorm.bias"}
    with pytest.raises(MegatronConversionError) as err:
        read_rank_moments(iter_dir, args, shards)
    msg = str(err.value)
    assert "\n" not in msg and "distrib_optim.pt" in msg and "this model's layout" in msg, msg
    state = torch.load(os.path.join(iter_dir, "mp_rank_00", "distrib_optim.pt"), weights_only=True)
    (world,) = state[0].values()
    assert f"holds {world['numel_unpadded']} elements" in msg, msg
