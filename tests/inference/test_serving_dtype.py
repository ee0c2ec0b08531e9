"""Serving in bf16 / fp16 (``omnitron generate / serve --bf16 / --fp16``, Megatron's flags): the fp32-trained checkpoint
loaded at the serving dtype, greedy tokens and logits against the fp32 model's within a bound derived below, on a
tiny trained model."""
from __future__ import annotations

import json

import pytest
import torch

from omnitron.cli import main
from omnitron.core.inference import generate_batch
from omnitron.core.inference.loader import load_for_inference
from omnitron.core.inference.sampling import GREEDY
from omnitron.testing.distributed import run_distributed

V = 64  # NullTokenizer --vocab-size: the model's vocabulary is V + 1 (its end-of-document id)
LAYERS = 2
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}  # 8 and 11 significand bits
# bf16 (fp16) vs fp32 logits, first order: the half type rounds each weight and each stored activation (relative
# error <= U); a pre-norm layer stores ~12 tensors on the path (norm, q/k/v, scores, probabilities, attention
# output, its projection, the residual sum, norm, the MLP's up-projection, its activation, down-projection and
# sum), plus the embedding, the final norm and the logits: N = 12 L + 3 roundings. Each norm rescales its input to unit
# RMS, so a relative perturbation reaches the logits with gain ~1: |dlogits| <= N U max|logits|. (Measured:
# 0.8 to 2.2 U max|logits| on this model, the roundings' errors partly cancelling.) fp16's narrower range
# changes nothing here: this model's activations and logits (|x| < 100) are far below its 65504, and values
# below its normal range (6e-5) carry an absolute error under 2**-25, negligible beside U max|logits|.
N_ROUNDINGS = 12 * LAYERS + 3


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Llama trained in fp32 to memorise 8 random sequences (loss ~1e-3, so greedy margins are wide where
    it continues them), written as a checkpoint; (root, the sequences)."""
    from omnitron.core.checkpoint.hf import write_weights_checkpoint
    from omnitron.core.checkpoint.reshard import Layout
    from omnitron.core.models.gpt.presets import llama_tiny
    from omnitron.core.models.gpt.model import GPTModel
    from omnitron.core.models.gpt.state import gather_full_state
    from omnitron.core.parallel.groups import ParallelGroups

    gen = torch.Generator().manual_seed(0)
    cfg = llama_tiny(num_layers=LAYERS, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                     num_query_groups=2, vocab_size=V + 1, seq_length=32)
    model = GPTModel(cfg, ParallelGroups.single(), seed=3)
    data = torch.randint(0, V, (8, 17), generator=gen)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(60):
        loss = model(tokens=data[:, :-1], labels=data[:, 1:]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    root = str(tmp_path_factory.mktemp("bf16") / "ck")
    full = {n: t.detach().clone() for n, t in gather_full_state(model, model.groups).items()}
    write_weights_checkpoint(full, cfg, root, Layout(tp=1), config={"tokenizer_type": "NullTokenizer",
                                                                     "vocab_size": V})
    return root, data


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_generation_against_fp32(trained, dtype):
    """Weights, logits and KV cache in ``dtype`` (half the bytes); greedy tokens equal fp32's except where fp32's
    top-2 margin at the first difference is within twice the bound (both logits may move by it); logits of the
    half-precision sequence and the log-probs within the bound (log-softmax moves by at most twice
    max|dlogits|)."""
    root, data = trained
    U = UNIT_ROUNDOFF[dtype]
    f32, b16 = load_for_inference(root).model, load_for_inference(root, dtype=dtype).model
    assert {p.dtype for p in b16.parameters()} == {dtype}
    assert 2 * sum(p.nbytes for p in b16.parameters()) == sum(p.nbytes for p in f32.parameters())
    prompts = [data[i, :n].tolist() for i, n in enumerate([5, 9, 3, 12, 7, 4, 10, 6])]
    want = generate_batch(f32, prompts, 12, params=GREEDY, return_log_probs=True)
    got = generate_batch(b16, prompts, 12, params=GREEDY, return_log_probs=True)
    for p, a, b, lp_a, lp_b in zip(prompts, want.tokens, got.tokens, want.log_probs, got.log_probs):
        seq = torch.tensor([p + b])
        l32, l16 = f32(tokens=seq)[:, 0, :V + 1], b16(tokens=seq)[:, 0, :V + 1].float()
        bound = N_ROUNDINGS * U * float(l32.abs().max())
        assert float((l32 - l16).abs().max()) <= bound
        same = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        if same < len(a):  # the first difference: fp32 hesitated there
            top2 = l32[len(p) - 1 + same].topk(2).values
            assert float(top2[0] - top2[1]) <= 2 * bound, (p, a, b)
        n = len(p) - 1 + same  # log-probs of the prompt and the common tokens
        torch.testing.assert_close(torch.tensor(lp_b[:n]), torch.tensor(lp_a[:n]), rtol=0, atol=2 * bound)
    assert sum(a == b for a, b in zip(want.tokens, got.tokens)) >= 6  # the memorised rows at least


def test_generate_and_serve_commands_take_the_dtype_flags(trained, capsys, monkeypatch):
    """``omnitron generate --bf16`` loads bf16 and prints the bf16 model's greedy text; ``--bf16 --fp16`` is
    refused; ``omnitron serve --fp16`` loads fp16, and fp32 without a flag."""
    import omnitron.core.inference.loader as L

    root, data = trained
    prompt = " ".join(map(str, data[0, :6].tolist()))
    dtypes, load = [], L.load_for_inference

    def spy(*args, **kwargs):
        loaded = load(*args, **kwargs)
        dtypes.append({p.dtype for p in loaded.model.parameters()})
        return loaded

    monkeypatch.setattr(L, "load_for_inference", spy)
    assert main(["generate", "--load", root, "--bf16", "--temperature", "0", "--max-new-tokens", "8", "--json",
                 "--prompt", prompt]) == 0
    text = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"][0]
    assert dtypes == [{torch.bfloat16}]
    from omnitron.core.inference.text import complete

    loaded = load_for_inference(root, dtype=torch.bfloat16)
    assert text == complete(loaded, [prompt], 8, params=GREEDY)["text"][0]
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--load", root, "--bf16", "--fp16", "--prompt", prompt])
    assert exit_.value.code == 2 and "not allowed with argument" in capsys.readouterr().err

    def no_server(*args, **kwargs):  # stop after the load: the test needs no socket
        raise OSError("no server in this test")

    monkeypatch.setattr("omnitron.core.inference.server.make_server", no_server)
    assert main(["serve", "--load", root, "--fp16"]) == 2 and dtypes[-1] == {torch.float16}
    assert main(["serve", "--load", root]) == 2 and dtypes[-1] == {torch.float32}


def _sharded_bf16(root: str, prompt: list[int], n: int) -> tuple:
    """This rank's parameter dtypes and greedy tokens of ``prompt`` under ``omnitron generate --bf16
    --tensor-model-parallel-size 2``'s job (its stage loaded by :class:`GenerateJob`)."""
    import torch

    from omnitron.backends import get_backend
    from omnitron.core.inference import generate_batch
    from omnitron.core.inference.sampling import GREEDY
    from omnitron.core.inference.sharded import GenerateJob

    torch.set_num_threads(1)
    job = GenerateJob(load=root, tensor_model_parallel_size=2, world_size=2, serving_dtype="bf16")
    _, loaded = job.load_stage(get_backend())
    out = generate_batch(loaded.model, [prompt], n, params=GREEDY, **loaded.sharded.generate_kwargs())
    return {str(p.dtype) for p in loaded.model.parameters()}, out.tokens[0]


@pytest.mark.multiprocess
def test_sharded_job_serves_bf16(trained):
    """A tp2 job with ``serving_dtype="bf16"`` (``--bf16``) loads bf16 stages, whose greedy continuation of a
    memorised prefix is the training sequence (its fp32 margins, ~8, are far above the bound: no token moves)."""
    root, data = trained
    for dtypes, tokens in run_distributed(_sharded_bf16, 2, root, data[1, :4].tolist(), 8, backend="cpu"):
        assert dtypes == {"torch.bfloat16"} and tokens == data[1, 4:12].tolist()
