"""The FP8 flag combinations Megatron refuses (``TransformerConfig.__post_init__``'s ``if self.fp8`` block and
``validate_args``'s FP8 checks, megatron/core/transformer/transformer_config.py and megatron/training/arguments.py)
are refused by omnitron's command line too, each in one line naming the flag and the fix, before any work; the
neighbouring combinations Megatron runs are accepted (so every row can fail both ways)."""
from __future__ import annotations

import pytest

from omnitron.core.config.parallel import ConfigError

_BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
         "--bf16", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "1",
         "--pipeline-model-parallel-size", "2"]
_HYBRID = ["--fp8-format", "hybrid"]
_ENDS = ["--first-last-layers-bf16"]
_UNKNOWN = "Megatron-LM's flag, which omnitron does not implement: drop it"

# (Megatron's rule, extra flags, the start of what the refusal says or None where Megatron runs it)
CASES = [
    ("first/last layers in BF16 need a recipe other than delayed (the default)", _HYBRID + _ENDS,
     "--first-last-layers-bf16 with --fp8-recipe delayed (the default recipe): Megatron refuses it"),
    ("... delayed named", _HYBRID + ["--fp8-recipe", "delayed"] + _ENDS,
     "--first-last-layers-bf16 with --fp8-recipe delayed"),
    ("... tensorwise runs", _HYBRID + ["--fp8-recipe", "tensorwise"] + _ENDS, None),
    ("... blockwise runs", ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"] + _ENDS, None),
    ("... without FP8 the flag is not read", _ENDS, None),
    ("start layers at most num_layers // pp", _HYBRID + ["--fp8-recipe", "tensorwise"] + _ENDS +
     ["--num-layers-at-start-in-bf16", "3"], "--num-layers-at-start-in-bf16 3 is more than the 2 layers"),
    ("end layers at most num_layers // pp", _HYBRID + ["--fp8-recipe", "tensorwise"] + _ENDS +
     ["--num-layers-at-end-in-bf16", "3"], "--num-layers-at-end-in-bf16 3 is more than the 2 layers"),
    ("... exactly num_layers // pp runs", _HYBRID + ["--fp8-recipe", "tensorwise"] + _ENDS +
     ["--num-layers-at-start-in-bf16", "2", "--num-layers-at-end-in-bf16", "0"], None),
    ("start layers not negative", _HYBRID + ["--fp8-recipe", "tensorwise"] + _ENDS +
     ["--num-layers-at-start-in-bf16", "-1"], "--num-layers-at-start-in-bf16 must be a non-negative integer"),
    ("custom recipe needs --fp8-quantizer-factory", _HYBRID + ["--fp8-recipe", "custom"],
     "--fp8-recipe 'custom' is unknown"),
    ("... and the factory flag", _HYBRID + ["--fp8-recipe", "tensorwise", "--fp8-quantizer-factory", "m.f"],
     "unrecognized arguments: --fp8-quantizer-factory (" + _UNKNOWN),
    ("fp8_param (--fp8-param-gather) needs FP8 and the distributed optimizer", ["--fp8-param-gather"],
     "--fp8-param-gather: omnitron keeps the parameters in the training dtype"),
    ("... with FP8 too", _HYBRID + ["--fp8-param-gather", "--use-distributed-optimizer"],
     "--fp8-param-gather: omnitron keeps the parameters in the training dtype"),
    ("fp8_output_proj needs FP8 and mxfp8", _HYBRID + ["--fp8-recipe", "tensorwise", "--fp8-output-proj"],
     "unrecognized arguments: --fp8-output-proj (" + _UNKNOWN),
    ("mxfp8 (omnitron has no MX GEMMs)", _HYBRID + ["--fp8-recipe", "mxfp8"],
     "--fp8-recipe mxfp8 is not supported by omnitron"),
    ("fp4 and fp8 not together", _HYBRID + ["--fp4-format", "e2m1"],
     "unrecognized arguments: --fp4-format (" + _UNKNOWN),
    ("moe_act / layernorm recompute not with delayed", _HYBRID + ["--recompute-granularity", "selective",
                                                                  "--recompute-modules", "layernorm"],
     "--recompute-modules layernorm: Megatron refuses it with the delayed FP8 recipe"),
    ("... tensorwise runs", _HYBRID + ["--fp8-recipe", "tensorwise", "--recompute-granularity", "selective",
                                       "--recompute-modules", "layernorm"], None),
    ("router padding for quantization needs FP8/FP4", ["--moe-router-padding-for-quantization"],
     "unrecognized arguments: --moe-router-padding-for-quantization (" + _UNKNOWN),
]


@pytest.mark.parametrize("rule,extra,refusal", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_megatron_fp8_refusals(rule, extra, refusal, capsys):
    """Each row: ``refusal`` None, the settings build with the FP8 config asked for; else a ConfigError (or the
    parser's exit 2, for a Megatron flag omnitron does not take) whose one line starts with / holds ``refusal``."""
    from omnitron.core.training.arguments import parse_settings

    if refusal is None:
        s = parse_settings(_BASE + extra, 2)
        fmt = extra[extra.index("--fp8-format") + 1] if "--fp8-format" in extra else None
        assert (s.fp8 and s.fp8.fp8_format) == fmt, rule
        return
    try:
        parse_settings(_BASE + extra, 2)
    except ConfigError as e:
        msg = str(e)
        assert "\n" not in msg and msg.startswith(refusal), (rule, msg)
        return
    except SystemExit as e:
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert e.code == 2 and refusal in err, (rule, err)
        return
    pytest.fail(f"accepted, which Megatron refuses: {rule} ({' '.join(extra)})")
