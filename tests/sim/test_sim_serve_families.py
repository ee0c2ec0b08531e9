"""The serving estimate of T5 and LLaVA (``omnitron plan --model-type t5 / multimodal --inference-max-*``) against
the sim allocator while :mod:`omnitron.core.inference.families` generates: weights and caches to the byte, the
working set within the bound the GPT cases use (tests/sim/test_sim_serve_memory.py)."""
from __future__ import annotations

import pytest

from omnitron.testing.distributed import run_distributed
from omnitron.testing.sim import requires_sim

pytestmark = [requires_sim(), pytest.mark.multiprocess]
H = 64
T5 = ("--model-type", "t5", "--tokenizer-type", "BertWordPieceLowerCase", "--num-query-groups", "2")
LLAVA = ("--model-type", "multimodal", "--tokenizer-type", "NullTokenizer")


def _argv(seq: int, extra) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", str(H), "--num-attention-heads", "4", "--seq-length", str(seq),
            "--max-position-embeddings", str(seq), "--vocab-size", "200", "--micro-batch-size", "1",
            "--global-batch-size", "1", "--mock-data", *extra]


def measured(extra, b: int, prompt: int, new: int, seq: int) -> tuple:
    """(estimate, parameter bytes, self-attention cache bytes, cross-attention cache bytes, bytes held when decoding
    ends beyond the weights, peak beyond the weights) generating ``b`` rows: T5 sources of up to ``prompt`` tokens
    and ``new`` tokens (``S = new + 1``); LLaVA text prompts of up to ``prompt`` tokens after the image's."""
    import torch

    import omnitron.core.inference.kv_cache as K
    from omnitron.backends import get_backend
    from omnitron.core.inference.families import caption, generate_t5
    from omnitron.core.models.family import family_of
    from omnitron.core.models.multimodal.config import num_image_tokens
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.parallel.tensor.sharding import to_device
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.inference import serve_estimate
    from omnitron.plan.memory import model_config

    be, t5 = get_backend(), "t5" in extra
    s = parse_settings(_argv(seq, extra), 1)
    cfg = model_config(s)
    model = to_device(family_of(cfg).build_stage(cfg, ParallelGroups.single(), backend=be, seed=1).eval(),
                      be.current_device())
    est = serve_estimate(s, b, new + 1 if t5 else num_image_tokens(cfg) + prompt + new, prompt=prompt if t5 else
                         num_image_tokens(cfg) + prompt)[0]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    held, cross, own, leave, cross_leave = [], [], [], K.KVCache.__exit__, K.CrossKVCache.__exit__

    def spy_exit(self, *exc):
        own.append(sum(t.untyped_storage().nbytes() for t in self.keys + self.values))
        held.append(be.memory_stats()["allocated"] - base)
        return leave(self, *exc)

    def spy_cross(self, *exc):  # each layer's memoized linear_kv(memory): the cached forward's default argument
        cross.append(sum(lin.forward.__defaults__[1]["kv"].untyped_storage().nbytes() for lin in self.linears))
        return cross_leave(self, *exc)

    K.KVCache.__exit__, K.CrossKVCache.__exit__ = spy_exit, spy_cross
    try:
        gen = torch.Generator().manual_seed(b * 100 + prompt)
        texts = [torch.randint(3, 200, (prompt - 3 * i,), generator=gen).tolist() for i in range(b)]
        base = be.memory_stats()["allocated"]
        be.reset_peak_memory_stats()
        if t5:
            generate_t5(model, texts, new, start=2)
        else:
            images = torch.randn(b, cfg.num_channels, cfg.img_h, cfg.img_w, generator=gen)
            base = be.memory_stats()["allocated"]
            caption(model, images, texts, new)
        peak = be.memory_stats()["peak_allocated"] - base
    finally:
        K.KVCache.__exit__, K.CrossKVCache.__exit__ = leave, cross_leave
    return est, weights, own[0], (cross or [0])[0], held[0], peak


@pytest.mark.parametrize("extra,b,prompt,new,seq", [(T5, 2, 24, 7, 32), (T5, 3, 16, 12, 16), (LLAVA, 2, 8, 8, 40),
                                                    (LLAVA, 3, 12, 4, 40)], ids=["t5", "t5-b3", "llava", "llava-b3"])
def test_serve_estimate_of_t5_and_llava_is_the_sim_allocators(extra, b, prompt, new, seq):
    """Weights exact (LLaVA's vision tower and projector included). Caches exact, by hand: a position costs each
    layer keys and values of 2 groups x 16 fp32 numbers (T5) or 4 heads x 16 (LLaVA); T5 holds ``S = new + 1``
    decoder slots, the cross-attention's ``prompt`` encoder positions and the encoder output ``[prompt, b, H]``;
    LLaVA ``16 image + prompt + new`` slots. When decoding ends only the last step's tensors (its ``[1, b, 256]``
    logits and their copies, a few) and allocator rounding (512 bytes a block, < 128 blocks) are held beside
    them. The peak: the GPT cases' bound (test_sim_serve_memory.py) over the prefill's (or encoder's) tokens."""
    est, weights, own, cross, held, peak = run_distributed(measured, 1, extra, b, prompt, new, seq, backend="sim")[0]
    t5 = extra is T5
    per = 2 * (2 if t5 else 4) * (H // 4) * 4 * 2  # keys and values of one position over the 2 layers
    slots = new + 1 if t5 else 16 + prompt + new
    assert est.weights == weights
    assert own == b * slots * per and cross == (b * prompt * per if t5 else 0)
    assert est.kv_cache == own + cross + (b * prompt * H * 4 if t5 else 0)
    assert 0 <= held - est.kv_cache <= 4 * b * 256 * 4 + 128 * 512, (held, est.kv_cache)
    tokens = b * (prompt if t5 else 16 + prompt)
    bound = 2 * tokens * H * 4 + 5 * tokens * (tokens // b) * 4 + 128 * 512
    print(f"{'t5' if t5 else 'llava'} b{b}: kv {est.kv_cache} activations {est.activations}, peak {peak}")
    assert abs(peak - est.kv_cache - est.activations) <= bound, (peak, est.kv_cache, est.activations, bound)


def test_serving_refusals():
    """BERT generates nothing; T5 and LLaVA serve in one process; LLaVA's S must pass its image positions."""
    from omnitron.core.config.parallel import ConfigError
    from omnitron.core.training.arguments import parse_settings
    from omnitron.plan.inference import serve_estimate

    bert = parse_settings(_argv(32, ("--model-type", "bert", "--tokenizer-type", "BertWordPieceLowerCase")), 1)
    with pytest.raises(ConfigError, match="bert has no text to generate"):
        serve_estimate(bert, 2, 8)
    t5 = parse_settings(_argv(32, T5 + ("--tensor-model-parallel-size", "2")), 2)
    with pytest.raises(ConfigError, match="served in one process"):
        serve_estimate(t5, 2, 8)
    with pytest.raises(ConfigError, match="must exceed the 16 image positions"):
        serve_estimate(parse_settings(_argv(32, LLAVA), 1), 2, 16)

