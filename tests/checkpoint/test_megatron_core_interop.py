"""torch_dist checkpoints both ways against megatron-core itself, when it is installed (skipped otherwise).

omnitron's export is loaded by megatron-core's own ``dist_checkpointing.load`` into its ``GPTModel`` (local
spec, CPU), as Megatron's training loop loads a checkpoint, and that model's logits are compared with a
float64 GPT written from the maths over the exported tensors; a checkpoint megatron-core saves itself
(``dist_checkpointing.save``: its own keys, common.pt, metadata.json) is imported and the imported model's
logits compared with megatron-core's. megatron-core runs in a child process
(tests/checkpoint/megatron_core_side.py), at tp1 and (the dense models) tp2. Checked with megatron-core 0.16.1 on
2026-12-03, and 0.20.0 (tp1 and tp2) on 2026-12-07.

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
import torch.nn.functional as F

from omnitron.cli import main as cli
from omnitron.core.checkpoint.hf import write_weights_checkpoint
from omnitron.core.checkpoint.io import read_metadata, read_shard
from omnitron.core.checkpoint.reshard import Layout, convert, model_config
from tests.checkpoint.test_megatron_dist import V, _args, _cfg, _weights
from tests.models.test_gpt_reference import plain_gpt_loss

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                                or importlib.util.find_spec("megatron.core") is None
                                or importlib.util.find_spec("psutil") is None,  # its saver's forked writers need it
                                reason="megatron-core (with psutil) is not installed: pip install megatron-core psutil "
                                "to run this check")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("kind,tp", [("gpt2", 1), ("llama", 1), ("gpt2", 2), ("llama", 2)])
def test_megatron_core_loads_export_and_saves_importable(kind, tp, tmp_path):
    """megatron-core at tensor-parallel size ``tp`` (tp2: another layout than the export's tp1, whose vocabulary is
    padded for tp1; its own save is tp-sharded, imported and read by one omnitron process)."""
    from omnitron.core.models.gpt.model import GPTModel
    from omnitron.core.parallel.groups import ParallelGroups

    cfg, seed = _cfg(kind), int.from_bytes(os.urandom(4), "little")
    W = _weights(cfg, seed=seed)
    write_weights_checkpoint(W, cfg, str(tmp_path / "ck"), Layout(), config={"tokenizer_type": "NullTokenizer"})
    assert cli(["checkpoint", "export-megatron", "--load", str(tmp_path / "ck"), "--out", str(tmp_path / "omnitron"),
                "--target-tensor-model-parallel-size", "1", "--target-pipeline-model-parallel-size", "1"]) == 0
    tokens = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(seed))
    torch.save(tokens, tmp_path / "tokens.pt")
    torch.save(_args(cfg, tp=tp), tmp_path / "args.pt")
    side = os.path.join(os.path.dirname(__file__), "megatron_core_side.py")
    r = subprocess.run([sys.executable, side, kind, str(tmp_path), str(tp)], capture_output=True, text=True,
                       timeout=300,
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


# ---- MoE, MLA, MTP (tests/checkpoint/megatron_core_moe_side.py) ----------------------------------------------
def _moe_cfg(kind: str):
    """``deepseek``: MLA (q / kv ranks, QK norms), the first layer dense, two MoE layers of 4 sigmoid-routed experts
    (top-2 within 1 of 2 groups, x 2.5, expert bias) plus a shared expert, one MTP depth: per-layer keys.
    ``moe``: GQA, every layer MoE (stacked keys), softmax routing, a shared expert."""
    from omnitron.core.models.gpt.presets import deepseek_v3_tiny

    base = dict(num_layers=3, hidden_size=32, vocab_size=V, seq_length=16, hidden_dropout=0.0, attention_dropout=0.0,
                ffn_hidden_size=48, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
                moe_shared_expert_intermediate_size=16)
    if kind == "deepseek":  # YaRN x40 over 32 positions (the preset's), its concentration factor m(0.9) / m(1)
        return deepseek_v3_tiny(**base, moe_router_num_groups=2, moe_router_group_topk=1, moe_layer_freq="[0,1,1]",
                                mtp_num_layers=1, mscale=0.9, mscale_all_dim=1.0)
    return deepseek_v3_tiny(**base, moe_layer_freq=1, multi_latent_attention=False, num_query_groups=2,
                            rotary_scaling_factor=1.0,
                            qk_layernorm=False, moe_router_score_function="softmax",
                            moe_router_enable_expert_bias=False, moe_router_num_groups=None,
                            moe_router_group_topk=None, moe_router_topk_scaling_factor=None)


def _float64_model(cfg, full: dict):
    """omnitron's one-process model of ``cfg`` in float64 holding ``full`` (routers' expert biases included)."""
    import dataclasses

    from omnitron.core.models.gpt.model import GPTModel
    from omnitron.core.models.gpt.state import full_state_shards
    from omnitron.core.parallel.groups import ParallelGroups

    model = GPTModel(dataclasses.replace(cfg, params_dtype=torch.float64), ParallelGroups.single()).double()
    sd = full_state_shards(model, {n: t.double() for n, t in full.items()}, 1, 0)
    sd.update({n: full[n].float() for n, _ in model.named_buffers() if n.endswith("expert_bias") and n in full})
    missing = model.load_state_dict(sd, strict=False).missing_keys
    assert all(n.endswith(("inv_freq", "tokens_per_expert", "expert_bias")) for n in missing), missing
    return model


def _mtp_ce(model, tokens: torch.Tensor) -> float:
    """omnitron's depth-1 MTP loss (mean cross-entropy of the token two ahead; last position masked)."""
    model.mtp.loss_total = None
    with torch.enable_grad():
        model(tokens, labels=tokens)
    return float(model.mtp.loss_total / model.mtp.scaling)


def _megatron_mtp_ce(mtp_logits: torch.Tensor, tokens: torch.Tensor) -> float:
    """The same from megatron-core's MTP logits ``[s, b, V]`` (its roll_tensor: labels and mask shifted by one)."""
    labels = torch.roll(tokens, -1, 1)
    mask = torch.ones_like(tokens, dtype=torch.float64)
    mask[:, -1] = 0
    ce = F.cross_entropy(mtp_logits.transpose(0, 1).double().reshape(-1, mtp_logits.shape[-1]), labels.reshape(-1),
                         reduction="none").view_as(mask)
    return float((ce * mask).sum() / mask.sum())


def _core_name(state: dict, name: str) -> str:
    """megatron-core's module name of ``name`` in its ``state``: after 0.16 the MTP depth's layer is
    ``mtp_model_layer`` (its torch_dist keys still say ``transformer_layer``)."""
    return name if name in state else name.replace(".transformer_layer.", ".mtp_model_layer.")


@pytest.mark.parametrize("kind,source_tp", [("deepseek", 1), ("moe", 2)])
def test_megatron_core_moe_mla_mtp_both_ways(kind, source_tp, tmp_path):
    """megatron-core's MoE (and MLA + MTP) GPTModel loads omnitron's torch_dist export (of a checkpoint saved at
    ``source_tp``), its weights land bit for bit, its logits (and MTP loss) equal omnitron's float64 model's;
    its own save imports, with its expert bias, and the imported model gives its logits."""
    from omnitron.core.checkpoint.megatron_base import load_file
    from omnitron.core.checkpoint.megatron_names import is_moe, layer_of, torch_rest

    cfg, seed = _moe_cfg(kind), int.from_bytes(os.urandom(4), "little")
    W = _weights(cfg, seed=seed)
    ck = write_weights_checkpoint(W, cfg, str(tmp_path / "ck1"), Layout(), config={"tokenizer_type": "NullTokenizer"})
    if source_tp > 1:  # as a tp run saves it (torch_dist, the default: experts split over tp)
        ck = convert(ck, str(tmp_path / "ck"), Layout(tp=source_tp), "torch_dist")
        assert Layout.from_dict(read_metadata(ck)["layout"]).tp == source_tp
    assert cli(["checkpoint", "export-megatron", "--load", ck, "--out", str(tmp_path / "omnitron"),
                "--target-tensor-model-parallel-size", "1", "--target-pipeline-model-parallel-size", "1"]) == 0
    torch.save(load_file(str(tmp_path / "omnitron" / "iter_0000000" / "common.pt"))["args"], tmp_path / "args.pt")
    tokens = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(seed))
    torch.save(tokens, tmp_path / "tokens.pt")
    side = os.path.join(os.path.dirname(__file__), "megatron_core_moe_side.py")
    r = subprocess.run([sys.executable, side, str(tmp_path)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, SEED=str(seed + 1)))
    assert r.returncode == 0, r.stderr[-3000:]
    loaded, saved = torch.load(tmp_path / "loaded.pt"), torch.load(tmp_path / "saved.pt")
    for name, t in W.items():  # every weight where megatron-core's module names put it
        layer = layer_of(name)
        mname = name if layer is None else layer[0] + torch_rest(layer[3], mla=cfg.multi_latent_attention,
                                                                 moe=is_moe(cfg, layer[1]), te=False)
        assert torch.equal(loaded["state"][_core_name(loaded["state"], mname)][:t.shape[0]], t), name
    ref = _float64_model(cfg, W)
    with torch.no_grad():
        want = ref(tokens).transpose(0, 1)[..., :V]
    assert _rel(loaded["logits"].transpose(0, 1)[..., :V], want) < 1e-5
    if cfg.mtp_num_layers:
        assert abs(_megatron_mtp_ce(loaded["mtp_logits"][0][..., :V], tokens) / _mtp_ce(ref, tokens) - 1) < 1e-5

    assert cli(["checkpoint", "import-megatron", "--load", str(tmp_path / "megatron"), "--save",
                str(tmp_path / "back")]) == 0
    path = str(tmp_path / "back" / "iter_0000000")
    back = model_config(read_metadata(path)["model"])
    got_model = GPTModel_from(path, back)
    with torch.no_grad():
        got = got_model(tokens).transpose(0, 1)[..., :V]
    assert _rel(got, saved["logits"].transpose(0, 1)[..., :V]) < 1e-5
    for name, b in got_model.named_buffers():
        if name.endswith("expert_bias"):
            layer = layer_of(name)
            assert torch.equal(b, saved["state"][_core_name(saved["state"], name)]) and b.abs().max() > 0, name


def GPTModel_from(path: str, cfg):
    """omnitron's one-process model loaded from checkpoint ``path`` (its rank-0 shard)."""
    from omnitron.core.models.gpt.model import GPTModel
    from omnitron.core.parallel.groups import ParallelGroups

    model = GPTModel(cfg, ParallelGroups.single()).eval()
    model.load_state_dict(read_shard(path, 0)["model"][0])
    return model
