"""Hugging Face import/export against ``transformers`` itself.

A tiny random GPT2LMHeadModel and a tiny random LlamaForCausalLM (GQA: 4 heads, 2 key/value heads,
rope_theta 500, untied) with every weight perturbed (norm weights and biases too) are saved with
``save_pretrained`` and imported with ``omnitron checkpoint import-hf`` at tp1 and at tp2 (and
tp2 x pp2). omnitron's forward on the imported shards (one process for tp1; a 2-process gloo run
loading the tp2 shards) gives transformers' logits on fresh random tokens to fp32 tolerance;
``export-hf`` gives back every original tensor bit for bit, and the exported directory loads with
``from_pretrained`` to the same logits. A model made in omnitron with interleaved RoPE, Llama-3.1
rope scaling and biases (the cases import never produces) is exported and checked against
omnitron's own forward. Training from an imported checkpoint starts like --finetune, with the
model flags the import command prints. Bad inputs fail with a message naming the field.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from omnitron.cli import main as cli  # noqa: E402
from omnitron.core.checkpoint.hf import (HFConversionError, config_from_hf, read_hf_dir,  # noqa: E402
                                         write_weights_checkpoint)
from omnitron.core.checkpoint.io import read_metadata, read_shard  # noqa: E402
from omnitron.core.checkpoint.reshard import Layout, model_config, read_full_state  # noqa: E402
from omnitron.testing.distributed import run_distributed  # noqa: E402

V = 100  # padded to 128 (x tp) inside omnitron's shards


def _perturb(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _hf_models() -> dict:
    gpt2 = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=V, n_positions=32,
                                   bos_token_id=0, eos_token_id=0)
    llama = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=V, max_position_embeddings=32, rope_theta=500.0,
                                     rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    out = {"gpt2": transformers.GPT2LMHeadModel(gpt2), "llama": transformers.LlamaForCausalLM(llama)}
    for i, m in enumerate(out.values()):
        _perturb(m, i)
        m.eval()
    return out


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """{kind: (model, directory, tp1 import, tp2 import)}."""
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for kind, model in _hf_models().items():
        d = str(root / kind)
        model.save_pretrained(d)
        cks = []
        for tp in ("1", "2"):
            save = str(root / f"{kind}_tp{tp}")
            assert cli(["checkpoint", "import-hf", "--hf-dir", d, "--save", save,
                        "--tensor-model-parallel-size", tp]) == 0
            cks.append(save)
        out[kind] = (model, d, *cks)
    return out


def _tokens(seed: int, b: int = 2, s: int = 12) -> torch.Tensor:
    return torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(seed))


def _omnitron_logits(path: str, tokens: torch.Tensor) -> torch.Tensor:
    """One process: rank 0's shard of a tp1 checkpoint loaded into a GPTModel; ``[b, s, V]``."""
    from omnitron.core.models.gpt.model import GPTModel
    from omnitron.core.parallel.groups import ParallelGroups

    m = GPTModel(model_config(read_metadata(path)["model"]), ParallelGroups.single()).eval()
    m.load_state_dict(read_shard(path, 0)["model"][0])
    with torch.no_grad():
        return m(tokens).transpose(0, 1)[..., :V]


def _hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_import_tp1_matches_transformers(hf, kind, capsys):
    model, _, tp1, _ = hf[kind]
    path = os.path.join(tp1, "iter_0000000")
    tokens = _tokens(1)
    torch.testing.assert_close(_omnitron_logits(path, tokens), _hf_logits(model, tokens), atol=1e-4, rtol=1e-4)
    assert read_shard(path, 0)["optimizer"]["weights_only"] is True
    assert cli(["checkpoint", "inspect", tp1]) == 0 and "weights only" in capsys.readouterr().out


def test_bf16_round_trip(hf, tmp_path):
    """A bf16 checkpoint stays bf16 through omnitron (params_dtype) and comes back bit for bit."""
    model, d = hf["llama"][:2]
    model16 = transformers.LlamaForCausalLM(model.config).to(torch.bfloat16)
    model16.load_state_dict(model.state_dict())
    model16.save_pretrained(str(tmp_path / "hf16"))
    assert cli(["checkpoint", "import-hf", "--hf-dir", str(tmp_path / "hf16"), "--save", str(tmp_path / "ck"),
                "--tensor-model-parallel-size", "2"]) == 0
    assert read_metadata(str(tmp_path / "ck" / "iter_0000000"))["model"]["params_dtype"] == "torch.bfloat16"
    assert cli(["checkpoint", "export-hf", "--load", str(tmp_path / "ck"), "--out", str(tmp_path / "out")]) == 0
    _, s0 = read_hf_dir(str(tmp_path / "hf16"))
    _, s1 = read_hf_dir(str(tmp_path / "out"))
    assert sorted(s0) == sorted(s1) and all(s1[n].dtype == torch.bfloat16 and torch.equal(s1[n], s0[n]) for n in s0)


def _tp2_worker(paths: list[str], tokens: torch.Tensor) -> list[torch.Tensor]:
    """Each rank loads its own shard of each tp2 checkpoint; returns its vocabulary slice of the logits."""
    from omnitron.backends import get_backend
    from omnitron.core.config.parallel import ParallelConfig
    from omnitron.core.models.gpt.model import GPTModel
    from omnitron.core.parallel.groups import ParallelGroups
    from omnitron.core.parallel.tensor.sharding import to_device

    torch.set_num_threads(1)
    groups = ParallelGroups.build(ParallelConfig(tensor_model_parallel_size=2), backend=get_backend())
    out = []
    for path in paths:
        m = GPTModel(model_config(read_metadata(path)["model"]), groups).eval()
        m.load_state_dict(read_shard(path, groups.rank)["model"][0])
        m = to_device(m, groups.backend.device())
        with torch.no_grad():
            out.append(m(tokens.to(groups.backend.device())).transpose(0, 1).contiguous())
    return out


def test_import_tp2_matches_transformers(hf, tmp_path):
    tokens = _tokens(2)
    kinds = ["gpt2", "llama"]
    ranks = run_distributed(_tp2_worker, 2, [os.path.join(hf[k][3], "iter_0000000") for k in kinds], tokens)
    for i, kind in enumerate(kinds):
        logits = torch.cat([ranks[0][i], ranks[1][i]], -1)[..., :V]  # tp-local slices of the padded vocab
        torch.testing.assert_close(logits, _hf_logits(hf[kind][0], tokens), atol=1e-4, rtol=1e-4)
    # the same weights at tp1, tp2 and tp2 x pp2, read back as full tensors
    model, d = hf["llama"][:2]
    assert cli(["checkpoint", "import-hf", "--hf-dir", d, "--save", str(tmp_path / "pp2"),
                "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]) == 0
    ref = read_full_state(os.path.join(hf["llama"][2], "iter_0000000")).model
    for path in (hf["llama"][3], str(tmp_path / "pp2")):
        got = read_full_state(os.path.join(path, "iter_0000000")).model
        assert sorted(got) == sorted(ref) and all(torch.equal(got[n], ref[n]) for n in ref)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_export_round_trip(hf, kind, tmp_path, capsys):
    model, d, _, tp2 = hf[kind]
    out = str(tmp_path / "exported")
    assert cli(["checkpoint", "export-hf", "--load", tp2, "--out", out]) == 0  # from the tp2 shards
    assert "exported" in capsys.readouterr().out
    c0, s0 = read_hf_dir(d)
    c1, s1 = read_hf_dir(out)
    assert sorted(s0) == sorted(s1)
    for name, t in s0.items():
        assert s1[name].dtype == t.dtype and torch.equal(s1[name], t), name
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(again) is type(model)
    tokens = _tokens(3)
    torch.testing.assert_close(_hf_logits(again, tokens), _hf_logits(model, tokens), atol=1e-6, rtol=1e-6)
    assert config_from_hf(c1) == config_from_hf(c0)


def _native_full(cfg, seed: int) -> dict:
    """A GPTModel made by omnitron (every weight perturbed) as full state, and the model."""
    from omnitron.core.models.gpt.model import GPTModel
    from omnitron.core.models.gpt.state import gather_full_state
    from omnitron.core.parallel.groups import ParallelGroups

    m = GPTModel(cfg, ParallelGroups.single(), seed=seed).eval()
    _perturb(m, seed)
    return {n: t.clone() for n, t in gather_full_state(m, m.groups).items()}, m


@pytest.mark.parametrize("name", ["llama_interleaved_scaled_bias", "gpt2_untied", "llama_layernorm_1p"])
def test_export_native_model(name, tmp_path):
    """omnitron-only settings (interleaved RoPE rows are permuted; llama3 rope scaling; biases;
    an untied GPT-2 head; zero-centred norm weights, --apply-layernorm-1p) give HF models computing
    omnitron's logits."""
    from omnitron.core.models.gpt.presets import gpt2_tiny, llama_tiny

    if name == "llama_layernorm_1p":
        cfg = llama_tiny(num_layers=2, hidden_size=32, ffn_hidden_size=48, vocab_size=V, seq_length=16,
                         apply_layernorm_1p=True)
    elif name.startswith("llama"):
        cfg = llama_tiny(num_layers=2, hidden_size=32, ffn_hidden_size=48, vocab_size=V, seq_length=16,
                         rotary_interleaved=True, rope_scaling_factor=8.0, rotary_base=500.0, add_bias_linear=True)
    else:
        cfg = gpt2_tiny(num_layers=2, hidden_size=32, ffn_hidden_size=64, vocab_size=V, seq_length=16,
                        max_position_embeddings=16, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                        attention_dropout=0.0)
    full, m = _native_full(cfg, seed=7)
    write_weights_checkpoint(full, cfg, str(tmp_path / "ck"), Layout(tp=2))  # records no tokenizer: one is given
    assert cli(["checkpoint", "export-hf", "--load", str(tmp_path / "ck"), "--out", str(tmp_path / "hf"),
                "--tokenizer-type", "NullTokenizer", "--vocab-size", str(V - 1)]) == 0
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    tokens = _tokens(4)
    with torch.no_grad():
        ours = m(tokens).transpose(0, 1)[..., :V]
    torch.testing.assert_close(_hf_logits(hf_model, tokens), ours, atol=1e-4, rtol=1e-4)
    if name == "llama_interleaved_scaled_bias":
        assert json.load(open(tmp_path / "hf" / "config.json"))["rope_scaling"]["factor"] == 8.0


def test_train_from_import_starts_like_finetune(hf, capsys, caplog):
    """The flags import-hf prints rebuild the model; --load of the (tp2) import reshards to one process
    and starts at iteration 0 with a fresh optimizer; lr 0 keeps the imported weights."""
    import logging

    from omnitron.backends import get_backend
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    model, d, _, tp2 = hf["llama"]
    root = os.path.dirname(tp2)
    shutil.rmtree(os.path.join(root, "again"), ignore_errors=True)
    assert cli(["checkpoint", "import-hf", "--hf-dir", d, "--save", os.path.join(root, "again"),
                "--tensor-model-parallel-size", "2"]) == 0
    from tests.checkpoint.test_train_hint import hint_words

    flags = hint_words(capsys.readouterr().out)
    flags[flags.index("--load") + 1] = tp2
    args = [*flags, "--mock-data", "--num-workers", "0", "--micro-batch-size", "1", "--global-batch-size", "1",
            "--train-iters", "1", "--lr", "0.0", "--weight-decay", "0", "--no-tensorboard", "--seq-length", "16",
            "--data-cache-path", os.path.join(root, "cache"), "--log-interval", "1"]
    with caplog.at_level(logging.INFO, logger="omnitron.train"):
        res = train(parse_settings(args, 1), get_backend("cpu"))
    assert "holds weights only" in caplog.text and "resharding" in caplog.text
    c = res["components"]
    assert list(res["losses"]) == [1] and c.optimizer.step_count == 1
    from omnitron.core.models.gpt.state import gather_full_state

    got = gather_full_state(c.modules[0], c.groups)
    ref = read_full_state(os.path.join(hf["llama"][2], "iter_0000000")).model
    assert all(torch.equal(got[n], ref[n]) for n in ref)


def _cfg(**kw) -> dict:
    base = dict(model_type="llama", hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=48,
                vocab_size=V)
    return {**base, **kw}


@pytest.mark.parametrize("cfg, match", [
    (_cfg(model_type="gpt_neox"), "model_type 'gpt_neox' is not supported"),
    (_cfg(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling rope_type 'linear'"),
    (_cfg(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192, "rope_theta": 1e4}), "low_freq_factor=2.0"),
    (_cfg(attention_bias=True), "attention_bias=True but mlp_bias=None"),
    (_cfg(hidden_act="gelu"), "hidden_act='gelu'"),
    (_cfg(intermediate_size=None), "config.json has no intermediate_size"),
    ({"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 4, "n_positions": 8, "vocab_size": V,
      "activation_function": "relu"}, "activation_function='relu'"),
])
def test_unsupported_config_names_the_field(cfg, match):
    with pytest.raises(HFConversionError, match=match):
        config_from_hf(cfg)


def test_bad_inputs_fail_clearly(hf, tmp_path, capsys):
    model, d = hf["gpt2"][:2]
    assert cli(["checkpoint", "import-hf", "--hf-dir", str(tmp_path), "--save", str(tmp_path / "x")]) == 2
    assert "no config.json" in capsys.readouterr().err
    # legacy layout: pytorch_model.bin of the bare base model, with the causal-mask buffers old versions saved
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    shutil.copy(os.path.join(d, "config.json"), legacy / "config.json")
    sd = {k.removeprefix("transformer."): v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    sd["h.0.attn.bias"] = torch.ones(1, 1, 32, 32)
    torch.save(sd, legacy / "pytorch_model.bin")
    assert cli(["checkpoint", "import-hf", "--hf-dir", str(legacy), "--save", str(tmp_path / "legacy_ck")]) == 0
    a = read_full_state(os.path.join(tmp_path, "legacy_ck", "iter_0000000")).model
    b = read_full_state(os.path.join(hf["gpt2"][2], "iter_0000000")).model
    assert all(torch.equal(a[n], b[n]) for n in b)
    sd["h.0.attn.rogue.weight"] = torch.zeros(3)
    torch.save(sd, legacy / "pytorch_model.bin")
    assert cli(["checkpoint", "import-hf", "--hf-dir", str(legacy), "--save", str(tmp_path / "y")]) == 2
    assert "'transformer.h.0.attn.rogue.weight'" in capsys.readouterr().err
    assert cli(["checkpoint", "import-hf", "--hf-dir", d, "--save", str(tmp_path / "z"),
                "--tensor-model-parallel-size", "3"]) == 2
    assert "--tensor-model-parallel-size 3" in capsys.readouterr().err
    from omnitron.core.models.gpt.presets import llama_tiny

    cfg = llama_tiny(num_layers=1, hidden_size=32, ffn_hidden_size=48, vocab_size=V, qk_layernorm=True)
    write_weights_checkpoint(_native_full(cfg, 1)[0], cfg, str(tmp_path / "qk"), Layout())
    assert cli(["checkpoint", "export-hf", "--load", str(tmp_path / "qk"), "--out", str(tmp_path / "o")]) == 2
    assert "--qk-layernorm True" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer",
                                  "Llama2Tokenizer", "BertWordPieceLowerCase", "NullTokenizer"])
def test_export_is_a_usable_model_repository(kind, tmp_path):
    """AutoTokenizer loads the export and encodes and decodes a sentence as the run's tokenizer does; config.json
    and generation_config.json carry the end-of-document id (HF generate stops there); files are 0644."""
    from omnitron.core.checkpoint.hf import write_weights_checkpoint
    from omnitron.core.data.tokenizers import build_tokenizer
    from omnitron.core.models.gpt.presets import gpt2_tiny

    run = {"tokenizer_type": kind}
    if kind == "HuggingFaceTokenizer":
        from omnitron.commands.tokenizer import train_bpe
        from omnitron.core.data.corpus import moby_dick_documents

        corpus = tmp_path / "c.txt"
        corpus.write_text("\n".join(moby_dick_documents()[:40]), encoding="utf-8")
        train_bpe([str(corpus)], 400, str(tmp_path / "tok" / "tokenizer.json"))
        run["tokenizer_model"] = str(tmp_path / "tok")
    if kind == "NullTokenizer":
        run["vocab_size"] = 300
    if kind in ("SentencePieceTokenizer", "Llama2Tokenizer"):
        spm = pytest.importorskip("sentencepiece")
        from omnitron.core.data.corpus import moby_dick_documents

        corpus = tmp_path / "c.txt"
        corpus.write_text("\n".join(moby_dick_documents()[:40]), encoding="utf-8")
        spm.SentencePieceTrainer.Train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=300,
                                       model_type="bpe", eos_id=2, bos_id=1, unk_id=0, pad_id=-1)
        run["tokenizer_model"] = str(tmp_path / "sp.model")
    ours = build_tokenizer(kind, tokenizer_model=run.get("tokenizer_model"), vocab_size=run.get("vocab_size"))
    cfg = gpt2_tiny(num_layers=1, hidden_size=32, ffn_hidden_size=64, vocab_size=ours.vocab_size, seq_length=16,
                    max_position_embeddings=16)
    full, _ = _native_full(cfg, seed=3)
    write_weights_checkpoint(full, cfg, str(tmp_path / "ck"), Layout(), config=run)
    out = tmp_path / "hf"
    assert cli(["checkpoint", "export-hf", "--load", str(tmp_path / "ck"), "--out", str(out)]) == 0
    theirs = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "3 1 4 1 5 9 2 6" if kind == "NullTokenizer" else "Call me Ishmael. Some years ago - never mind how long"
    # BERT's tokenizer wraps a text in [CLS] ... [SEP] by design (omnitron's datasets add them); the others add nothing
    bert = kind.startswith("BertWordPiece")
    ids = theirs.encode(text, add_special_tokens=not bert)
    assert ids == ours.encode(text) and theirs.eos_token_id == ours.eod
    assert theirs.decode(ids) == ours.decode(ours.encode(text))  # and back to the same text
    assert json.load(open(out / "config.json"))["eos_token_id"] == ours.eod
    assert transformers.GenerationConfig.from_pretrained(str(out)).eos_token_id == ours.eod
    assert {oct(os.stat(p).st_mode & 0o777) for p in out.iterdir()} == {"0o644"}
    # HF generate stops at the exported end token: with a head that always picks it, one new token and done
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    head = torch.nn.Linear(cfg.hidden_size, model.lm_head.out_features, bias=True)
    torch.nn.init.zeros_(head.weight)
    with torch.no_grad():
        head.bias.zero_()
        head.bias[ours.eod] = 10.0
    model.lm_head = head
    prompt = torch.tensor([ours.encode(text)[:4]])
    done = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert done.shape[1] == prompt.shape[1] + 1 and int(done[0, -1]) == ours.eod


def test_export_of_a_default_tokenizer_run_and_without_a_tokenizer(tmp_path, capsys):
    """A run on the default tokenizer (no --tokenizer-type) records it, so its export is a usable repository; a
    checkpoint that records no tokenizer is refused in one line, and export-hf --tokenizer-type supplies one."""
    from omnitron.backends import get_backend
    from omnitron.core.data.tokenizers import build_tokenizer
    from omnitron.core.models.gpt.presets import gpt2_tiny
    from omnitron.core.training.arguments import parse_settings
    from omnitron.core.training.loop import train

    argv = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "1", "--train-iters", "1", "--mock-data", "--num-workers", "0", "--no-tensorboard",
            "--save", str(tmp_path / "run"), "--data-cache-path", str(tmp_path / "cache")]
    train(parse_settings(argv, 1), get_backend("cpu"))
    meta = read_metadata(os.path.join(tmp_path, "run", "iter_0000001"))
    assert meta["config"]["tokenizer_type"] == "GPT2BPETokenizer" and meta["config"]["lr_decay_style"] == "linear"
    assert cli(["checkpoint", "export-hf", "--load", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    gpt2, text = build_tokenizer("GPT2BPETokenizer"), "Call me Ishmael."
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert theirs.encode(text) == gpt2.encode(text) and theirs.decode(gpt2.encode(text)) == text
    cfg = gpt2_tiny(num_layers=1, hidden_size=32, ffn_hidden_size=64, vocab_size=50257, seq_length=16,
                    max_position_embeddings=16)
    write_weights_checkpoint(_native_full(cfg, seed=3)[0], cfg, str(tmp_path / "bare"), Layout())  # no config
    assert cli(["checkpoint", "export-hf", "--load", str(tmp_path / "bare"), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "records no tokenizer" in err and "--tokenizer-type" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()
    assert cli(["checkpoint", "export-hf", "--load", str(tmp_path / "bare"), "--out", str(tmp_path / "x"),
                "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]) == 2
    assert "has 101 tokens, the model 50257" in capsys.readouterr().err
    assert cli(["checkpoint", "export-hf", "--load", str(tmp_path / "bare"), "--out", str(tmp_path / "x"),
                "--tokenizer-type", "GPT2BPETokenizer"]) == 0
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "x")).encode(text) == gpt2.encode(text)


def test_dense_yarn_export_is_refused():
    """A dense Llama-style model with YaRN (--rotary-scaling-factor) has no Llama / Qwen2 config.json omnitron
    writes: it exported as plain RoPE, silently another model. Refused in one line."""
    from omnitron.core.checkpoint.hf import config_to_hf
    from omnitron.core.models.gpt.presets import llama_tiny

    for kw in (dict(), dict(add_bias_linear=False, add_qkv_bias=True)):
        with pytest.raises(HFConversionError, match="--rotary-scaling-factor 4.0; a Hugging Face llama model"):
            config_to_hf(llama_tiny(position_embedding_type="yarn", rotary_scaling_factor=4.0, **kw))


def test_import_of_a_head_dim_other_than_hidden_over_heads(tmp_path, capsys):
    """A Llama whose ``head_dim`` is not hidden / heads (16, not 32 / 4: q/k/v project to 64 channels, o_proj back
    to 32) imports as --kv-channels 16 and gives transformers' logits (float32: atol as the tp1 import above)."""
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, vocab_size=V, max_position_embeddings=32,
                                   tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(cfg)
    _perturb(model, 3)
    model.eval()
    model.save_pretrained(str(tmp_path / "hf"))
    assert config_from_hf(cfg.to_dict()).kv_channels == 16
    assert cli(["checkpoint", "import-hf", "--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "ck")]) == 0
    tokens = _tokens(5)
    torch.testing.assert_close(_omnitron_logits(str(tmp_path / "ck" / "iter_0000000"), tokens),
                               _hf_logits(model, tokens), atol=1e-4, rtol=1e-4)


def test_a_config_without_tie_word_embeddings_is_untied_as_transformers_reads_it():
    """config.json without ``tie_word_embeddings``: transformers' LlamaConfig default decides (reference: the
    installed transformers), and omnitron's untie flag is its negation."""
    hf = dict(model_type="llama", hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=48,
              vocab_size=V)
    tied = transformers.LlamaConfig(**{k: v for k, v in hf.items() if k != "model_type"}).tie_word_embeddings
    assert config_from_hf(hf).untie_embeddings_and_output_weights is (not tied)


_LEFT_OUT = {  # the fields each config.json below gives: every other one is left to the model type's default
    "llama": {}, "qwen2": {},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    "gpt_oss": {"num_key_value_heads": 2, "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2},
    "deepseek_v3": {"num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 16, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8,
                    "qk_nope_head_dim": 8, "v_head_dim": 8, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1},
}
_DEFAULTED = ("max_position_embeddings", "seq_length", "layernorm_epsilon", "init_method_std", "attention_dropout",
              "hidden_dropout", "untie_embeddings_and_output_weights", "bias_gelu_fusion")


@pytest.mark.parametrize("kind", [*_LEFT_OUT, "gpt2"])
def test_fields_a_config_leaves_out_are_read_as_transformers_fills_them(kind):
    """A config.json without max_position_embeddings, the norm epsilon, the dropouts, the init std or the tying reads
    as the same config with transformers' defaults for its model type written in (reference: the installed
    transformers' config class; Qwen2 and Qwen3-MoE default to 32768 positions, gpt-oss to 131072, Llama to 2048)."""
    given = (dict(n_embd=32, n_layer=2, n_head=4, vocab_size=V, n_positions=32) if kind == "gpt2" else
             dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=48, vocab_size=V,
                  **_LEFT_OUT[kind]))
    filled = transformers.AutoConfig.for_model(kind, **given).to_dict()
    got, want = config_from_hf({"model_type": kind, **given}), config_from_hf(filled)
    assert {f: getattr(got, f) for f in _DEFAULTED} == {f: getattr(want, f) for f in _DEFAULTED}
