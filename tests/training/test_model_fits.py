"""A model that cannot fit is refused in one line before anything is allocated (``--hidden-size 1000000`` died in the
CPU allocator inside the model build with a raw traceback, "you tried to allocate 12000000000000 bytes"); a model
that fits is never refused.

The reference is hand-derived: a GPT-2 layer (LayerNorm, learned positions, tied output layer, biases) holds
``12 h^2 + 13 h`` parameters (QKV ``3h^2 + 3h``, projection ``h^2 + h``, MLP ``8h^2 + 5h`` at ffn ``4h``, two norms
``4h``), the model ``V_pad h + s h + L (12 h^2 + 13 h) + 2 h`` (``V_pad``: the vocabulary padded to a multiple of 128);
an fp32 run without the distributed optimizer holds 16 bytes a parameter (the weight, its fp32 gradient and Adam's two
fp32 moments; no master copy of an fp32 weight).
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest

from omnitron.cli import main
from omnitron.core.config.parallel import ConfigError
from omnitron.core.training.arguments import parse_settings
from omnitron.commands.fits import check_fits, state_peak
from omnitron.testing.distributed import run_distributed
from tests.plan.test_state import _args, held


def _argv(h: int, layers: int, vocab: int, seq: int = 16) -> list[str]:
    return ["--num-layers", str(layers), "--hidden-size", str(h), "--num-attention-heads", "4", "--seq-length",
            str(seq), "--max-position-embeddings", str(seq), "--micro-batch-size", "1", "--global-batch-size", "1",
            "--train-iters", "2", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab)]


def _hand_bytes(h: int, layers: int, vocab: int, seq: int) -> int:
    padded = -(-(vocab + 1) // 128) * 128  # Megatron's NullTokenizer adds the end-of-document id: vocab + 1 rows
    params = padded * h + seq * h + layers * (12 * h * h + 13 * h) + 2 * h
    return 16 * params


class _Device:
    """A backend as the check sees it: a name and the device's total memory (its capabilities)."""

    name = "test"

    def __init__(self, total: int | None) -> None:
        self.total = total

    def capabilities(self):
        return types.SimpleNamespace(memory_total=self.total)


def test_the_bound_is_the_state_bytes_and_only_a_larger_state_is_refused():
    """Fresh random sizes: the counted bytes equal the hand-derived ones, a device one byte short refuses the run in
    one line naming the flags to change, one of exactly that size (or that cannot say) accepts it."""
    rng = random.Random()
    for _ in range(3):
        h, layers, vocab, seq = 4 * rng.randint(2, 24), rng.randint(1, 3), rng.randint(2, 300), rng.choice([8, 16])
        settings = parse_settings(_argv(h, layers, vocab, seq), 1)
        want = _hand_bytes(h, layers, vocab, seq)
        assert state_peak(settings) == (want, 0), (h, layers, vocab, seq)
        check_fits(settings, _Device(want))
        check_fits(settings, _Device(None))
        with pytest.raises(ConfigError, match=r"^the model does not fit: .*--hidden-size") as err:
            check_fits(settings, _Device(want - 1))
        assert len(str(err.value).splitlines()) == 1


def test_an_absurd_hidden_size_stops_the_command_line_in_one_line(capsys):
    """``omnitron train --hidden-size 1000000`` (2 layers: 2.4e13 parameters, 384 TB of state) on the CPU backend:
    exit code 2 and one line, before the model is built (it raised the allocator's RuntimeError from the build)."""
    need = _hand_bytes(1_000_000, 2, 64, 16)
    assert need == 384_002_752_000_000
    assert main(["train", *_argv(1_000_000, 2, 64), "--no-tensorboard"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{need / 2**30:,.1f} GiB of parameters, gradients and optimizer state" in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


LAYOUTS = {  # name: (world, tp, pp, flags)
    "moe_ep2": (2, 1, 1, ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
                          "--global-batch-size", "2"]),
    "fsdp2_dp2": (2, 1, 1, ["--use-torch-fsdp2", "--global-batch-size", "2"]),
    "distopt_dp2_bf16": (2, 1, 1, ["--bf16", "--use-distributed-optimizer", "--ddp-bucket-size", "1000",
                                   "--global-batch-size", "2"]),
    "pp2_tied": (2, 1, 2, ["--global-batch-size", "2"]),
    "precision_aware": (1, 1, 1, ["--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer",
                                  "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]),
    "bf16": (1, 1, 1, ["--bf16"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_count_is_what_the_largest_rank_holds(name, tmp_path, monkeypatch):
    """Beyond dense fp32 at one rank: the count equals the parameter, gradient and optimizer bytes the built run's
    largest rank holds (measured on its live tensors; exact: integer byte counts), so a device of exactly that
    size or one byte larger trains and one byte smaller is refused."""
    monkeypatch.delenv("RANK", raising=False)
    world, tp, pp, extra = LAYOUTS[name]
    args = _args(str(tmp_path), tp, pp, extra)
    results = run_distributed(held, world, args, world)
    need, stage = state_peak(parse_settings(args, world))
    assert need == max(sum(real) for _, real, _ in results)
    assert stage in {rank for rank, real, _ in results if sum(real) == need}
    settings = parse_settings(args, world)
    check_fits(settings, _Device(need))
    check_fits(settings, _Device(need + 1))
    with pytest.raises(ConfigError, match=r"^the model does not fit"):
        check_fits(settings, _Device(need - 1))


def test_the_count_does_not_load_the_compiler_stack():
    """Every rank counts before it joins the job: the meta build skips ``normal_`` and makes ``arange`` on the host
    (torch's meta versions import dynamo and sympy, 1.5-3 s a rank: most of the 2.9 s a 70B tp8 pp8 count took,
    0.14 s now). A fresh process, since this one may hold those modules already."""
    rope = _argv(64, 2, 500) + ["--position-embedding-type", "rope"]  # its frequencies: an arange
    code = ("import sys; from omnitron.core.training.arguments import parse_settings; "
            "from omnitron.commands.fits import state_peak; "
            f"print(state_peak(parse_settings({rope!r}, 1))[0], "
            "[m for m in ('torch._dynamo', 'sympy') if m in sys.modules])")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                         check=True).stdout.split(None, 1)
    assert out == [str(_hand_bytes(64, 2, 500, 16) - 16 * 16 * 64), "[]\n"]  # no learned positions


def test_a_count_that_fails_is_a_warning_naming_the_error(monkeypatch, caplog):
    """A build the meta device cannot run leaves the run unchecked, and says why at warning level (an info line
    hid a bug in the count)."""
    import omnitron.commands.fits as fits

    def broken(settings):
        raise ValueError("no such shape")

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(fits, "stage_needs", broken)
    with caplog.at_level("WARNING", logger=fits.__name__):
        check_fits(parse_settings(_argv(32, 2, 64), 1), _Device(1))
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "ValueError: no such shape" in caplog.records[0].getMessage()
