"""A Megatron launch script's flags: aliases give the same settings as omnitron's own spelling,
implementation selectors are accepted with a line saying what runs, contradictions and typos are one
line naming the fix, and abbreviations are refused (as Megatron refuses them)."""
from __future__ import annotations

import dataclasses
import logging
import os
import random
import time

import pytest

from omnitron.core.config.parallel import ConfigError
from omnitron.core.training.arguments import parse_settings

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "40", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]


def _same(a, b) -> None:
    for name in ("model", "training", "optim", "logging", "parallel"):
        assert dataclasses.asdict(getattr(a, name)) == dataclasses.asdict(getattr(b, name)), name


def test_aliases_equal_omnitron_spelling(tmp_path):
    mega = parse_settings(BASE + ["--group-query-attention", "--num-query-groups", "2",
                                  "--use-rotary-position-embeddings", "--recompute-activations",
                                  "--lr-warmup-fraction", "0.25"], 1)
    own = parse_settings(BASE + ["--num-query-groups", "2", "--position-embedding-type", "rope",
                                 "--recompute-granularity", "selective", "--lr-warmup-iters", "10"], 1)
    _same(mega, own)
    # --tensorboard-dir D: events in D itself (Megatron's place), metrics.jsonl there too unless --log-dir
    tb = parse_settings(BASE + ["--tensorboard-dir", str(tmp_path / "tb")], 1).logging
    assert tb.tensorboard_dir == tb.log_dir == str(tmp_path / "tb") and tb.tensorboard
    # Megatron's rule: warm-up = fraction x the decay iterations when they are given
    frac = parse_settings(BASE + ["--lr-decay-iters", "30", "--lr-warmup-fraction", "0.5"], 1)
    assert frac.optim.lr_warmup_iters == 15


def test_config_file_takes_the_same_keys(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("use-rotary-position-embeddings: true\nuse_flash_attn: true\nlr-warmup-fraction: 0.5\n")
    s = parse_settings(BASE + ["--config", str(cfg)], 1)
    assert s.model.position_embedding_type == "rope" and s.optim.lr_warmup_iters == 20


def test_selectors_are_accepted_with_what_runs(caplog):
    with caplog.at_level(logging.INFO, logger="omnitron.train"):
        s = parse_settings(BASE + ["--use-flash-attn", "--transformer-impl", "transformer_engine", "--use-mcore-models",
                                   "--no-masked-softmax-fusion", "--attention-softmax-in-fp32",
                                   "--attention-backend", "auto"], 1)
    _same(s, parse_settings(BASE, 1))  # nothing changes
    said = caplog.text
    for flag in ("--use-flash-attn", "--transformer-impl", "--use-mcore-models", "--no-masked-softmax-fusion",
                 "--attention-softmax-in-fp32", "--attention-backend"):
        assert f"{flag}: accepted; " in said, flag


@pytest.mark.parametrize("extra, message", [
    (["--group-query-attention"], "--group-query-attention needs --num-query-groups N"),
    (["--use-rotary-position-embeddings", "--position-embedding-type", "learned_absolute"],
     "means --position-embedding-type rope, but --position-embedding-type learned_absolute was given"),
    (["--lr-warmup-fraction", "1.5"], r"--lr-warmup-fraction must lie in \[0, 1\)"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3"], "not both"),
    (["--tokenizer-type", "SFTTokenizer"], "SFTTokenizer: Megatron's, not omnitron's"),
    (["--tokenizer-type", "NullMultimodalTokenizer"], "use --tokenizer-type HuggingFaceTokenizer"),
    (["--tokenizer-type", "TikTokenizer", "--tiktoken-pattern", "v3"], "--tiktoken-pattern 'v3': expected v1 or v2"),
    (["--special-tokens", "<image>", "--tokenizer-special-tokens", "<img>"], "drop one of them"),
    # --recompute-modules as Megatron's TransformerConfig checks it under selective recomputation
    (["--recompute-granularity", "selective", "--recompute-modules", "attn"], "'attn' is not one of Megatron's"),
    (["--recompute-activations", "--recompute-modules", "mla_up_proj"], "only with --multi-latent-attention"),
    (["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "moe_act"],
     "only with --moe-grouped-gemm"),
])
def test_contradictions_name_the_fix(extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_settings(BASE + extra, 1)


@pytest.mark.parametrize("extra", [
    ["--recompute-modules", "attn"],  # Megatron reads the list under selective recomputation only
    ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp", "layernorm", "moe",
     "shared_experts", "gdp_qkv"],
    ["--recompute-granularity", "selective", "--recompute-modules", "moe_act", "--num-experts", "4",
     "--moe-grouped-gemm"],
])
def test_recompute_modules_megatron_accepts_are_accepted(extra):
    assert parse_settings(BASE + extra, 1).model.recompute_granularity == (
        "selective" if "selective" in extra else None)


def test_typos_and_abbreviations_are_refused_with_suggestions(capsys):
    from omnitron.cli import main

    for bad, hint in ((["--tensor-parallel-size", "2"], "--tensor-parallel-size (did you mean "
                                                         "--tensor-model-parallel-size"),
                      (["--micro-batch", "2"], "--micro-batch (did you mean --micro-batch-size?)")):
        with pytest.raises(SystemExit) as info:
            main(["train", *bad])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "omnitron train: error: unrecognized arguments: " + hint in err, err
        assert len(err.strip().splitlines()) == 1, err  # not argparse's 250-line usage block before it
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    from omnitron import __version__

    assert capsys.readouterr().out.strip() == f"omnitron {__version__}"


def test_exit_signal_handler_is_the_default_handler():
    assert parse_settings(BASE + ["--exit-signal-handler"], 1).checkpoint.save_on_signal
    with pytest.raises(ConfigError, match="--exit-signal-handler means --save-on-signal True"):
        parse_settings(BASE + ["--exit-signal-handler", "--no-save-on-signal"], 1)


def test_exit_duration_stops_saves_and_says_so(tmp_path, caplog):
    """--exit-duration-in-mins: the first iteration past the limit saves and ends the run (here: the first)."""
    from omnitron.backends import get_backend
    from omnitron.core.training.loop import train

    save = tmp_path / "ck"
    settings = parse_settings(BASE + ["--exit-duration-in-mins", "1e-6", "--train-iters", "50", "--save", str(save),
                                      "--save-interval", "1000", "--no-tensorboard", "--log-dir", str(tmp_path),
                                      "--num-workers", "0"], 1)
    with caplog.at_level(logging.INFO, logger="omnitron.train"):
        result = train(settings, get_backend("cpu"))
    assert result["iteration"] == 1
    assert open(save / "latest").read() == "iter_0000001"
    assert "stopping after iteration 1 (checkpoint saved at 1)" in caplog.text


def test_exit_duration_counts_the_startup(tmp_path, monkeypatch):
    """--exit-duration-in-mins counts from the job's start, as Megatron's from its program's: a startup (model
    build, data indexes, checkpoint load) longer than the limit leaves time for one iteration and the save, not
    for the whole run (which counted from the loop's start used to run on past a scheduler's time limit)."""
    from omnitron.backends import get_backend
    from omnitron.core.training import loop

    limit_s = 3.0
    build = loop.build_components

    def slow_startup(*args, **kwargs):
        time.sleep(limit_s + 0.5)
        return build(*args, **kwargs)

    monkeypatch.setattr(loop, "build_components", slow_startup)
    save = tmp_path / "ck"
    # NOTE: 3 tiny iterations take well under the 3 s limit on their own (about 0.1 s each, 0.7 s loaded)
    settings = parse_settings(BASE + ["--exit-duration-in-mins", str(limit_s / 60), "--train-iters", "3",
                                      "--save", str(save), "--save-interval", "1000", "--no-tensorboard",
                                      "--log-dir", str(tmp_path), "--num-workers", "0"], 1)
    result = loop.train(settings, get_backend("cpu"))
    assert result["iteration"] == 1 and open(save / "latest").read() == "iter_0000001"


@pytest.mark.parametrize("cause", ["duration", "signal"])
def test_a_stopping_run_ends_its_evaluation_early(cause, tmp_path, monkeypatch, caplog):
    """Megatron's evaluate checks --exit-duration-in-mins between its batches and gives up the evaluation, so the
    save comes before a scheduler's time limit; omnitron also on a stop signal. Here the limit is past once the
    first iteration ends (the job started an hour ago, the limit is 30 minutes), or SIGTERM arrives as the first
    evaluation starts: the evaluation reads one of its 3 batches, logs no validation loss, and the run saves
    iteration 1 (its count of validation samples read: that one batch) and stops. It used to read all 3 and log
    their loss first."""
    import signal

    from omnitron.backends import get_backend
    from omnitron.core.training import loop

    evaluate, batches = loop.evaluate, []

    def counted(c, data_iterator, *args):
        if cause == "signal":
            os.kill(os.getpid(), signal.SIGTERM)  # the handler (the run's StopFlag) only sets the flag
        return evaluate(c, (batches.append(b) or b for b in data_iterator), *args)

    monkeypatch.setattr(loop, "evaluate", counted)
    save = tmp_path / "ck"
    limit = ["--exit-duration-in-mins", "30"] if cause == "duration" else []
    settings = parse_settings(BASE + [*limit, "--train-iters", "5", "--eval-interval", "1", "--eval-iters", "3",
                                      "--save", str(save), "--no-tensorboard", "--log-dir", str(tmp_path),
                                      "--num-workers", "0"], 1)
    settings.started_at -= 3600.0
    with caplog.at_level(logging.INFO, logger="omnitron.train"):
        result = loop.train(settings, get_backend("cpu"))
    assert result["iteration"] == 1 and open(save / "latest").read() == "iter_0000001"
    mbs_per_batch = settings.eval_microbatches
    assert result["validation"] == [] and result["test"] is None and len(batches) == mbs_per_batch
    assert "validation after iteration 1 stopped unfinished: the run is stopping" in caplog.text
    from omnitron.core.checkpoint import find_latest, read_metadata

    # the checkpoint counts the one batch read (Megatron adds each batch's samples), where a resume reads on
    assert read_metadata(find_latest(str(save)))["consumed_valid_samples"] == settings.training.eval_batch


def test_newer_aliases_equal_omnitron_spelling(tmp_path):
    mega = parse_settings(BASE + ["--position-embedding-type", "rope", "--norm-epsilon", "1e-6", "--use-rope-scaling",
                                  "--no-position-embedding", "--dataloader-type", "single"], 1)
    # omnitron's own spelling of the scaling is the config field (the command line's factor needs the switch)
    (tmp_path / "own.yaml").write_text("rope_scaling_factor: 8\n")
    own = parse_settings(BASE + ["--position-embedding-type", "rope", "--layernorm-epsilon", "1e-6",
                                 "--config", str(tmp_path / "own.yaml")], 1)
    _same(mega, own)
    kept = parse_settings(BASE + ["--position-embedding-type", "rope", "--use-rope-scaling", "--rope-scaling-factor",
                                  "4"], 1)
    assert kept.model.rope_scaling_factor == 4.0
    with pytest.raises(ConfigError, match="--dataloader-type cyclic"):
        parse_settings(BASE + ["--dataloader-type", "cyclic"], 1)
    with pytest.raises(ConfigError, match="--no-position-embedding needs --position-embedding-type rope"):
        parse_settings(BASE + ["--no-position-embedding"], 1)


def test_rope_scaling_factor_alone_is_refused_as_megatron_ignores_it(tmp_path):
    """Megatron (d98e8a6) hands only ``rope_scaling=args.use_rope_scaling`` to the model when the switch is off:
    ``--rope-scaling-factor F`` alone trains unscaled RoPE there (argument_utils.py, gpt_builders.py). omnitron's
    field would scale by F, so the command line refuses the factor alone, in one line naming the fix."""
    rope = BASE + ["--position-embedding-type", "rope"]
    factor = random.choice([2.0, 8.0, 16.0, 32.0])
    with pytest.raises(ConfigError, match=f"^--rope-scaling-factor {factor:g} without --use-rope-scaling") as info:
        parse_settings(rope + ["--rope-scaling-factor", str(factor)], 1)
    assert "\n" not in str(info.value) and "add --use-rope-scaling" in str(info.value)
    assert parse_settings(rope + ["--rope-scaling-factor", "1"], 1).model.rope_scaling_factor == 1.0  # no scaling
    switched = parse_settings(rope + ["--use-rope-scaling", "--rope-scaling-factor", str(factor)], 1)
    assert switched.model.rope_scaling_factor == factor
    # the switch in a config file turns the command line's factor on too; a file's factor alone is omnitron's
    # spelling (scaling on), as the presets and HF imports set the field
    (tmp_path / "on.yaml").write_text("use-rope-scaling: true\n")
    filed = parse_settings(rope + ["--config", str(tmp_path / "on.yaml"), "--rope-scaling-factor", str(factor)], 1)
    assert filed.model.rope_scaling_factor == factor
    (tmp_path / "own.yaml").write_text(f"rope_scaling_factor: {factor}\n")
    assert parse_settings(rope + ["--config", str(tmp_path / "own.yaml")], 1).model.rope_scaling_factor == factor


def test_quick_geglu_is_read_as_megatron_reads_it(tmp_path):
    """Megatron (d98e8a6): ``elif args.quick_geglu: assert not args.swiglu`` (argument_utils.py), and
    validate_args sizes ``--ffn-hidden-size`` before, from ``--swiglu`` alone: 4h under --quick-geglu."""
    heads = 4
    hidden = heads * random.randrange(6, 40)
    base = [str(hidden) if i and BASE[i - 1] == "--hidden-size" else a for i, a in enumerate(BASE)]
    with pytest.raises(ConfigError, match="^--quick-geglu with --swiglu: .*drop --swiglu") as info:
        parse_settings(base + ["--quick-geglu", "--swiglu"], 1)
    assert "\n" not in str(info.value)
    from omnitron.core.transformer.shapes import ffn_size

    alone = parse_settings(base + ["--quick-geglu"], 1).model
    assert alone.quick_geglu and alone.swiglu and ffn_size(alone) == 4 * hidden  # Megatron's width, not 2/3's
    given = parse_settings(base + ["--quick-geglu", "--ffn-hidden-size", "40"], 1).model
    assert ffn_size(given) == 40
    # a config file keeps omnitron's spelling (a validated model holds both fields)
    (tmp_path / "own.yaml").write_text("swiglu: true\nquick_geglu: true\nffn_hidden_size: 48\n")
    assert ffn_size(parse_settings(base + ["--config", str(tmp_path / "own.yaml")], 1).model) == 48


@pytest.mark.parametrize("kind, fix", [("mrope", "not implemented; use rope"),
                                       ("relative", "not implemented; use learned_absolute")])
def test_megatrons_other_position_types_name_what_to_give(kind, fix):
    """Megatron's --position-embedding-type also takes mrope and relative: refused in one line that says what to
    give instead (its yarn is taken: tests/models/test_gpt_yarn_megatron.py)."""
    with pytest.raises(ConfigError, match=f"^--position-embedding-type '{kind}' is not one of ") as info:
        parse_settings(BASE + ["--position-embedding-type", kind], 1)
    assert "\n" not in str(info.value) and fix in str(info.value)


MLA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
       "--multi-latent-attention", "--kv-lora-rank", "8", "--qk-head-dim", "8", "--qk-pos-emb-head-dim", "4",
       "--v-head-dim", "8", "--rotary-scaling-factor", "40", "--mscale", "0.7"]


def test_rope_type_is_megatrons():
    """Megatron's MLA (multi_latent_attention.py, d98e8a6): rope_type yarn (its default) rotates by YaRN; rope by plain
    RoPE without the concentration factor, yet its softmax scale stays m(--rotary-scaling-factor,
    --mscale-all-dim)^2 / sqrt(d). So --rope-type rope is omnitron's factor 1 where that m is 1 (mscale_all_dim 0:
    checked against megatron-core's MLA, gradients within 2e-7) and is refused where it is not; its other attention
    takes rope only."""
    yarn = parse_settings(BASE + MLA, 1)
    assert parse_settings(BASE + MLA + ["--rope-type", "yarn"], 1).model == yarn.model
    assert yarn.model.rotary_scaling_factor == 40.0
    plain = parse_settings(BASE + MLA + ["--rope-type", "rope"], 1).model
    assert plain == dataclasses.replace(yarn.model, rotary_scaling_factor=1.0)
    with pytest.raises(ConfigError, match=r"--rope-type rope with --rotary-scaling-factor 40.0 and --mscale-all-dim "
                                          r"1.0: .* 1.87385"):
        parse_settings(BASE + MLA + ["--rope-type", "rope", "--mscale-all-dim", "1"], 1)
    gqa = parse_settings(BASE + ["--position-embedding-type", "rope"], 1).model
    assert parse_settings(BASE + ["--position-embedding-type", "rope", "--rope-type", "rope"], 1).model == gqa
    with pytest.raises(ConfigError, match="--rope-type yarn applies to --multi-latent-attention only"):
        parse_settings(BASE + ["--position-embedding-type", "rope", "--rope-type", "yarn"], 1)


# examples/llama/train_llama3_8b_h100_fp8.sh of Megatron-LM (mock-data branch), its shapes scaled down to a
# tiny model and 2 processes (tp2), its sample counts to a 3-iteration run and its --eval-iters 32 to 2 (the
# validation and test evaluations after training read 2 batches each, not 32);
# flag for flag otherwise.
LLAMA3_8B = """
--use-mcore-models --num-layers 2 --hidden-size 64 --ffn-hidden-size 224 --num-attention-heads 4
--group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 32 --max-position-embeddings 32
--position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0
--swiglu --init-method-std 0.0134 --attention-backend fused --untie-embeddings-and-output-weights
--disable-bias-linear
--micro-batch-size 1 --global-batch-size 4 --train-samples 12 --lr-decay-samples 11 --lr-warmup-samples 4
--lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0
--weight-decay 0.1 --adam-beta1 0.9
--adam-beta2 0.95 --calculate-per-token-loss --apply-layernorm-1p --bf16 --grad-reduce-in-bf16
--cross-entropy-loss-fusion --manual-gc
--empty-unused-memory-level 1 --exit-duration-in-mins 235
--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather
--tensor-model-parallel-size 2 --context-parallel-size 1 --sequence-parallel
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
--mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --tiktoken-pattern v2 --split '99,1,0'
--no-create-attention-mask-in-dataloader --no-mmap-bin-files --num-workers 1
--log-interval 1 --eval-iters 2 --eval-interval 100 --save-interval 1000 --log-throughput --profile
--profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist --distributed-timeout-minutes 60
""".split()


def test_megatron_llama3_launch_line_trains(tmp_path):
    """The script's line (paths and sizes swapped for tiny ones; ``'99,1,0'`` with the quotes its word splitting
    leaves in) parses and trains 3 iterations at tp2, once --fp8-param-gather (refused: FP8 parameters round
    differently) is dropped."""
    import json
    import subprocess
    import sys

    with pytest.raises(ConfigError, match="^--fp8-param-gather: "):
        parse_settings(LLAMA3_8B + ["--vocab-size", "256"], 2)
    ckpt, tb = tmp_path / "ckpt", tmp_path / "tb"
    args = [a for a in LLAMA3_8B if a != "--fp8-param-gather"] + [
        "--save", str(ckpt), "--load", str(ckpt), "--tensorboard-dir", str(tb), "--data-cache-path",
        str(tmp_path / "cache"), "--vocab-size", "256", "--nproc-per-node", "2"]
    import pathlib

    root = str(pathlib.Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "omnitron", "train", *args], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = [json.loads(line) for line in open(tb / "metrics.jsonl")]
    recs = [r for r in recs if "lm_loss" in r]  # (not the validation and test records after training)
    assert [r["iteration"] for r in recs] == [1, 2, 3] and [r["consumed_samples"] for r in recs] == [4, 8, 12]
    said = proc.stdout + proc.stderr
    # --decoupled-lr: logged beside lr, as Megatron; the warm-up over 4 samples of 4 per step applies lr(0 samples) =
    # 0 to the first step and the peak to the second (Megatron's scheduler counts the samples before the step)
    assert " | decoupled lr: 5.000000E-04 |" in said and recs[1]["decoupled_lr"] == pytest.approx(5e-4, rel=1e-12)
    assert recs[0]["lr"] == 0.0 and recs[0]["decoupled_lr"] == 0.0
    for flag in ("--use-mcore-models", "--attention-backend", "--cross-entropy-loss-fusion", "--no-mmap-bin-files",
):
        assert f"{flag}: accepted; " in said, flag
    assert (ckpt / "latest").read_text().strip() == "iter_0000003"


@pytest.mark.parametrize("flag", ["--use-legacy-models", "--no-save-optim", "--rotary-seq-len-interpolation-factor 2"])
def test_megatron_flags_not_yet_supported_are_refused(flag):
    with pytest.raises(ConfigError, match=f"^{flag.split()[0]}: .*; drop the flag"):
        parse_settings(BASE + flag.split(), 1)


_VALUES = {"rerun_mode": "disabled", "moe_token_dispatcher_type": "alltoall", "transformer_impl": "local",
           "attention_backend": "auto", "distributed_backend": "gloo",
           "dist_ckpt_strictness": "log_all", "moe_flex_dispatcher_backend": "deepep",
           "recompute_modules": "core_attn", "cross_entropy_fusion_impl": "native",
           "num_distributed_optimizer_instances": "2", "muon_scalar_optimizer": "adam"}


_NEEDS = {"use_precision_aware_optimizer": ["--use-distributed-optimizer"]}
"""Selectors Megatron runs only beside other flags (compared with the settings of those flags alone)."""


def test_every_selector_changes_nothing_and_says_what_runs(caplog):
    from omnitron.core.training.megatron_flags import SELECTORS

    for dest, (metavar, instead, _) in SELECTORS.items():
        flag, base = "--" + dest.replace("_", "-"), BASE + _NEEDS.get(dest, [])
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="omnitron.train"):
            s = parse_settings(base + ([flag] if metavar is None else [flag, _VALUES.get(dest, "1")]), 1)
        _same(s, parse_settings(base, 1))
        assert f"{flag}: accepted; {instead}" in caplog.text, flag


@pytest.mark.parametrize("extra,match", [
    ([], "with the distributed optimizer only; add --use-distributed-optimizer"),
    (["--use-distributed-optimizer", "--optimizer", "sgd"], "with --optimizer adam only, not sgd")])
def test_precision_aware_optimizer_where_megatron_refuses_it(extra, match):
    """Megatron d98e8a6: OptimizerConfig asserts --optimizer adam, get_megatron_optimizer raises without
    --use-distributed-optimizer."""
    with pytest.raises(ConfigError, match="^--use-precision-aware-optimizer: Megatron runs it " + match):
        parse_settings(BASE + ["--use-precision-aware-optimizer", *extra], 1)


def test_moe_per_layer_logging_runs_megatrons_gpt_oss_script_line(caplog):
    """Megatron-LM d98e8a6's examples/gptoss/02_train.sh passes --moe-per-layer-logging (a logging switch): accepted
    with the line saying what is logged; the settings are those without it (it stopped argparse before)."""
    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
           "--moe-aux-loss-coeff", "1e-3", "--moe-z-loss-coeff", "1e-3"]
    with caplog.at_level(logging.INFO, logger="omnitron.train"):
        s = parse_settings(BASE + moe + ["--moe-per-layer-logging"], 1)
    _same(s, parse_settings(BASE + moe, 1))
    assert "--moe-per-layer-logging: accepted; every record carries moe_aux_loss" in caplog.text


# examples/bert/train_bert_340m_distributed.sh of Megatron-LM d98e8a6, shapes and parallel sizes scaled down, data
# swapped for --mock-data: nothing in it says BERT (pretrain_bert.py does), so --entry names the script
BERT_SCRIPT = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
               "--max-position-embeddings", "32", "--attention-backend", "auto",
               "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "20", "--weight-decay", "1e-2",
               "--clip-grad", "1.0", "--lr", "0.0001", "--lr-decay-iters", "19", "--lr-decay-style", "linear",
               "--min-lr", "1.0e-5", "--weight-decay", "1e-2", "--lr-warmup-fraction", ".01", "--clip-grad", "1.0",
               "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
               "--mock-data", "--split", "949,50,1",
               "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000", "--eval-iters", "10"]


def test_megatron_bert_script_by_its_entry(tmp_path):
    """``--entry pretrain_bert`` (the script's name, any path, .py or not) trains BERT exactly as --model-type bert
    does; the same flags without it are a GPT run; a contradiction or an unknown script is one line."""
    vocab = tmp_path / "bert-vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(60)]) + "\n")
    script = BERT_SCRIPT + ["--vocab-file", str(vocab)]
    by_entry = parse_settings(script + ["--entry", "/opt/Megatron-LM/pretrain_bert.py"], 1)
    assert by_entry.model_type == "bert"
    _same(by_entry, parse_settings(script + ["--model-type", "bert"], 1))
    assert parse_settings(script + ["--entry", "pretrain_bert", "--model-type", "bert"], 1).model_type == "bert"
    assert parse_settings(script + ["--tokenizer-type", "BertWordPieceLowerCase"], 1).model_type == "gpt"
    with pytest.raises(ConfigError, match="--entry pretrain_bert trains bert, but --model-type .* says gpt"):
        parse_settings(script + ["--entry", "pretrain_bert", "--model-type", "gpt"], 1)
    with pytest.raises(ConfigError, match="--entry pretrain_mamba: not a Megatron training script omnitron runs"):
        parse_settings(script + ["--entry", "pretrain_mamba"], 1)


def test_swiglu_without_ffn_hidden_size_takes_megatrons_default():
    """Megatron's validate_args: under --swiglu with no --ffn-hidden-size the MLP width is two thirds of 4h,
    rounded down to a multiple of 64 (the gated MLP's third matrix keeps the parameter count near 4h's); without
    --swiglu it is 4h; a given width stands; a width that rounds to 0 is refused."""
    from omnitron.core.models.gpt.config import ffn_size

    rng = random.Random()
    h = 64 * rng.randrange(1, 40)
    flags = BASE + ["--hidden-size", str(h), "--num-attention-heads", "4"]
    want = (8 * h // 3) // 64 * 64  # integer form of int(4h * 2/3 / 64) * 64: no float rounding
    assert ffn_size(parse_settings(flags + ["--swiglu"], 1).model) == want
    assert ffn_size(parse_settings(flags, 1).model) == 4 * h
    given = 4 * rng.randrange(1, 200)
    assert ffn_size(parse_settings(flags + ["--swiglu", "--ffn-hidden-size", str(given)], 1).model) == given
    with pytest.raises(ConfigError, match="--swiglu without --ffn-hidden-size .* = 0 at --hidden-size 16"):
        parse_settings(BASE + ["--hidden-size", "16", "--swiglu"], 1)


def test_fp8_delayed_scaling_defaults_are_megatrons():
    """Megatron's TransformerConfig (d98e8a6, transformer_config.py:621-624) defaults the delayed recipe to a
    history of 1 and the most recent amax, and passes them to TE's DelayedScaling; so does omnitron. A given
    value stands."""
    s = parse_settings(BASE + ["--fp8-format", "hybrid"], 1)
    assert (s.fp8.fp8_amax_history_len, s.fp8.fp8_amax_compute_algo) == (1, "most_recent")
    n = random.randrange(2, 2048)
    s = parse_settings(BASE + ["--fp8-format", "hybrid", "--fp8-amax-history-len", str(n),
                               "--fp8-amax-compute-algo", "max"], 1)
    assert (s.fp8.fp8_amax_history_len, s.fp8.fp8_amax_compute_algo) == (n, "max")


def test_megatron_flags_omnitron_lacks_are_named_as_megatrons(capsys):
    """A Megatron-LM flag omnitron does not define is refused as Megatron's, not offered a look-alike of omnitron's
    (``--moe-single-grouped-bias`` is not ``--moe-grouped-gemm``); a plain typo still gets suggestions."""
    import argparse

    from omnitron.cli import main
    from omnitron.core.config.parser import Parser
    from omnitron.core.training.arguments import add_arguments, megatron_flag_names

    parser = Parser(prog="x", argument_default=argparse.SUPPRESS)
    add_arguments(parser)
    ours = {s for s in parser._option_string_actions if s.startswith("--")}
    theirs = sorted(megatron_flag_names() - ours)
    assert "--moe-single-grouped-bias" in theirs and "--tensor-model-parallel-size" not in theirs
    assert "--add-qkv-bias" not in theirs  # omnitron defines it (GPTConfig.add_qkv_bias)
    for flag in ("--moe-single-grouped-bias", random.choice(theirs)):
        with pytest.raises(SystemExit) as info:
            main(["train", *BASE, flag])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"unrecognized arguments: {flag} (Megatron-LM's flag, which omnitron does not implement" in err, err
        assert "did you mean" not in err


@pytest.mark.parametrize("extra,message", [
    (["--pipeline-schedule", "nosuch"], "--pipeline-schedule 'nosuch' unknown"),
    (["--pipeline-schedule", "dualpipe-v", "--num-layers-per-virtual-pipeline-stage", "1"],
     "dualpipe-v needs at least 2 x pipeline size = 4 micro-batches, got 2"),
    (["--pipeline-schedule", "zb-v"], "runs two model chunks per rank in a V")])
def test_a_schedule_that_cannot_run_stops_the_command_line(extra, message):
    """Found by the schedule's builder when the settings are read (before any rank starts), not by every rank
    after start-up: pp2 with 2 micro-batches a step (global batch 4, micro-batch 2)."""
    flags = BASE + ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--micro-batch-size", "2",
                    "--global-batch-size", "4"]
    with pytest.raises(ConfigError, match=message):
        parse_settings(flags + extra, 2)


@pytest.mark.parametrize("extra", [
    ["--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "4", "--eval-global-batch-size", "6"],
    ["--pipeline-schedule", "dualpipe-v", "--num-virtual-stages-per-pipeline-rank", "2", "--global-batch-size", "8",
     "--eval-global-batch-size", "6"]])
def test_an_evaluation_the_schedule_cannot_run_stops_the_command_line(extra):
    """--eval-global-batch-size gives evaluations their own micro-batch count (3 here, at pp2 and micro-batch 2):
    interleaving refuses it (not a multiple of pp), DualPipeV too (under 2 pp). Refused when the settings are
    read, naming the flag, not at the first evaluation after training started (before its checkpoint);
    accepted without evaluations (--eval-iters 0)."""
    flags = BASE + ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--micro-batch-size", "2", *extra]
    with pytest.raises(ConfigError, match="--eval-global-batch-size 6: an evaluation of 3 micro-batches") as info:
        parse_settings(flags, 2)
    assert "\n" not in str(info.value)
    assert parse_settings(flags + ["--eval-iters", "0"], 2).training.eval_iters == 0


@pytest.mark.parametrize("text,name,message", [
    ("lr: 1.0e-3\nseq-length: 32\nlr: 2.0e-3\n", "c.yaml", "'lr' is given twice; keep one"),
    ("seq-length: 32\nseq_length: 64\n", "c.yaml", "'seq-length' and 'seq_length' both set seq_length; keep one"),
    ('{"lr": 0.001, "lr": 0.002}', "c.json", "'lr' is given twice; keep one")])
def test_a_setting_given_twice_in_a_config_file_is_refused(tmp_path, text, name, message):
    """YAML and JSON readers keep the last of two equal keys silently; a config file that sets one setting twice
    (or under its flag and its field spelling) is refused, naming it, rather than one value chosen."""
    from omnitron.core.training.arguments import load_config_file

    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=f"--config .*{name}: {message}"):
        load_config_file(str(tmp_path / name))
    (tmp_path / "ok.yaml").write_text("lr: 1.0e-3\nnested: {a: 1, b: [1, 2]}\n")
    assert load_config_file(str(tmp_path / "ok.yaml")) == {"lr": 1e-3, "nested": {"a": 1, "b": [1, 2]}}


def test_qwen2_flags_train_and_the_checkpoint_holds_the_qkv_bias(tmp_path, capsys):
    """Megatron's Qwen2 line (``--disable-bias-linear --add-qkv-bias``) trains 2 iterations: the checkpoint has
    biases on linear_qkv only, moved from their zero init; resuming without --add-qkv-bias names the flag."""
    from omnitron.cli import main
    from omnitron.core.checkpoint.io import read_metadata
    from omnitron.core.checkpoint.reshard import read_full_state

    qwen2 = ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--num-query-groups", "2",
             "--group-query-attention", "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
    common = [*BASE[:BASE.index("--train-iters")], "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
              "128", "--no-tensorboard", "--num-workers", "0", "--data-cache-path", str(tmp_path / "cache"),
              "--lr", "1e-3", *qwen2]
    save = str(tmp_path / "ck")
    assert main(["train", *common, "--add-qkv-bias", "--train-iters", "2", "--save", save]) == 0
    path = os.path.join(save, "iter_0000002")
    assert read_metadata(path)["model"]["add_qkv_bias"] is True
    state = read_full_state(path, with_optimizer=False).model
    qkv = [n for n in state if n.endswith("linear_qkv.bias")]
    assert len(qkv) == 2 and all(state[n].abs().max() > 0 for n in qkv)
    assert not [n for n in state if n.endswith(".bias") and "linear_qkv" not in n]
    capsys.readouterr()
    assert main(["train", *common, "--train-iters", "3", "--load", save]) != 0
    assert "--add-qkv-bias True, this run False" in capsys.readouterr().err


def test_a_split_without_training_documents_stops_the_command_line(tmp_path):
    """--split 0,100,0 over a --data-path: refused when the settings are read (it crashed the first training step
    with a TypeError from an empty loader)."""
    flags = [f for f in BASE if f != "--mock-data"] + ["--data-path", str(tmp_path / "corpus_text_document")]
    with pytest.raises(ConfigError, match="--split 0,100,0 gives training no documents"):
        parse_settings(flags + ["--split", "0,100,0"], 1)


def _activation_fusion_cases() -> dict:
    import json

    path = os.path.join(os.path.dirname(__file__), "megatron_activation_fusion", "fixtures.json")
    with open(path) as f:
        return json.load(f)["cases"]


@pytest.mark.parametrize("flags, megatron", sorted(_activation_fusion_cases().items()))
def test_activation_fusion_pairs_are_refused_where_megatron_refuses(flags, megatron):
    """Each MLP activation / fusion combination (--squared-relu beside the default bias-GeLU fusion, a
    --glu-linear-offset beside the bias-SwiGLU fusion or without a gated MLP, the SwiGLU clamp without MoE, negative
    or beside an offset) is refused in one line exactly where Megatron's own parse_args / validate_args /
    TransformerConfig refuse it (megatron_activation_fusion/make_fixtures.py ran them), and accepted elsewhere."""
    if megatron is None:
        parse_settings(BASE + flags.split(), 1)
        return
    with pytest.raises(ConfigError) as info:
        parse_settings(BASE + flags.split(), 1)
    assert "\n" not in str(info.value) and info.value.args[0].startswith("--")
