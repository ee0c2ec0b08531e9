"""``omnitron plan --inference-max-requests B --inference-max-seq-length S``: the KV cache a token costs per rank,
hand-derived from the published architectures (the sim allocator checks the terms in bytes:
tests/sim/test_sim_serve_memory.py), the largest batch that fits, and the command's output and refusals."""
from __future__ import annotations

import pytest

from omnitron.cli import main
from omnitron.core.models.gpt.presets import deepseek_v3, llama3_70b, llama3_8b
from omnitron.plan.inference import kv_bytes_per_token

TINY = ["--model", "gpt2_tiny", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200"]


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_kv_bytes_per_token_by_hand(tp):
    # Llama 3 70B: 80 layers, 8 KV heads of 128; K and V; bf16. Heads fewer than tp: one per rank (replicated)
    assert kv_bytes_per_token(llama3_70b(), tp, 80, 2) == 80 * 2 * max(8 // tp, 1) * 128 * 2
    # Llama 3 8B, fp32: 32 layers, 8 KV heads of 128
    assert kv_bytes_per_token(llama3_8b(), tp, 32, 4) == 32 * 2 * max(8 // tp, 1) * 128 * 4
    # DeepSeek-V3: the latent (512) and the rotated key part (64) per layer, whole on every tp rank (not 128 heads'
    # keys and values: 61 x 2 x 128 x 192 numbers, 85x more)
    assert kv_bytes_per_token(deepseek_v3(), tp, 61, 2) == 61 * (512 + 64) * 2


def _serve(argv):
    from omnitron.commands.plan import settings_of
    from omnitron.plan.inference import largest_batch, serve_estimate

    s = settings_of({"model": "gpt2_tiny", "mock_data": True, "tokenizer_type": "NullTokenizer", "vocab_size": 200,
                     **argv})
    return s, serve_estimate, largest_batch


def test_plan_prints_the_serving_estimate_and_the_largest_batch(capsys):
    s, serve_estimate, largest_batch = _serve({"layout": "tp2,pp2"})
    stages = serve_estimate(s, 3, 64)
    top = max(stages, key=lambda st: st.total)
    assert [st.layers for st in stages] == [2, 2] and stages[1].activations > 0
    # gpt2_tiny: 4 heads of 32, 2 layers a stage; K and V of 2 heads a tp rank, fp32
    assert top.kv_cache == 3 * 64 * top.kv_per_token == 3 * 64 * 2 * 2 * (4 // 2) * 32 * 4
    memory = top.total + 1
    b = largest_batch(s, 64, memory)
    assert b >= 3 and max(st.total for st in serve_estimate(s, b, 64)) <= memory
    assert max(st.total for st in serve_estimate(s, b + 1, 64)) > memory
    assert main(["plan", *TINY, "--layout", "tp2,pp2", "--inference-max-requests", "3", "--inference-max-seq-length",
                 "64", "--device-memory", f"{memory}B"]) == 0
    out = capsys.readouterr().out
    assert "tp2 pp2 | 3 requests x 64 tokens | fp32" in out and f"({top.total} bytes)" in out
    assert f"the most requests of 64 tokens that fit: {b}" in out


@pytest.mark.parametrize("argv,needle", [
    (["--inference-max-requests", "2", "--inference-max-seq-length", "100000"], "more than the model's"),
    (["--inference-max-requests", "0", "--inference-max-seq-length", "8"], "must be at least 1"),
    (["--inference-max-requests", "2", "--devices", "8", "--device", "h100-sxm"], "--devices prices training"),
])
def test_plan_serving_refusals(argv, needle, capsys):
    assert main(["plan", *TINY, *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err


def test_plan_serving_defaults(capsys):
    """One of the two flags given: the other is Megatron's default requests (8), or the model's --seq-length."""
    assert main(["plan", *TINY, "--inference-max-seq-length", "64"]) == 0
    assert "| 8 requests x 64 tokens |" in capsys.readouterr().out
    assert main(["plan", *TINY, "--inference-max-requests", "2"]) == 0
    assert "| 2 requests x 128 tokens |" in capsys.readouterr().out  # gpt2_tiny: --seq-length 128


def test_prefill_logits_at_the_last_position_by_hand():
    """Llama 3 70B, tp8, bf16, 8 requests x 4096 tokens (T = 32768): the output head's term by hand. The vocabulary
    128256 is padded to a multiple of 128 x 8 (129024, 16128 a rank), so each rank's logits are held twice (the
    copy with the padding columns at -inf). Every position's logits (--return-log-probs): gathered over tp, the
    all-gather's [8 T, V / 8] and the concatenation [T, V] of the shard [T, V / 8], 16.7 GiB; the last position
    only: the last layer's output [T, h] and the norm's and the logits' 8 rows."""
    from omnitron.plan.inference import _head, prefill_bytes

    cfg, t, b, h, v = llama3_70b(), 8 * 4096, 8, 8192, 129024
    every = _head(cfg, 8, t, t, 2)
    assert every == t * (v // 8 + 2 * v) * 2 and 16.7 < every / 2**30 < 16.8
    assert _head(cfg, 8, t, b, 2) == ((t + b) * h + b * 2 * (v // 8)) * 2
    full = prefill_bytes(cfg, 8, b, 4096, 2, last=True, moe=False, log_probs=True)
    last = prefill_bytes(cfg, 8, b, 4096, 2, last=True, moe=False)
    # the head is then no longer the largest phase: masked attention's fp32 scores are (11.3 GiB)
    assert full == every and last == prefill_bytes(cfg, 8, b, 4096, 2, last=False, moe=False) < full


def test_plan_return_log_probs(capsys):
    """``--return-log-probs`` prices the prompts' logits (more activations on the last stage); without the serving
    flags it is refused in one line."""
    assert main(["plan", *TINY, "--vocab-size", "4000", "--inference-max-requests", "4",
                 "--inference-max-seq-length", "64"]) == 0
    last = capsys.readouterr().out
    assert main(["plan", *TINY, "--vocab-size", "4000", "--inference-max-requests", "4",
                 "--inference-max-seq-length", "64", "--return-log-probs"]) == 0
    every = capsys.readouterr().out

    def total(out):
        return int(out.split(" GiB (")[1].split(" ")[0])  # "largest rank: ..., X GiB (N bytes)"

    assert total(every) > total(last)
    assert main(["plan", *TINY, "--return-log-probs"]) == 2
    err = capsys.readouterr().err
    assert "--return-log-probs prices serving" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("seq,skip,full", [(8, "2", 2), (64, "2", 2), (64, None, 0)])
def test_plan_prints_the_token_rate_within_and_past_the_windows(seq, skip, full, capsys):
    """An 8-slot window on gpt2_tiny's layers 0 and 2 (gpt-oss's pattern; layers 1 and 3 full) or on all 4
    (Mistral's), fp32, tp1: a token costs all 4 layers' keys and values (4 heads of 32) within the window and the
    ``full`` layers' past it (none: the cache stops growing); the line says both and the cache at B x S, by hand.
    A sequence within the window has one rate."""
    argv = ["--window-size", "7,0"] + (["--window-attn-skip-freq", skip] if skip else [])
    layer = 2 * 4 * 32 * 4  # K and V, 4 heads of 32, fp32: bytes a token and layer
    assert main(["plan", *TINY, *argv, "--inference-max-requests", "3", "--inference-max-seq-length", str(seq)]) == 0
    out = capsys.readouterr().out
    cache = 3 * (full * seq + (4 - full) * min(seq, 8)) * layer
    rate = f"KV cache on it: {4 * layer} bytes a token"
    if seq > 8:
        rate += (f" for a sequence's first 8 tokens, {full * layer} bytes a token past them (window layers keep their "
                 "last 8)")
    assert f"{rate}, {cache} bytes at 3 requests x {seq} tokens\n" in out, out
