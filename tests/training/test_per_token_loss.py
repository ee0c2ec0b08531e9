"""--calculate-per-token-loss: the loss and gradients of a step are the sum over all its loss tokens divided by
their count, whatever the micro-batching and layout.

The independent reference is one process reading the whole global batch as one micro-batch, without the flag:
its loss is then by definition the mean over every loss token of the batch. With --eod-mask-loss the
micro-batches hold different numbers of loss tokens, so the default loss (the mean of micro-batch means)
differs from it; the test checks that it does, so it would catch a flag that changes nothing.
"""
from __future__ import annotations

import pytest
import torch

from omnitron.testing.distributed import run_distributed

STEPS = 3
# The analysis of tests/training/test_loop_3d.py holds here (same model size, lr, clipping and step count):
# the layouts differ only in the order of fp32 sums, worth <= 3.6e-6 relative on the losses over 3 steps.
# The mean of micro-batch means is asserted to miss the reference at REL (below): the check can fail.
REL = 1e-5


def _argv(root: str, *extra: str) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
            "--seq-length", "16", "--max-position-embeddings", "16", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "100", "--num-workers", "0", "--global-batch-size", "8",
            "--eod-mask-loss", "--train-iters", str(STEPS), "--eval-interval", str(STEPS), "--eval-iters", "1",
            "--lr", "1e-2", "--clip-grad", "1.0", "--weight-decay", "0.01", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--log-interval", "1", "--no-tensorboard", "--data-cache-path",
            root + "/cache", "--seed", "1234", *extra]


def _train(root: str, world: int, *extra: str) -> tuple[list[float], list[float]]:
    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    torch.set_num_threads(1)
    res = train(parse_settings(_argv(root, *extra), world), get_backend())
    return [res["losses"][i] for i in sorted(res["losses"])], [v["val_loss"] for v in res["validation"]]


def _layouts(root: str) -> dict:
    per_token = ["--micro-batch-size", "2", "--calculate-per-token-loss"]
    return {"pp2dp2": _train(root + "/pp", 4, *per_token, "--pipeline-model-parallel-size", "2"),
            "cp2dp2": _train(root + "/cp", 4, *per_token, "--context-parallel-size", "2"),
            "pp2dp2_mean_of_means": _train(root + "/mm", 4, "--micro-batch-size", "2",
                                           "--pipeline-model-parallel-size", "2")}


def test_per_token_loss_equals_one_batch_token_mean(tmp_path):
    ref_losses, ref_val = _train(str(tmp_path / "ref"), 1, "--micro-batch-size", "8")
    # one process, four micro-batches of 2: the sums over micro-batches alone
    losses, val = _train(str(tmp_path / "one"), 1, "--micro-batch-size", "2", "--calculate-per-token-loss")
    assert losses == pytest.approx(ref_losses, rel=REL) and val == pytest.approx(ref_val, rel=REL)
    ranks = run_distributed(_layouts, 4, str(tmp_path / "dist"), timeout_s=600)
    for rank, res in enumerate(ranks):
        for name in ("pp2dp2", "cp2dp2"):
            losses, val = res[name]
            assert losses == pytest.approx(ref_losses, rel=REL), (rank, name, losses, ref_losses)
            assert val == pytest.approx(ref_val, rel=REL), (rank, name, val, ref_val)
        assert res["pp2dp2_mean_of_means"][0] != pytest.approx(ref_losses, rel=REL), "the token counts must differ"


def test_per_token_loss_with_moe_is_refused():
    from omnitron.core.config import ConfigError
    from omnitron.core.training.arguments import parse_settings

    with pytest.raises(ConfigError, match="^--calculate-per-token-loss with MoE: .*drop --calculate-per-token-loss"):
        parse_settings(_argv("/tmp", "--calculate-per-token-loss", "--num-experts", "4"), 1)


def test_per_token_loss_with_bert_is_refused():
    """BERT's loss is one mean per micro-batch (masked-LM plus sentence-order), with no token count to sum: the flag
    used to train exactly the default (the same losses bit for bit), so it is refused before any work."""
    from omnitron.core.config import ConfigError
    from omnitron.core.training.arguments import parse_settings

    with pytest.raises(ConfigError, match="^--calculate-per-token-loss with --model-type bert: .*drop "
                                          "--calculate-per-token-loss$"):
        parse_settings(["--model", "bert_tiny", "--train-iters", "1", "--calculate-per-token-loss"], 1)
