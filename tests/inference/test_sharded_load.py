"""Sharded loading for inference: a tp2 rank builds its stage without weights and reads only its own slices.

A random Llama-style GPT (GQA: replicated-KV parts of the fused QKV; SwiGLU: a partition stride of 2; padded
vocabulary) is written whole -- one torch_dist chunk per tensor (``checkpoint convert`` to tp1) and one
safetensors file (``checkpoint export``) -- so a tp2 rank must cut every split tensor inside a saved chunk.
Reference: the same weights in a float64 one-process model. Byte counts are checked against the rank's own
shard sizes, computed from its parameters' shapes and the vocabulary's valid rows.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from omnitron.testing.distributed import run_distributed

V = 300
IDS = [[3, 14, 15, 92, 65, 35], [89, 7, 9, 3, 2, 38]]
MIN_PIECE = 64  # the smallest row-aligned piece in the test checkpoint: its rows are 64-384 bytes (fp32)
ARCHIVE = 2048
"""Bytes of a saved chunk around its tensor data (torch.save's zip headers, pickle and directory: ~1.2 KiB for one
tensor), read whole as the blocks before and after the tensor's pieces."""
# fp32 tp2 against float64: 4 layers of GEMMs over n <= 192 terms (fp32 sums: relative error ~ n 2**-24
# worst case ~1.1e-5 per GEMM, about 3 GEMMs per layer plus the head, so ~1.5e-4 relative), on logits of
# |x| <= max|ref| (the weights are sharpened x4); the bound below is that relative error times max|ref|.
REL = 1.5e-4


def _cfg():
    from omnitron.core.models.gpt.presets import llama_tiny

    return llama_tiny(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                      vocab_size=V + 1, seq_length=48)


def _write(root: str, monkeypatch) -> tuple[str, str, torch.Tensor]:
    """(torch_dist checkpoint dir, safetensors file, float64 reference logits [s, b, V+1])."""
    from omnitron.core.checkpoint import dist_slices
    from omnitron.core.checkpoint.hf import write_weights_checkpoint
    from omnitron.core.checkpoint.reshard import Layout, convert, export_safetensors
    from omnitron.core.models.gpt.model import GPTModel
    from omnitron.core.models.gpt.state import gather_full_state, shard_full_state
    from omnitron.core.parallel.groups import ParallelGroups

    cfg = _cfg()
    model = GPTModel(cfg, ParallelGroups.single(), seed=11)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.mul_(4.0)
    full = {n: t.clone() for n, t in gather_full_state(model, model.groups).items()}
    write_weights_checkpoint(full, cfg, root + "/torch", Layout(tp=1), config={"tokenizer_type": "NullTokenizer",
                                                                              "vocab_size": V})
    monkeypatch.setattr(dist_slices, "MIN_PIECE", MIN_PIECE)
    dist = convert(root + "/torch/iter_0000000", root + "/dist", Layout(tp=1), "torch_dist")
    export_safetensors(dist, root + "/m.safetensors")
    ref = GPTModel(dataclasses.replace(cfg, params_dtype=torch.float64), ParallelGroups.single(), seed=0).eval()
    shard_full_state(ref, {n: t.double() for n, t in full.items()}, ref.groups)
    ids = torch.tensor(IDS)
    with torch.no_grad():
        want = ref(tokens=ids, position_ids=torch.arange(ids.shape[1]).expand_as(ids))
    return root + "/dist", root + "/m.safetensors", want[..., :V + 1]


def _own_bytes(stage, tp_rank: int) -> int:
    """Bytes of this rank's shard of every weight, the vocabulary padding rows left out (no checkpoint holds
    them); the last stage's tied copy counts like any weight (it is read from the embedding's tensor)."""
    total = 0
    for p in stage.parameters():
        rows = p.shape[0]
        if getattr(p, "valid_rows", None) is not None:
            rows = max(0, min(rows, p.valid_rows - tp_rank * rows))
        total += rows * (p.numel() // p.shape[0]) * p.element_size()
    return total


def _rank(sources: list[str]) -> list[dict]:
    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.inference.loader import load_sharded
    from omnitron.core.parallel.groups import ParallelGroups

    torch.set_num_threads(1)
    be = get_backend()
    groups = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=2), backend=be)
    ids = torch.tensor(IDS, device=be.device())  # the tokens on the device the loaded stage lives on
    out = []
    for src in sources:
        loaded = load_sharded(src, groups, be)
        with torch.no_grad():
            logits = loaded.sharded.forward(ids, torch.arange(ids.shape[1], device=ids.device).expand_as(ids))
        out.append({"logits": logits[..., :V + 1].cpu(), "read": loaded.read_bytes,
                    "own": _own_bytes(loaded.model, groups.tp.rank),
                    "tensors": len(dict(loaded.model.named_parameters()))})
    return out


def _seen_tp2(rank: int):
    """One-process groups seen from tp rank ``rank`` of 2 (no process group: loading communicates nothing)."""
    from omnitron.core.checkpoint.reshard import Layout, _Seen
    from omnitron.core.parallel.groups import ParallelGroups

    groups = ParallelGroups.single()
    groups.config = Layout(tp=2).parallel_config()
    groups.groups.update(tp=_Seen("tp", (0, 1), None, me=rank))
    return groups


def test_each_tp_rank_reads_its_own_bytes_and_a_flipped_byte_is_caught(tmp_path, monkeypatch):
    """Both tp2 ranks' loads in this process: the bytes read against the computed shard sizes, and a byte
    flipped inside a block rank 1 reads (its half of the first layer's fc1) fails its load in one line."""
    from omnitron.backends import get_backend
    from omnitron.core.checkpoint import CheckpointError
    from omnitron.core.inference.loader import load_sharded

    dist, safe, _ = _write(str(tmp_path), monkeypatch)
    for rank in (0, 1):
        for src in (dist, safe):
            loaded = load_sharded(src, _seen_tp2(rank), get_backend("cpu"))
            own, n = _own_bytes(loaded.model, rank), len(list(loaded.model.parameters()))
            # torch_dist: every split cuts rows at piece boundaries (row halves and quarters of >= MIN_PIECE bytes), so
            # the rank reads its own bytes plus each tensor's archive bytes, whatever the split dimension
            assert own <= loaded.read_bytes <= own + (0 if src == safe else n * ARCHIVE), (rank, src)
    want = load_sharded(safe, _seen_tp2(1), get_backend("cpu")).model.decoder.layers["0"].mlp.linear_fc1.weight
    data = next(f for f in __import__("glob").glob(dist + "/iter_*/__0_*.distcp"))
    raw = bytearray(open(data, "rb").read())
    at = raw.find(want.detach()[0, :8].numpy().tobytes())  # rank 1's first up-projection row
    assert at > 0
    raw[at + 3] ^= 1
    open(data, "wb").write(bytes(raw))
    with pytest.raises(CheckpointError, match=r"is corrupt: bytes \d+\.\.\d+ do not match the chunk index's block"):
        load_sharded(dist, _seen_tp2(1), get_backend("cpu"))


@pytest.mark.slow  # two processes (~25 s); the in-process test above keeps the byte counts in the default suite
def test_tp2_reads_only_its_slices_and_matches_float64(tmp_path, monkeypatch):
    dist, safe, want = _write(str(tmp_path), monkeypatch)
    total = sum(p.numel() * p.element_size() for p in __import__("safetensors.torch", fromlist=["load_file"])
                .load_file(safe).values())
    tol = REL * want.abs().max().item()
    results = run_distributed(_rank, 2, [dist, safe])
    # the two ranks' slices partition the weights: only the replicated norm weights (< 2% here) are read twice
    assert sum(r[1]["own"] for r in results) < 1.02 * total
    for rank, (from_dist, from_safe) in enumerate(results):
        for got in (from_dist, from_safe):
            torch.testing.assert_close(got["logits"].double(), want, rtol=0, atol=tol, msg=f"rank {rank}")
        # safetensors: get_slice copies exactly the rank's boxes
        assert from_safe["read"] == from_safe["own"], rank
        # torch_dist: the row-aligned pieces holding the boxes, plus per tensor the archive's bytes
        assert from_dist["own"] <= from_dist["read"] <= from_dist["own"] + from_dist["tensors"] * ARCHIVE


def test_an_index_without_row_layouts_still_loads(tmp_path, monkeypatch):
    """A checkpoint whose chunk index has uniform blocks only (written before row-aligned pieces) loads the same
    weights, reading whole blocks around each run."""
    from omnitron.backends import get_backend
    from omnitron.core.checkpoint import dist as dist_format
    from omnitron.core.inference.loader import load_sharded

    new, _, _ = _write(str(tmp_path / "new"), monkeypatch)
    monkeypatch.setattr(dist_format, "_row_layouts", lambda *a: {})
    old, _, _ = _write(str(tmp_path / "old"), monkeypatch)
    a, b = (load_sharded(src, _seen_tp2(1), get_backend("cpu")) for src in (new, old))
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), name
    assert a.read_bytes < b.read_bytes, (a.read_bytes, b.read_bytes)


@pytest.mark.parametrize("cols,itemsize", [(2048, 4), (4096, 2), (8192, 1), (6144, 2)])
def test_a_tp_column_slice_starts_and_ends_on_piece_boundaries(cols, itemsize):
    """Hand-derived from piece_bytes' contract: when a row's 1/8 is at least MIN_PIECE bytes and whole elements,
    each tp rank's column slice at tp 2, 4 and 8 begins and ends on a piece boundary (so it reads no other
    rank's bytes); a block large enough never cuts further."""
    from omnitron.core.checkpoint.dist_slices import MIN_PIECE, piece_bytes

    row = cols * itemsize
    piece = piece_bytes((3, cols), itemsize, block=1 << 30)
    assert row // 8 >= MIN_PIECE and piece >= MIN_PIECE
    for tp in (2, 4, 8):
        assert (row // tp) % piece == 0, (tp, row, piece)
