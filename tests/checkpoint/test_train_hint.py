"""The ``train from it with:`` line ``omnitron checkpoint import-hf`` prints builds the imported model whole.

For each architecture (GPT-2 with the exact GeLU, Llama 3.1 rope scaling, Qwen2 with its q/k/v bias and a window
on one layer, Qwen3-MoE with a dense layer and a window, gpt-oss with YaRN, DeepSeek-V3 with MLA and YaRN) a tiny
``transformers`` model is saved and imported with the CLI (``import-megatron``'s line: test_megatron_moe); the
printed line is split as a shell splits it (``shlex.split``) and parsed by
``omnitron train``'s own settings parser, and the model config that gives must equal the imported checkpoint's
recorded config in every field but two: ``vocab_size`` (a run takes it from the tokenizer, which the line names:
checked separately) and ``params_dtype`` (the run's --bf16 / --fp16 choice, no model setting). ``seq_length`` is
compared too: the line proposes the imported context (capped at 4096), which a run may change (``--load`` does not
compare it). Configs are compared exactly: each value travels as its ``str`` (``repr`` of a float round-trips).
"""
from __future__ import annotations

import dataclasses
import shlex

import pytest
import torch

transformers = pytest.importorskip("transformers")

from omnitron.cli import main as cli  # noqa: E402
from omnitron.core.checkpoint.io import find_latest, read_metadata  # noqa: E402
from omnitron.core.checkpoint.reshard import model_config  # noqa: E402
from omnitron.core.training.arguments import parse_settings  # noqa: E402
from tests.checkpoint.test_hf_moe import HF_CONFIGS, V  # noqa: E402
from tests.checkpoint.test_hf_qwen2 import _hf_config as qwen2_config  # noqa: E402

ARCHITECTURES = {
    "gpt2_exact_gelu": lambda: transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=V, n_positions=32,
                                                       activation_function="gelu", resid_pdrop=0.0),
    "llama3.1": lambda: transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "qwen2_window": lambda: qwen2_config(use_sliding_window=True, sliding_window=3, max_window_layers=1),
    "qwen3_moe_window": HF_CONFIGS["qwen3_moe_window"],
    "gpt_oss_yarn": HF_CONFIGS["gpt_oss_yarn"],
    "deepseek_v3_yarn": HF_CONFIGS["deepseek_v3_yarn"],
}
NOT_COMPARED = ("vocab_size", "params_dtype")


def hint_words(out: str) -> list[str]:
    """The words of the ``train from it with:`` line in a command's output ``out``, as a shell splits them."""
    line = next(x for x in out.splitlines() if x.startswith("train from it with:"))
    return shlex.split(line.split(":", 1)[1])


def assert_hint_builds(out: str, want) -> None:
    """The model config ``omnitron train`` parses from the printed line equals ``want`` field by field."""
    got = parse_settings(hint_words(out) + ["--mock-data"], 1).model
    assert type(got) is type(want)
    for f in dataclasses.fields(want):
        if f.name not in NOT_COMPARED:
            assert getattr(got, f.name) == getattr(want, f.name), f.name


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_import_hint_builds_the_imported_model(name, tmp_path, capsys):
    hf = transformers.AutoModelForCausalLM.from_config(ARCHITECTURES[name](), dtype=torch.float32,
                                                       experts_implementation="eager")
    hf.save_pretrained(tmp_path / "hf")
    capsys.readouterr()
    assert cli(["checkpoint", "import-hf", "--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "ck")]) == 0
    out = capsys.readouterr().out
    meta = read_metadata(find_latest(str(tmp_path / "ck")))
    imported = model_config(meta["model"])
    assert_hint_builds(out, imported)
    words = hint_words(out)
    assert words[:2] == ["--load", str(tmp_path / "ck")]
    settings = parse_settings(words + ["--mock-data"], 1)
    assert settings.data.tokenizer_type == "NullTokenizer" and settings.data.vocab_size + 1 == imported.vocab_size


def test_hint_words_are_shell_safe():
    """A per-layer pattern with spaces or brackets stays one word when the line is pasted into a shell."""
    from omnitron.core.training.arguments import model_words

    words = model_words({"num_layers": 3, "hidden_size": 8, "num_attention_heads": 2, "num_experts": 2,
                         "moe_layer_freq": "[0, 1, 1]", "add_bias_linear": False, "params_dtype": "torch.float32",
                         "vocab_size": 7})
    assert words == ["--num-layers", "3", "--hidden-size", "8", "--num-attention-heads", "2", "--num-experts", "2",
                     "--moe-layer-freq", "[0, 1, 1]", "--disable-bias-linear"]
    assert shlex.split(shlex.join(words)) == words
