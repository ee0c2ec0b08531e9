"""``omnitron checkpoint convert`` with --target-expert-model-parallel-size: the target must be a layout a training
run can have (the experts' ranks divide both the experts and the tp x dp ranks of a pipeline stage). Until
2026-12-07 convert wrote ``ep4`` at ``tp1 dp1`` (the default --target-data-parallel-size) without a word, and every
reader of that checkpoint (``inspect``, ``export``, a further ``convert``) then refused it with a message naming the
training flags; the torch format refused it naming them too. Now the command refuses in one line naming the
--target- flag and its value before it reads anything, and a fitting target writes the experts whole, bit for bit
(the reference: the random weights the source checkpoint was written from).

One process, a 2-layer MoE model of 4 experts (every layer MoE, GQA) built by ``write_weights_checkpoint``.
"""
from __future__ import annotations

import os

import pytest
import torch

from omnitron.cli import main
from omnitron.core.checkpoint.hf import write_weights_checkpoint
from omnitron.core.checkpoint.reshard import Layout, read_full_state
from omnitron.core.models.gpt.presets import llama_tiny

MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)


def _cfg(**moe):
    return llama_tiny(num_layers=2, hidden_size=32, ffn_hidden_size=48, vocab_size=100, seq_length=16, **moe)


def _weights(cfg, seed: int) -> dict:
    """Fresh random tensors for every parameter of ``cfg``'s one-process model (its names and shapes)."""
    from omnitron.core.models.gpt.model import GPTModel
    from omnitron.core.models.gpt.state import gather_full_state
    from omnitron.core.parallel.groups import ParallelGroups

    shapes = gather_full_state(GPTModel(cfg, ParallelGroups.single(), seed=0), ParallelGroups.single())
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=g) for n, t in shapes.items()}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(checkpoint directory, its weights) of the MoE model, and of a dense one."""
    root, out = tmp_path_factory.mktemp("convert_ep"), {}
    for name, cfg in (("moe", _cfg(**MOE)), ("dense", _cfg())):
        W = _weights(cfg, int.from_bytes(os.urandom(4), "little"))
        out[name] = (write_weights_checkpoint(W, cfg, str(root / name), Layout()), W)
    return out


def _convert(src: str, dst, tp: int, *extra: str) -> int:
    return main(["checkpoint", "convert", "--load", src, "--save", str(dst), "--target-tensor-model-parallel-size",
                 str(tp), "--target-pipeline-model-parallel-size", "1", *extra])


REFUSED = {  # name: (model, tp, extra flags, what the one line says)
    "ep4_dp1": ("moe", 1, ["--target-expert-model-parallel-size", "4"], "give --target-data-parallel-size 4"),
    "tp2_ep4_dp1": ("moe", 2, ["--target-expert-model-parallel-size", "4"], "give --target-data-parallel-size 2"),
    "tp2_ep4_dp3": ("moe", 2, ["--target-expert-model-parallel-size", "4", "--target-data-parallel-size", "3"],
                    "give --target-data-parallel-size 4"),
    "torch_ep2_dp1": ("moe", 1, ["--target-expert-model-parallel-size", "2", "--target-ckpt-format", "torch"],
                      "give --target-data-parallel-size 2"),
    "ep3": ("moe", 1, ["--target-expert-model-parallel-size", "3", "--target-data-parallel-size", "3"],
            "use a divisor of 4"),
    "dense_ep2": ("dense", 1, ["--target-expert-model-parallel-size", "2", "--target-data-parallel-size", "2"],
                  "use --target-expert-model-parallel-size 1"),
    # the model's own rules at the target: they named the training flag (--tensor-model-parallel-size 3), after
    # reading the whole checkpoint
    "heads_tp3": ("dense", 3, [], "--num-attention-heads 4 is not divisible by --target-tensor-model-parallel-size 3"),
    "moe_heads_tp8": ("moe", 8, [], "--num-attention-heads 4 is not divisible by --target-tensor-model-parallel-size "
                                    "8"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_target_no_run_can_have_is_refused_in_one_line(source, name, tmp_path, capsys):
    model, tp, extra, says = REFUSED[name]
    capsys.readouterr()
    assert _convert(source[model][0], tmp_path / "out", tp, *extra) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert not os.path.exists(tmp_path / "out"), "nothing is written"


@pytest.mark.parametrize("tp,ep,dp,fmt", [(1, 4, 4, "torch_dist"), (2, 4, 2, "torch"), (2, 2, 1, "torch_dist")])
def test_fitting_target_writes_the_experts_whole(source, tp, ep, dp, fmt, tmp_path, capsys):
    src, W = source["moe"]
    assert _convert(src, tmp_path / "out", tp, "--target-expert-model-parallel-size", str(ep),
                    "--target-data-parallel-size", str(dp), "--target-ckpt-format", fmt) == 0
    full = read_full_state(str(tmp_path / "out" / "iter_0000000"))
    assert Layout.from_dict(full.meta["layout"]) == Layout(tp=tp, dp=dp, ep=ep)
    assert sorted(full.model) == sorted(W) and any(".mlp.experts." in n for n in W)
    for n, t in W.items():
        assert torch.equal(full.model[n], t), n
    assert main(["checkpoint", "inspect", str(tmp_path / "out")]) == 0  # readable by the other commands


RUN_ONLY = {"offload": dict(cpu_offloading_num_layers=1),
            "recompute": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
            "offload_moe": dict(cpu_offloading_num_layers=1, moe_shared_expert_overlap=True, **MOE,
                                moe_shared_expert_intermediate_size=16)}


@pytest.mark.parametrize("name", sorted(RUN_ONLY))
def test_runtime_settings_do_not_refuse_a_target(name, tmp_path, capsys):
    """A checkpoint records how its run executed (activation offloading, recomputation, the shared expert's
    overlap); convert has no flags for them and a resume sets them again, so a layout the model splits over is
    written (``--cpu-offloading-num-layers 1`` was refused at pp2: rc 2), bit for bit, and a layout it does not
    split over is still refused naming the --target- flag."""
    cfg = _cfg(**RUN_ONLY[name])
    W = _weights(cfg, int.from_bytes(os.urandom(4), "little"))
    src = write_weights_checkpoint(W, cfg, str(tmp_path / "src"), Layout())
    assert main(["checkpoint", "convert", "--load", src, "--save", str(tmp_path / "out"),
                 "--target-tensor-model-parallel-size", "2", "--target-pipeline-model-parallel-size", "2"]) == 0, \
        capsys.readouterr().err
    full = read_full_state(str(tmp_path / "out" / "iter_0000000"))
    assert Layout.from_dict(full.meta["layout"]) == Layout(tp=2, pp=2)
    assert all(torch.equal(full.model[n], t) for n, t in W.items()) and sorted(full.model) == sorted(W)
    capsys.readouterr()
    assert _convert(src, tmp_path / "bad", 3) == 2  # 4 heads over tp 3
    err = capsys.readouterr().err.strip()
    assert "--target-tensor-model-parallel-size 3" in err and len(err.splitlines()) == 1, err
