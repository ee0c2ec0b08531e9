"""Generation computes the output layer at the last position only unless the prompt's log-probs are asked
(Megatron's ``materialize_only_last_token_logits``): the same tokens and log-probs as the full-logits path, for
GPT/Llama, T5 and LLaVA, in one process and under tensor x pipeline parallelism."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from omnitron.backends import get_backend
from omnitron.core.inference import SamplingParams, generate_batch
from omnitron.core.inference.families import caption, generate_t5
from omnitron.core.inference.sampling import GREEDY
from omnitron.core.models.gpt.presets import gpt2_tiny, llama_tiny
from omnitron.core.models.gpt.model import GPTModel
from omnitron.core.models.multimodal import LLaVAModel
from omnitron.core.models.multimodal.config import llava_tiny
from omnitron.core.models.t5 import T5Model
from omnitron.core.models.t5.config import t5_tiny
from omnitron.core.parallel.groups import ParallelGroups
from omnitron.testing.distributed import run_distributed

V = 300
CONFIGS = {
    "gpt2": lambda: gpt2_tiny(num_layers=2, hidden_size=64, vocab_size=V, seq_length=40, max_position_embeddings=40),
    "llama_gqa": lambda: llama_tiny(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                    vocab_size=V, seq_length=40),
}


def sharpen(m, scale=3.0):
    """Weights scaled up, so greedy choices are well separated."""
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim > 1:
                p.mul_(scale)
    return m.eval()


def head_rows(model):
    """A list the output layer appends its input's positions ``s`` to at every call, and the hook's handle."""
    rows = []
    return rows, model.output_layer.register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[0]))


def full_forward(model):
    """The full-logits path: every position's logits, ``last`` ignored (what generation computed before)."""
    return lambda ids, pos, last: model(tokens=ids, position_ids=pos)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@torch.no_grad()
def test_last_position_logits_are_the_full_logits_last_row(name):
    """float64: the last-position forward's logits are the full forward's last row (the same per-position ops; the
    output GEMM's blocking may differ with the row count: ~h x u ~ 64 x 1.1e-16 relative, 1e-12 bounds it)."""
    torch.manual_seed(11)
    model = sharpen(GPTModel(replace(CONFIGS[name](), params_dtype=torch.float64), ParallelGroups.single(),
                             backend=get_backend("cpu"), seed=5))
    ids = torch.randint(0, V, (3, 17))
    full = model(tokens=ids)
    last = model(tokens=ids, last_position_only=True)
    assert last.shape == (1, 3, full.shape[-1])
    torch.testing.assert_close(last, full[-1:], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("use_cache", [True, False])
@torch.no_grad()
def test_generation_without_prompt_log_probs_computes_one_position(name, use_cache):
    """Random prompts of uneven lengths, float64: greedy and seeded-sampled tokens and the generated tokens'
    log-probs equal the full-logits path's; the output layer ran on one position a step unless the prompt's
    log-probs were asked (then on the whole padded prompt at the prefill)."""
    torch.manual_seed(hash(name) % 1000)
    model = sharpen(GPTModel(replace(CONFIGS[name](), params_dtype=torch.float64), ParallelGroups.single(),
                             backend=get_backend("cpu"), seed=7))
    lengths = [9, 3, 14, 6]
    prompts = [torch.randint(0, V, (n,)).tolist() for n in lengths]
    for params in (GREEDY, SamplingParams(top_p=0.9, temperature=0.8, seed=3)):
        rows, hook = head_rows(model)
        try:
            got = generate_batch(model, prompts, 8, params=params, use_cache=use_cache)
            assert rows[0] == 1 and set(rows) == {1}, rows  # not max(lengths) = 14 at the prefill
            rows.clear()
            with_lp = generate_batch(model, prompts, 8, params=params, use_cache=use_cache, return_log_probs=True)
            assert rows[0] == max(lengths) and set(rows[1:]) == {1}, rows
        finally:
            hook.remove()
        want = generate_batch(model, prompts, 8, params=params, use_cache=use_cache, return_log_probs=True,
                              forward=full_forward(model))
        assert got.tokens == with_lp.tokens == want.tokens
        for a, b in zip(with_lp.log_probs, want.log_probs):  # prompt's then generated ones: 1e-12 as above
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-12)


@torch.no_grad()
def test_t5_and_llava_compute_the_last_position_only():
    """T5 without the cache recomputes the decoder's whole target every step; LLaVA's prefill holds the image and
    prompt positions: both now run the output layer on one position a step, with the tokens of the path that
    computes every position (the prompt's log-probs asked)."""
    torch.manual_seed(2)
    t5 = sharpen(T5Model(t5_tiny(num_layers=4, encoder_num_layers=2, decoder_num_layers=2, hidden_size=64,
                                 ffn_hidden_size=128, vocab_size=V, seq_length=24, decoder_seq_length=16,
                                 max_position_embeddings=24, num_query_groups=2),
                         ParallelGroups.single(), backend=get_backend("cpu"), seed=4))
    sources = [torch.randint(0, V, (n,)).tolist() for n in (5, 11, 2)]
    rows, hook = head_rows(t5)
    try:
        out = generate_t5(t5, sources, 6, start=2, use_cache=False)
    finally:
        hook.remove()
    assert set(rows) == {1} and len(rows) == 6, rows
    assert out.tokens == generate_t5(t5, sources, 6, start=2, use_cache=True, return_log_probs=True).tokens

    llava = sharpen(LLaVAModel(llava_tiny(hidden_size=32, ffn_hidden_size=64, vocab_size=V, img_h=16, img_w=16,
                                          patch_dim=8, vision_hidden_size=32, seq_length=24,
                                          max_position_embeddings=24),
                               ParallelGroups.single(), backend=get_backend("cpu"), seed=6))
    images, prompts = torch.rand(3, 3, 16, 16), [[7], [5, 9, 11], []]
    rows, hook = head_rows(llava)
    try:
        out = caption(llava, images, prompts, 5)
        assert set(rows) == {1}, rows
        rows.clear()
        full = caption(llava, images, prompts, 5, return_log_probs=True)
        assert rows[0] > 1, rows
    finally:
        hook.remove()
    assert out.tokens == full.tokens


def _sharded(tp: int, pp: int, prompts) -> tuple:
    """This rank's (tokens, log-probs) generated last-position-only, with prompt log-probs, and by the full path,
    and the positions the last stage's output layer ran on at the prefill of the first."""
    import torch

    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.inference.stage import ShardedStage, build_stage
    from omnitron.core.parallel.groups import ParallelGroups

    torch.set_num_threads(1)
    be = get_backend()
    groups = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
                                  backend=be)
    cfg = llama_tiny(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=V,
                     seq_length=40, params_dtype=torch.float64)
    model = sharpen(build_stage(cfg, groups, be))
    stage = ShardedStage(model, groups, be.collectives)
    rows = []
    if stage.is_last:
        model.output_layer.register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[0]))
    got = generate_batch(model, prompts, 6, **stage.generate_kwargs())
    with_lp = generate_batch(model, prompts, 6, return_log_probs=True, **stage.generate_kwargs())
    full = dict(stage.generate_kwargs(), forward=lambda ids, pos, last: stage.forward(ids, pos))
    want = generate_batch(model, prompts, 6, return_log_probs=True, **full)
    return got.tokens, with_lp.tokens, want.tokens, with_lp.log_probs, want.log_probs, rows[:1]


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_sharded_generation_computes_and_gathers_the_last_position_only(tp, pp):
    """Under tp (the vocabulary-parallel logits gathered at one position) and pp (the last stage): the same
    tokens and log-probs (float64, 1e-12 as above) as the full path on every rank."""
    gen = torch.Generator().manual_seed(tp * 10 + pp)
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (7, 2, 12)]
    outs = run_distributed(_sharded, tp * pp, tp, pp, prompts, backend="cpu")
    for rank, (got, with_lp, want, lp, want_lp, rows) in enumerate(outs):
        assert got == with_lp == want, rank
        for a, b in zip(lp, want_lp):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-12)
        assert rows in ([], [1]), (rank, rows)
    assert [1] in [o[-1] for o in outs]


def _under_sp() -> str:
    """The error a sequence-parallel tp2 model gives for ``last_position_only`` (this rank's slice of the sequence
    is not the whole one)."""
    from omnitron.backends import get_backend
    from omnitron.core.config import ParallelConfig
    from omnitron.core.parallel.groups import ParallelGroups

    be = get_backend()
    groups = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True), backend=be)
    model = GPTModel(CONFIGS["llama_gqa"](), groups, backend=be, seed=1).eval()
    try:
        with torch.no_grad():
            model(tokens=torch.zeros(1, 8, dtype=torch.long), last_position_only=True)
    except ValueError as err:
        return str(err)
    return ""


@pytest.mark.multiprocess
def test_last_position_only_is_refused_under_sequence_parallelism():
    for err in run_distributed(_under_sp, 2, backend="cpu"):
        assert "sequence parallelism off" in err and "\n" not in err
