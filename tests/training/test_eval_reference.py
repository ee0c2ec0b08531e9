"""Validation and test losses against a plain float64 reference over the samples Megatron's evaluation reads.

Megatron keeps one validation iterator for the run: evaluation k (every --eval-interval iterations, and once
more after training) reads the validation split's samples [k E B, (k + 1) E B) (E = --eval-iters, B the
evaluation batch), a resumed run starting after the evaluations before its iteration; the test split is read
once, from its start. The reference takes those samples straight from the split, runs an independent float64
GPT (tests/models/test_gpt_reference.py) on the initial weights (--lr 0: every evaluation sees them) and
averages as omnitron documents: with --calculate-per-token-loss the token mean over the evaluation's batches
(Megatron's reported validation loss), else the mean of the micro-batches' token means (docs/megatron-flags.md).
--eod-mask-loss makes the two differ, so a mix-up, a re-read batch or a shifted window shows.

Bound: the engine runs the 2-layer, hidden-32 model in fp32; each token's loss carries a relative error of a
few u sqrt(n) (u = 6e-8, n <= 100 terms per contraction: about 1e-6), and means of such values do not add
to it. REL = 1e-5 leaves 10x; the two averages differ here by about 1e-4 relative, and other samples by 1e-3.
"""
from __future__ import annotations

import os

import pytest
import torch

from omnitron.testing.distributed import run_distributed

REL = 1e-5
MBS, GBS, EVAL_ITERS, EVAL_INTERVAL, ITERS = 1, 4, 2, 2, 4


def _argv(root: str, *extra: str) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
            "100", "--num-workers", "0", "--micro-batch-size", str(MBS), "--global-batch-size", str(GBS),
            "--lr", "0", "--min-lr", "0", "--hidden-dropout", "0", "--attention-dropout", "0", "--eod-mask-loss",
            "--seed", "7", "--train-iters", str(ITERS), "--eval-interval", str(EVAL_INTERVAL), "--eval-iters",
            str(EVAL_ITERS), "--log-interval", "1", "--no-tensorboard", "--data-cache-path",
            os.path.join(root, "cache"), "--log-dir", os.path.join(root, "logs"), *extra]


def _reference(root: str) -> dict:
    """One process: (loss sum, loss tokens) of every sample the evaluations read, in float64."""
    from omnitron.backends import get_backend
    from omnitron.core.models.gpt import gather_full_state
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.components import build_components
    from tests.models.test_gpt_reference import plain_gpt_loss

    c = build_components(parse_settings(_argv(root), 1), get_backend())
    weights = {k: v.cpu().double() for k, v in gather_full_state(c.modules[0], c.groups).items()}

    def sums(dataset, start: int, n: int) -> list[tuple[float, float]]:
        out = []
        for i in range(start, start + n):
            b = {k: v.cpu() for k, v in dataset[i].items()}
            loss, _ = plain_gpt_loss(weights, c.model, b["tokens"][None], b["labels"][None])
            out.append((float((loss[0] * b["loss_mask"].double()).sum()), float(b["loss_mask"].sum())))
        return out

    per = EVAL_ITERS * GBS
    evaluations = ITERS // EVAL_INTERVAL + 1  # in the loop, and once more after training
    return {"validation": [sums(c.valid_data, k * per, per) for k in range(evaluations)],
            "test": sums(c.test_data, 0, per)}


def _token_mean(samples) -> float:
    return sum(s for s, _ in samples) / sum(n for _, n in samples)


def _mean_of_microbatch_means(samples) -> float:
    micro = [samples[i:i + MBS] for i in range(0, len(samples), MBS)]
    return sum(_token_mean(m) for m in micro) / len(micro)


def _layouts(root: str) -> dict:
    """Every rank: the evaluations' losses (validation..., test) of each two-rank run."""
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    torch.set_num_threads(1)

    def run(name: str, *extra: str) -> tuple[list[float], dict | None]:
        res = train(parse_settings(_argv(os.path.join(root, name), *extra), 2), get_backend())
        return [v["val_loss"] for v in res["validation"]], res["test"]

    out = {}
    for name, extra in (("dp2_per_token", ["--calculate-per-token-loss"]),
                        ("pp2", ["--pipeline-model-parallel-size", "2"]),
                        ("cp2_per_token", ["--context-parallel-size", "2", "--calculate-per-token-loss"])):
        val, test = run(name, *extra)
        out[name] = val + [test["test_loss"]]
    save = ["--calculate-per-token-loss", "--save", os.path.join(root, "ck")]
    first, _ = run("first", *save, "--exit-interval", "3")  # evaluates at 2, stops and saves at 3
    rest, test = run("rest", *save, "--load", os.path.join(root, "ck"))  # at 4, after training, the test split
    out["dp2_per_token_resumed"] = first + rest + [test["test_loss"]]
    return out


@pytest.mark.multiprocess
def test_evaluations_read_megatrons_samples_and_average_them(tmp_path):
    [ref] = run_distributed(_reference, 1, str(tmp_path / "ref"))
    splits = ref["validation"] + [ref["test"]]
    per_token = [_token_mean(s) for s in splits]
    micro_means = [_mean_of_microbatch_means(s) for s in splits]
    # the check can tell the averages and the evaluations apart
    assert any(abs(a - b) > 10 * REL * abs(a) for a, b in zip(per_token, micro_means))
    assert len({round(v, 6) for v in per_token}) == len(per_token)
    ranks = run_distributed(_layouts, 2, str(tmp_path / "runs"), timeout_s=600)
    for rank, res in enumerate(ranks):
        for name, got in res.items():
            want = per_token if name.endswith(("per_token", "resumed")) else micro_means
            assert got == pytest.approx(want, rel=REL), (rank, name, got, want)
