"""Generation under tensor x pipeline parallelism gives the one-process tokens and log-probs.

A random Llama-style GPT (GQA, RoPE: later stages need the positions too) is written as a tp2 checkpoint,
so every layout below also reshards on load. Prompts of different lengths exercise the left padding and the
validity mask of every stage's KV cache. The reference is the same checkpoint in one process. MoE checkpoints
(three routing styles) at tp2, with token counts that tp does not divide.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim

V = 300  # NullTokenizer --vocab-size: the model's vocabulary is V + 1 (its end-of-document id)
PROMPTS = ["3 14 15 92 65", "35 89"]
# Log-probs: fp32, the layouts differ in the order of sums over n <= 96 terms (tp splits of the GEMMs and of
# the vocabulary-parallel logits, gathered exactly): relative error ~sqrt(n) 2**-24 ~ 6e-7 on logits of size
# <= ~50 (the weights are sharpened x4), <= 3e-5 absolute; log_softmax at most doubles it. Greedy tokens are
# compared exactly: a top-2 gap under 6e-5 on a random model is improbable, and a layout bug moves logits by O(1).
LP_ATOL = 1e-4


def _checkpoint(root: str, cfg=None, tp: int = 2) -> None:
    """A random, sharpened 4-layer model written as a ``tp`` checkpoint (``cfg``; default: a Llama-style GPT)."""
    from omnitron.core.checkpoint.hf import write_weights_checkpoint
    from omnitron.core.checkpoint.reshard import Layout
    from omnitron.core.models.gpt.presets import llama_tiny
    from omnitron.core.models.gpt.model import GPTModel
    from omnitron.core.models.gpt.state import gather_full_state
    from omnitron.core.parallel.groups import ParallelGroups

    cfg = cfg or llama_tiny(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                            num_query_groups=2, vocab_size=V + 1, seq_length=48)
    model = GPTModel(cfg, ParallelGroups.single(), seed=3)
    with torch.no_grad():  # sharpen the random model so greedy choices are well separated
        for p in model.parameters():
            if p.ndim > 1:
                p.mul_(4.0)
    full = {n: t.clone() for n, t in gather_full_state(model, model.groups).items()}
    write_weights_checkpoint(full, cfg, root, Layout(tp=tp), config={"tokenizer_type": "NullTokenizer",
                                                                     "vocab_size": V})


def _complete(loaded, sampling, prompts=PROMPTS):
    from omnitron.core.inference.sampling import SamplingParams
    from omnitron.core.inference.text import complete

    return complete(loaded, prompts, 10, params=SamplingParams(**sampling), logprobs=True)


def _one_process(root: str, sampling: dict, prompts=PROMPTS) -> dict:
    from omnitron.core.inference.loader import load_for_inference

    return _complete(load_for_inference(root), sampling, prompts)


def _rank(root: str, tp: int, pp: int, samplings: list[dict], prompt_sets=(PROMPTS,)) -> list[dict]:
    """Each prompt set's completion under each sampling, on this rank of the tp x pp layout."""
    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.inference.loader import load_sharded
    from omnitron.core.parallel.groups import ParallelGroups

    torch.set_num_threads(1)
    be = get_backend()
    groups = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
                                  backend=be)
    loaded = load_sharded(root, groups, be)
    assert loaded.model.decoder.layers.keys() == {str(i) for i in range(4)[groups.pp.rank * 4 // pp:][:4 // pp]}
    return [_complete(loaded, s, p) for p in prompt_sets for s in samplings]


SAMPLINGS = [{"temperature": 0.0}, {"temperature": 0.9, "top_k": 20, "seed": 7}]


def _assert_same(got: dict, want: dict, label) -> None:
    assert got["text"] == want["text"], (label, got["text"], want["text"])
    assert got["segments"] == want["segments"], label
    for a, b in zip(got["logprobs"], want["logprobs"], strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=LP_ATOL, msg=str(label))


@pytest.mark.parametrize("tp,pp,backend", [(2, 2, None), pytest.param(2, 1, None, marks=pytest.mark.slow),
                                           pytest.param(1, 2, None, marks=pytest.mark.slow),
                                           pytest.param(2, 2, "sim", marks=[pytest.mark.slow, requires_sim()])])
def test_sharded_generation_matches_one_process(tmp_path, tp, pp, backend):
    """Every rank's text, segments and log-probabilities equal one process's (``backend``: the ranks' backend;
    None: the session's; sim: 86 s on the loaded 2-core machine, 2026-12-03)."""
    root = str(tmp_path / "ck")
    _checkpoint(root)
    want = [_one_process(root, s) for s in SAMPLINGS]
    assert want[0]["text"] != want[1]["text"]  # the sampled run really samples
    for rank, got in enumerate(run_distributed(_rank, tp * pp, root, tp, pp, SAMPLINGS, backend=backend)):
        for g, w, s in zip(got, want, SAMPLINGS):
            _assert_same(g, w, (tp, pp, rank, s))


def _moe_config(kind: str):
    """A 4-layer MoE model of each routing style: a Llama-style GPT with --num-experts (softmax top-2), DeepSeek-V3's
    (MLA, sigmoid scores within groups, a shared expert, the first layer dense; its expert bias stays zero) and
    gpt-oss's (router bias, clamped SwiGLU experts with biases, attention sinks, a 4-token window every other
    layer)."""
    from omnitron.core.models.gpt.presets import deepseek_v3_tiny, gpt_oss_20b, llama_tiny

    if kind == "deepseek":
        return deepseek_v3_tiny(vocab_size=V + 1, seq_length=48)
    if kind == "gpt_oss":
        return gpt_oss_20b(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                           ffn_hidden_size=64, seq_length=48, max_position_embeddings=64, vocab_size=V + 1,
                           yarn_original_max_position_embeddings=16, num_experts=4, moe_router_topk=2,
                           moe_ffn_hidden_size=32, window_size="3,0")
    return llama_tiny(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                      vocab_size=V + 1, seq_length=48, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)


MOE_PROMPT_SETS = (["3 14 15 92 65", "35 89", "7"], ["3 14 15"])
"""Odd token counts at every step: prefills of 5 x 3 and 3 x 1 tokens, decoding steps of 3 and 1."""


@pytest.mark.parametrize("kind", ["gpt", pytest.param("deepseek", marks=pytest.mark.slow),
                                  pytest.param("gpt_oss", marks=pytest.mark.slow)])
def test_moe_generation_under_tensor_parallelism_matches_one_process(tmp_path, kind):
    """An MoE checkpoint at tp2 (sequence parallelism off: each tp rank routes every token, dispatches its padded
    slice; the experts split over tp) greedily generates the one-process tokens, log-probs within LP_ATOL (the
    same fp32 analysis; a router's top-k gap under the ~1e-5 layout noise on these sharpened weights is as
    improbable as a top-2 token gap)."""
    root = str(tmp_path / "ck")
    # NOTE: tp1, which the ranks reshard to tp2 as they load: a torch-format checkpoint with experts split over tp
    # is read back under its own layout only (reshard.read_full_state)
    _checkpoint(root, _moe_config(kind), tp=1)
    greedy = {"temperature": 0.0}
    want = [_one_process(root, greedy, p) for p in MOE_PROMPT_SETS]
    for rank, got in enumerate(run_distributed(_rank, 2, root, 2, 1, [greedy], MOE_PROMPT_SETS)):
        for g, w, p in zip(got, want, MOE_PROMPT_SETS, strict=True):
            _assert_same(g, w, (kind, rank, p))


@pytest.mark.slow  # NOTE: the sharded launcher path stays in the default suite through test_sharded_serve.py
def test_generate_command_under_tensor_parallelism(tmp_path):
    """``omnitron generate --tensor-model-parallel-size 2`` launches 2 ranks and prints the one-process text."""
    root = str(tmp_path / "ck")
    _checkpoint(root)
    root_dir = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root_dir, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "omnitron", "generate", "--load", root, "--max-new-tokens", "10", "--temperature",
           "0", "--json", "--tensor-model-parallel-size", "2", *[a for p in PROMPTS for a in ("--prompt", p)]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    sharded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sharded["text"] == _one_process(root, {"temperature": 0.0})["text"]


def test_sharded_generate_refuses_a_wrong_process_count(tmp_path, capsys):
    from omnitron.cli import main as cli

    with pytest.raises(SystemExit) as exit_:
        cli(["generate", "--load", str(tmp_path), "--prompt", "1", "--tensor-model-parallel-size", "2",
             "--nproc-per-node", "3"])
    assert exit_.value.code == 2
    assert ("sharded inference needs tensor x pipeline = 2 x 1 processes, got 3; set --nproc-per-node 2"
            in capsys.readouterr().err)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_layout_the_model_cannot_take_is_refused_before_ranks_start(tmp_path, capsys, monkeypatch, command):
    """tp 3 of 4 heads, pp 3 of the layers, a missing checkpoint: one line and exit 2 from the command line; the
    launcher (which would start the ranks, each then stopping with the same error) is never reached."""
    from omnitron.cli import main as cli
    from omnitron.core.training import launch as launch_mod

    root = str(tmp_path / "ck")
    _checkpoint(root)
    monkeypatch.setattr(launch_mod, "launch", lambda *a, **k: pytest.fail("ranks started"))
    extra = ["--prompt", "1"] if command == "generate" else []
    for flags, words in ((["--tensor-model-parallel-size", "3"], "is not divisible by --tensor-model-parallel-size 3"),
                         (["--pipeline-model-parallel-size", "3"],
                          "is not divisible by --pipeline-model-parallel-size"),
                         (["--tensor-model-parallel-size", "2", "--load", str(tmp_path / "none")], "no checkpoint")):
        with pytest.raises(SystemExit) as exit_:
            cli([command, "--load", root, *extra, *flags])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and words in err and len(err.strip().splitlines()) == 1, err


BATCH = [[5], [3, 14, 15], [9, 26, 53, 58, 97, 93], [23, 84, 62, 64, 33, 83, 27, 95, 2]]
"""Token ids of four prompts of 1 to 9 tokens: left padding of 8, 6, 3 and 0 slots."""


def _rows_and_cache(root: str, tp: int, pp: int, stops: list[int]) -> dict:
    """On this rank of tp x pp (one process for 1 x 1): BATCH greedily as one batch and each prompt alone, seeded
    top-p / temperature sampling likewise (prompt i alone seeded ``seed + i``), the batch with ``stops``,
    and the shapes and bytes of the KV cache a batch leaves."""
    from omnitron.core.inference.generation import generate_batch
    from omnitron.core.inference.kv_cache import KVCache
    from omnitron.core.inference.loader import load_for_inference
    from omnitron.core.inference.sampling import GREEDY, SamplingParams

    if tp * pp > 1:
        from omnitron.backends import get_backend
        from omnitron.core.config import ParallelConfig
        from omnitron.core.inference.loader import load_sharded
        from omnitron.core.parallel.groups import ParallelGroups

        torch.set_num_threads(1)
        be = get_backend()
        pc = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        loaded = load_sharded(root, ParallelGroups.build(pc, backend=be), be)
    else:
        loaded = load_for_inference(root)
    model, kw = loaded.model, (loaded.sharded.generate_kwargs if loaded.sharded is not None else dict)

    def gen(prompts, params, **extra):
        return generate_batch(model, prompts, 12, params=params, **kw(), **extra).tokens

    def sampling(seed):
        return SamplingParams(temperature=0.8, top_p=0.9, seed=seed)

    caches, enter = [], KVCache.__enter__
    KVCache.__enter__ = lambda self: caches.append(self) or enter(self)
    try:
        out = {"greedy": gen(BATCH, GREEDY), "stopped": gen(BATCH, GREEDY, eod=frozenset(stops)),
               "sampled": gen(BATCH, sampling(11))}
    finally:
        KVCache.__enter__ = enter
    out["alone"] = [gen([p], GREEDY)[0] for p in BATCH]
    out["sampled_alone"] = [gen([p], sampling(11 + i))[0] for i, p in enumerate(BATCH)]
    held = [t for t in caches[0].keys + caches[0].values if t is not None]
    out["cache"] = [tuple(t.shape) for t in held], sum(t.numel() * t.element_size() for t in held)
    return out


@pytest.mark.slow  # ~55 s: four ranks on the loaded 2-core machine (2026-12-06)
def test_each_row_of_a_sharded_batch_is_its_prompt_alone_and_the_cache_is_split(tmp_path):
    """tp2 x pp2, four prompts of different lengths: each row's greedy tokens equal that prompt generated alone, its
    top-k / top-p / temperature tokens those of the prompt alone seeded ``seed + i`` (sampling.py), and with two
    stop tokens a row ends at the first of them (the others run on unchanged); all equal one process's.

    KV cache: per rank its stage's 2 layers (of 4) and 1 key/value head (of 2) of 16 numbers, for 4 rows x 20 slots
    (the 9-token width + 12 generated - 1: the last token is not fed back), fp32, keys and values: 2 x 2 x 4 x 20 x
    16 x 4 = 20 KiB, a quarter of one process's 80 KiB."""
    root = str(tmp_path / "ck")
    _checkpoint(root)
    greedy = _rows_and_cache(root, 1, 1, [])["greedy"]
    stops = [greedy[1][3], greedy[2][4]]  # tokens two rows make mid-way
    one = _rows_and_cache(root, 1, 1, stops)
    for i, row in enumerate(greedy):
        cut = min([row.index(t) + 1 for t in stops if t in row], default=len(row))
        assert one["stopped"][i] == row[:cut], (i, one["stopped"][i], row, stops)
    assert sum(len(r) for r in one["stopped"]) < sum(len(r) for r in greedy)  # some row did stop early
    assert one["alone"] == one["greedy"] and one["sampled_alone"] == one["sampled"]
    assert one["cache"] == ([(4, 2, 20, 16)] * 8, 2 * 4 * 4 * 20 * 2 * 16 * 4)
    for rank, got in enumerate(run_distributed(_rows_and_cache, 4, root, 2, 2, stops)):
        assert got["alone"] == got["greedy"] == one["greedy"], rank
        assert got["sampled_alone"] == got["sampled"] == one["sampled"], rank
        assert got["stopped"] == one["stopped"], rank
        assert got["cache"] == ([(4, 1, 20, 16)] * 4, one["cache"][1] // 4), (rank, got["cache"])
