"""``--first-last-layers-bf16``'s bound, Megatron's (TransformerConfig.__post_init__): each of
``--num-layers-at-start-in-bf16`` and ``--num-layers-at-end-in-bf16`` may be anything from 0 up to one pipeline
stage's layers, ``num_layers // pp``, inclusive; one more is refused in one line naming the flag and the bound."""
from __future__ import annotations

import random

import pytest

from omnitron.core.config.parallel import ConfigError
from omnitron.core.precision.fp8 import FP8Config


@pytest.mark.parametrize("seed", range(3))
def test_counts_up_to_one_stages_layers_are_accepted_and_one_more_refused(seed):
    rng = random.Random(seed)
    pp = rng.randint(1, 4)
    num_layers = pp * rng.randint(1, 4) + rng.randint(0, pp - 1)  # not always a multiple: the floor counts
    most = num_layers // pp
    for flag, key in (("--num-layers-at-start-in-bf16", "num_layers_at_start_in_bf16"),
                      ("--num-layers-at-end-in-bf16", "num_layers_at_end_in_bf16")):
        for n in range(num_layers + 2):
            cfg = FP8Config(fp8_recipe="tensorwise", first_last_layers_bf16=True, **{key: n})
            if n <= most:
                cfg.check_layers(num_layers, pp)
                continue
            with pytest.raises(ConfigError) as err:
                cfg.check_layers(num_layers, pp)
            msg = str(err.value)
            assert msg.startswith(f"{flag} {n} is more than the {most} layers") and f"at most {most}" in msg
            assert "\n" not in msg
        # without the flag any count passes (Megatron reads them only with --first-last-layers-bf16)
        FP8Config(fp8_recipe="tensorwise", **{key: num_layers + 5}).check_layers(num_layers, pp)


@pytest.mark.parametrize("value", [0, -1, 2.0, "4"])
def test_an_amax_history_shorter_than_one_or_not_an_int_is_refused(value):
    """The delayed recipe's history holds at least the newest amax (its scale comes from it): 0, a negative length
    or a non-integer is refused in one line naming the flag; 1 and longer are accepted as given."""
    with pytest.raises(ConfigError) as err:
        FP8Config(fp8_amax_history_len=value)
    assert str(err.value) == f"--fp8-amax-history-len must be a positive integer, got {value!r}"
    for n in (1, 2, 1024):
        assert FP8Config(fp8_amax_history_len=n).fp8_amax_history_len == n


@pytest.mark.parametrize("start, end", [(1, 1), (2, 0), (0, 3), (2, 2)])
def test_the_first_start_and_last_end_layers_stay_wide(start, end):
    """``enable_fp8`` with ``--first-last-layers-bf16``: layer numbers 1..start and num_layers-end+1..num_layers
    (Megatron's 1-based ``layer_number``) get no FP8 executor, every other layer's linears do. Reference: the
    layer numbers computed here from the counts."""
    from omnitron.core.models.gpt import GPTModel, gpt2_tiny
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.precision.fp8 import enable_fp8

    layers = 5
    model = GPTModel(gpt2_tiny(vocab_size=61, num_layers=layers, hidden_size=16, num_attention_heads=2,
                               ffn_hidden_size=32, seq_length=8), ParallelGroups.single(), seed=1)
    cfg = FP8Config(fp8_recipe="tensorwise", first_last_layers_bf16=True, num_layers_at_start_in_bf16=start,
                    num_layers_at_end_in_bf16=end)
    enabled = enable_fp8(model, cfg, ParallelGroups.single())
    wide = {i for i in range(1, layers + 1) if i <= start or i > layers - end}
    for i in range(1, layers + 1):
        names = [n for n in enabled if f"layers.{i - 1}." in n]
        assert (not names) if i in wide else len(names) >= 2, (i, names)
