"""The first iteration's loss of one model on one batch in every layout (one process, dp 2, tp 2, pp 2), in fp32 and
in --bf16, through ``train`` as a run computes it (a fresh random seed: weights and mock data). Layout differences
in bf16 are rounding only, each within the bound derived here from what the layout changes:

* dp 2 and pp 2 run the same ops on the same shapes as one process (a micro-batch is a micro-batch; a pipeline
  stage boundary changes no op, and the activation it passes is not re-rounded), in bf16 as in fp32: only the order
  in which the M fp32 micro-batch losses are summed into the step's loss differs, at most M roundings of 2^-24
  relative each: ``SAME_OPS``. A loss averaged differently over micro-batches or replicas, or a cast in another
  place in one layout, moves the loss by far more (the micro-batches' losses differ by ~1e-2; a bf16 rounding is
  2^-8).
* fp32 tp 2: the split contractions (K <= 4h = 256 terms, the vocabulary-parallel softmax sums) are summed in
  another order: ~sqrt(K) x 2^-24 = 1e-6 relative (random-walk rounding), ``FP32_TP``.
* bf16 tp 2: each row-parallel output (attention's projection and fc2, 2 per layer) is two bf16 partial products
  summed in bf16 where one process rounds the one product once: at most 2 extra roundings of 2^-8 relative per
  element, 2 L = 4 outputs, so 8 independent roundings. Through the residual stream and the final norm (unit rms)
  to the logits z_j = h . E_j, |E_j| = std x sqrt(H): each logit moves by std sqrt(H) 2^-8 sqrt(8 / 3) (uniform
  rounding errors have std 1/sqrt(3) of their bound; the norm's gain is 1 while the projections' outputs are no
  larger than the stream they join, as at initialisation), and a token's loss, log-sum-exp(z) - z_y, by the same
  (its gradient in z has norm <= sqrt(2)). Tokens of a sequence share attention, so only the B sequences are taken
  as independent: 6 sigma of the batch mean is 6 sqrt(2) std sqrt(H) 2^-8 sqrt(8 / 3) / sqrt(B), ``bf16_tp_bound``.
"""
from __future__ import annotations

import math
import os

import pytest

from omnitron.testing.distributed import run_distributed

LAYERS, HIDDEN, STD, MBS, GBS = 2, 64, 0.02, 4, 16
SAME_OPS = (GBS // MBS) * 2.0 ** -24  # relative; see the module docstring
FP32_TP = 1e-6  # relative; see the module docstring
LAYOUTS = {"dp2": [], "tp2": ["--tensor-model-parallel-size", "2"], "pp2": ["--pipeline-model-parallel-size", "2"]}


def bf16_tp_bound() -> float:
    """Absolute: 6 sigma of the batch-mean loss moved by tp 2's extra bf16 roundings (module docstring)."""
    per_logit = STD * math.sqrt(HIDDEN) * 2.0 ** -8 * math.sqrt(2 * 2 * LAYERS / 3)
    return 6 * math.sqrt(2) * per_logit / math.sqrt(GBS)


def _argv(root: str, seed: int, flags: list[str]) -> list[str]:
    return ["--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN), "--num-attention-heads", "4",
            "--seq-length", "32", "--micro-batch-size", str(MBS), "--global-batch-size", str(GBS),
            "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
            "--init-method-std", str(STD), "--hidden-dropout", "0", "--attention-dropout", "0",  # dropout masks
            "--log-interval", "1", "--num-workers", "0", "--seed", str(seed), "--no-tensorboard",  # follow the layout
            "--eval-iters", "0", "--log-dir", os.path.join(root, "-".join(["log", *flags])),
            "--data-cache-path", os.path.join(root, "cache"), *flags]


def _first_losses(root: str, seed: int, world: int) -> dict:
    """{(precision, layout): the iteration-1 loss} of this world's layouts (one process: ``one``)."""
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    layouts = {"one": []} if world == 1 else LAYOUTS
    return {(prec, name): train(parse_settings(_argv(root, seed, flags + (["--bf16"] if prec == "bf16" else [])),
                                               world), get_backend())["losses"][1]
            for prec in ("fp32", "bf16") for name, flags in layouts.items()}


def test_bf16_layouts_agree_within_the_rounding_bound(tmp_path):
    """dp 2 and pp 2 equal one process to the micro-batch loss sum's rounding in fp32 and bf16 alike, tp 2 to 1e-6 in
    fp32 and within the bf16 bound (all derived in the module docstring)."""
    import torch

    seed = int.from_bytes(os.urandom(2), "little") + 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: a GEMM may split its work (and sums) by the thread count
    try:
        one = _first_losses(str(tmp_path), seed, 1)
    finally:
        torch.set_num_threads(threads)
    ranks = run_distributed(_first_losses, 2, str(tmp_path), seed, 2)
    assert ranks[0] == ranks[1]  # every rank logs the step's loss
    got = {**one, **ranks[0]}
    for prec in ("fp32", "bf16"):
        ref = got[(prec, "one")]
        for name in ("dp2", "pp2"):
            assert got[(prec, name)] == pytest.approx(ref, rel=SAME_OPS, abs=0), (prec, name, seed)
    assert got[("fp32", "tp2")] == pytest.approx(got[("fp32", "one")], rel=FP32_TP, abs=0), seed
    assert got[("bf16", "tp2")] == pytest.approx(got[("bf16", "one")], abs=bf16_tp_bound(), rel=0), seed
