"""torch_dist checkpoints both ways against megatron-core itself, when it is installed (skipped otherwise).

omnitron's export is loaded by megatron-core's own ``dist_checkpointing.load`` into its ``GPTModel`` (local
spec, CPU), as Megatron's training loop loads a checkpoint, and that model's logits are compared with a
float64 GPT written from the maths over the exported tensors; a checkpoint megatron-core saves itself
(``dist_checkpointing.save``: its own keys, common.pt, metadata.json) is imported and the imported model's
logits compared with megatron-core's. megatron-core runs in a child process
(tests/checkpoint/megatron_core_side.py). Checked with megatron-core 0.16.1 on 2026-12-03.

Tolerance: fp32 against float64 (or fp32 against fp32 in another summation order) on a 3-layer width-32
model, ~ layers x sqrt(64) x 2**-24 = 1.4e-6 relative; 1e-5 bounds it (tests/models/test_gpt_reference.py).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from omnitron.cli import main as cli
from omnitron.core.checkpoint.hf import write_weights_checkpoint
from omnitron.core.checkpoint.io import read_metadata, read_shard
from omnitron.core.checkpoint.reshard import Layout, model_config
from tests.checkpoint.test_megatron_dist import V, _args, _cfg, _weights
from tests.models.test_gpt_reference import plain_gpt_loss

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                or importlib.util.find_spec("megatron.core") is None,
                                reason="megatron-core is not installed (pip install megatron-core to run this check)")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_megatron_core_loads_export_and_saves_importable(kind, tmp_path):
    from omnitron.core.models.gpt.model import GPTModel
    from omnitron.core.parallel.groups import ParallelGroups

    cfg, seed = _cfg(kind), int.from_bytes(os.urandom(4), "little")
    W = _weights(cfg, seed=seed)
    write_weights_checkpoint(W, cfg, str(tmp_path / "ck"), Layout(), config={"tokenizer_type": "NullTokenizer"})
    assert cli(["checkpoint", "export-megatron", "--load", str(tmp_path / "ck"), "--out", str(tmp_path / "omnitron"),
                "--target-tensor-model-parallel-size", "1", "--target-pipeline-model-parallel-size", "1"]) == 0
    tokens = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(seed))
    torch.save(tokens, tmp_path / "tokens.pt")
    torch.save(_args(cfg, tp=1), tmp_path / "args.pt")
    side = os.path.join(os.path.dirname(__file__), "megatron_core_side.py")
    r = subprocess.run([sys.executable, side, kind, str(tmp_path)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, SEED=str(seed + 1)))
    assert r.returncode == 0, r.stderr[-3000:]
    _, ref = plain_gpt_loss({n: t.double() for n, t in W.items()}, cfg, tokens, torch.zeros_like(tokens))
    assert _rel(torch.load(tmp_path / "loaded_logits.pt")[..., :V], ref) < 1e-5
    assert cli(["checkpoint", "import-megatron", "--load", str(tmp_path / "megatron"),
                "--save", str(tmp_path / "back")]) == 0
    path = str(tmp_path / "back" / "iter_0000000")
    model = GPTModel(model_config(read_metadata(path)["model"]), ParallelGroups.single()).eval()
    model.load_state_dict(read_shard(path, 0)["model"][0])
    with torch.no_grad():
        got = model(tokens).transpose(0, 1)[..., :V]
    assert _rel(got, torch.load(tmp_path / "saved_logits.pt")[..., :V]) < 1e-5
