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

from omnitron.core.checkpoint.megatron import rank_dir, read_shards, resolve_dir
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
    got = read_rank_moments(iter_dir, args, shards, rank_dir)
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
        read_rank_moments(iter_dir, args, shards, rank_dir)
    msg = str(err.value)
    assert "\n" not in msg and "distrib_optim.pt" in msg and "this model's layout" in msg, msg
    state = torch.load(os.path.join(iter_dir, "mp_rank_00", "distrib_optim.pt"), weights_only=True)
    (world,) = state[0].values()
    assert f"holds {world['numel_unpadded']} elements" in msg, msg


def _omnitron_name(name: str, chunk: int, stage: int, pp: int, per_chunk: int) -> str:
    """A tp-1 Megatron chunk's parameter name under omnitron's global layer numbers (chunk-major: chunk ``chunk``
    of stage ``stage`` holds layers (chunk x pp + stage) x per_chunk, ...)."""
    import re

    m = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
    if not m:
        return name
    return f"decoder.layers.{(chunk * pp + stage) * per_chunk + int(m.group(1))}.{m.group(2)}"


@pytest.mark.parametrize("case", ["tp1_dp1", "pp2_vp2_dp2"])
def test_import_resumes_megatrons_adam_moments(root, tmp_path, case, monkeypatch):
    """``import-megatron`` of a checkpoint with its distrib_optim.pt files, loaded by omnitron's training: the
    optimizer holds Megatron's moments (the padded vocabulary's real rows) and step count, and one training step
    from them equals a float64 Adam step of the same gradient (Megatron's Adam: m, v, bias corrections of step
    count + 1; --weight-decay 0, --clip-grad 0, a constant --lr).

    Tolerances (omnitron steps in fp32 with the reference kernels, the reference in float64 from the same fp32
    inputs; u = 2^-24): each moment is two products and a sum (and fp32's beta, 1 - beta each one rounding), <= 4 u
    relative to the terms' magnitudes, dm = 4u (b1 |m0| + (1 - b1) |g|) for m (which may cancel), 4u |v| for v (no
    cancellation: its terms are >= 0). The update lr m^ / (sqrt(v^) + eps) carries dm through lr / bc1 /
    (sqrt(v^) + eps), plus <= 8 roundings relative to itself (v's 4u halved by the root, the bias corrections, the
    quotient, the products); the new weight p - update one rounding of |p|. Bound on the weight: 2u |p| +
    lr dm / bc1 / (sqrt(v^) + eps) + 8u |update|."""
    import shlex

    from omnitron.backends import get_backend
    from omnitron.commands.hf import train_hint
    from omnitron.core.checkpoint.io import read_metadata
    from omnitron.core.checkpoint.megatron import import_megatron
    from omnitron.core.checkpoint.reshard import Layout
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.checkpointing import load
    from omnitron.core.training.components import build_components
    from omnitron.core.training.step import train_step

    out = import_megatron(os.path.join(root, case), str(tmp_path / "omni"), Layout())
    meta = read_metadata(out)
    hint, real = shlex.split(train_hint(str(tmp_path / "omni"), meta).split(": ", 1)[1]), meta["model"]["vocab_size"]
    lr, mbs, seq = 1e-3, 2, 4
    flags = [*hint, "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--mock-data",
             "--num-workers", "0", "--no-tensorboard", "--seed", "3", "--hidden-dropout", "0",
             "--attention-dropout", "0", "--train-iters", "4", "--micro-batch-size", str(mbs),
             "--global-batch-size", str(mbs), "--lr", str(lr), "--lr-decay-style", "constant", "--weight-decay", "0",
             "--clip-grad", "0", "--use-distributed-optimizer"]
    c = build_components(parse_settings(flags, 1), get_backend())
    assert load(c)
    state = c.optimizer.state_dict()
    assert int(state["step"]) == 7  # the fixture's Megatron run took 7 steps
    # Megatron's own held moments under omnitron's names, the vocabulary's real rows
    iter_dir = resolve_dir(os.path.join(root, case))
    args, shards = read_shards(iter_dir)
    pp = int(args.get("pipeline_model_parallel_size") or 1)
    per_chunk = int(args["num_layers"]) // pp // len(shards[(0, 0)])
    want = {}
    for p in range(pp):
        rank = os.path.join(iter_dir, "mp_rank_00" + (f"_{p:03d}" if pp > 1 else ""))
        for chunk, held in enumerate(torch.load(os.path.join(rank, "held.pt"), weights_only=True)):
            for name, moments in held.items():
                if name == "output_layer.weight" and not args.get("untie_embeddings_and_output_weights"):
                    continue  # the tied embedding's copy: the embedding's own state is kept
                want[_omnitron_name(name, chunk, p, pp, per_chunk)] = moments
    tensors = {k.split(".", 1)[1]: e for k, e in state["tensors"].items()}  # "chunk0.NAME": one chunk here
    assert set(tensors) == set(want), sorted(set(tensors) ^ set(want))
    for name, moments in want.items():
        for key, ref in moments.items():
            got, rows = tensors[name][key], min(real, ref.shape[0])
            if name == "embedding.word_embeddings.weight":  # the real vocabulary's rows; omnitron's padding zero
                assert not got[real:].any(), name
                got, ref = got[:rows], ref[:rows]
            assert torch.equal(got, ref), (name, key)
    # one step on fresh tokens; the gradient it used stays in main_grad
    before = {n: (e["master"] if "master" in e else None, e["exp_avg"], e["exp_avg_sq"]) for n, e in tensors.items()}
    params = dict(c.modules[0].named_parameters())
    weights = {n: params[n].detach().clone().double() for n in before}
    tokens = torch.randint(0, 25, (mbs, seq + 1), generator=torch.Generator().manual_seed(11))
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(mbs, seq),
             "position_ids": torch.arange(seq)[None].expand(mbs, seq)}
    assert not train_step(c, iter([batch]))["skipped"]
    after = {k.split(".", 1)[1]: e for k, e in c.optimizer.state_dict()["tensors"].items()}
    b1, b2, eps, t = 0.9, 0.999, 1e-8, 8
    for name, (_, m0, v0) in before.items():
        g = params[name].main_grad.detach().double()
        m_ref = b1 * m0.double() + (1 - b1) * g
        v_ref = b2 * v0.double() + (1 - b2) * g * g
        u = lr * (m_ref / (1 - b1 ** t)) / ((v_ref / (1 - b2 ** t)).sqrt() + eps)
        p_ref = weights[name] - u
        ulp = 2.0 ** -24
        assert ((after[name]["exp_avg"].double() - m_ref).abs() <=
                4 * ulp * (b1 * m0.double().abs() + (1 - b1) * g.abs())).all(), name
        assert ((after[name]["exp_avg_sq"].double() - v_ref).abs() <= 4 * ulp * v_ref).all(), name
        dm = 4 * ulp * (b1 * m0.double().abs() + (1 - b1) * g.abs())
        bound = 2 * ulp * p_ref.abs() + lr * dm / (1 - b1 ** t) / ((v_ref / (1 - b2 ** t)).sqrt() + eps) + \
            8 * ulp * u.abs()
        got = params[name].detach().double()
        assert ((got - p_ref).abs() <= bound).all(), (name, (got - p_ref).abs().max().item())
        assert g.abs().sum() > 0, name  # a real gradient reached it
