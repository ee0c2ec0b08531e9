"""The README's main job for a few steps: tp 2 x pp 2 on 4 spawned processes, bundled corpus and its
4096-token BPE, validation, checkpoint, sample; then (slow) ``omnitron generate`` from that checkpoint.
(The full run is `omnitron train --config examples/moby_dick_tp2_pp2.yaml`.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from omnitron.core.checkpoint import integrity
from omnitron.testing.sim import requires_sim

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = "Call me Ishmael. Some years ago"


@pytest.fixture(scope="module", params=[None, pytest.param("sim", marks=[pytest.mark.slow, requires_sim()])])
def main_job(request, tmp_path_factory):
    """(save directory, the finished process) of the main job for 3 steps on the config's backend (cpu) or, with
    ``request.param``, on that one (sim: 100 s on the loaded 2-core machine, 2026-12-03)."""
    save = str(tmp_path_factory.mktemp("main_job") / "run")
    # --lr-warmup-iters 0: the 3 steps run at the full learning rate, enough to see the loss fall (with a warm-up of
    # 1, Megatron's schedule applies lr 0 to the first step); micro-batches
    # of 2 (still 4 per step through the pipeline) keep the run within the suite's budget
    cmd = [sys.executable, "-m", "omnitron", "train",
           "--config", os.path.join(ROOT, "examples", "moby_dick_tp2_pp2.yaml"),
           "--train-iters", "3", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
           "--log-interval", "1", "--eval-interval", "3", "--eval-iters", "1",
           "--lr-warmup-iters", "0", "--save", save, "--sample-tokens", "4", "--no-tensorboard",
           *(["--backend", request.param] if request.param else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    return save, proc


def _sample(out: str) -> str:
    return out[out.index("--- sample ("):].split("\n---", 1)[0]


def test_example_config_runs_end_to_end(main_job):
    save, proc = main_job
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = [json.loads(line) for line in open(os.path.join(save, "metrics.jsonl"))]
    assert [r["iteration"] for r in recs if "lm_loss" in r] == [1, 2, 3]
    losses = [r["lm_loss"] for r in recs if "lm_loss" in r]
    val, _ = [r["val_loss"] for r in recs if "val_loss" in r]  # at iteration 3, and once more after training
    # at initialisation the predictions are near-uniform: every batch's loss is ln(4096) = 8.32 to ~0.01,
    # so a fall of 0.1 (10x that spread) is learning, not a different batch
    assert losses[-1] < losses[0] - 0.1, f"the training loss must fall: {losses}"
    assert val < losses[0] - 0.1, f"validation loss {val:.4f} must be below the initial loss {losses[0]:.4f}"
    assert open(os.path.join(save, "latest")).read() == "iter_0000003"
    it = os.path.join(save, "iter_0000003")  # the default --ckpt-format torch_dist: DCP's files, then the ranks'
    meta = json.load(open(os.path.join(it, "metadata.json")))
    assert meta["ckpt_format"] == "torch_dist" and meta["dcp_files"]
    chunk_indexes = [f + integrity.CHUNK_INDEX for f in meta["dcp_files"]]  # each data file's per-chunk digests
    assert sorted(os.listdir(it)) == sorted([".metadata", "metadata.json", *meta["dcp_files"], *chunk_indexes,
                                             *(f"rank_{r:05d}.pt" for r in range(4))])
    assert "--- sample (" in proc.stdout and PROMPT in _sample(proc.stdout)


@pytest.mark.slow
def test_generate_reproduces_the_training_sample(main_job):
    """omnitron generate rebuilds the tp2 x pp2 layout from the checkpoint: the same sample (on the job's backend:
    the sample is drawn from that device's generator)."""
    save, proc = main_job
    assert proc.returncode == 0
    import re

    on = proc.args[proc.args.index("--backend"):][:2] if "--backend" in proc.args else []  # the job's device
    k, t = re.search(r"--- sample \(top-(\d+) sampling at temperature ([0-9.]+),", proc.stdout).groups()
    gen = subprocess.run([sys.executable, "-m", "omnitron", "generate", "--load", save, "--prompt", PROMPT,
                          "--max-new-tokens", "4", "--top-k", k, "--temperature", t, *on], capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    assert gen.returncode == 0, gen.stdout[-3000:] + gen.stderr[-3000:]
    generated = gen.stdout.split("--- 0 ---\n", 1)[1].split("\n---", 1)[0].rstrip("\n")
    trained = _sample(proc.stdout).split("---\n", 1)[1]  # the text under the sample's header line
    assert PROMPT in generated and generated == trained, (generated, trained)
