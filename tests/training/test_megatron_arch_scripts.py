"""Megatron-LM's DeepSeek-V3 and gpt-oss launch lines, scaled down, run by `omnitron train`.

Megatron-LM at d98e8a6 ships no ``examples/deepseek_v3`` or ``examples/gpt_oss`` directory (the
``examples/deepseek_v3`` scripts exist only in unmerged ROCm pull requests). Its own argument lists for these
families are ``examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh`` (PRETRAIN_ARGS, the non-FSDP branch) and
``examples/post_training/modelopt/conf/openai/gpt-oss-20b.sh`` (MODEL_ARGS). They are copied flag for flag;
the shapes (layers, hidden, experts, sequence, sample counts) are scaled down, the data (``--data-path``, the
HF tokenizer) swapped for ``--mock-data`` with NullTokenizer as in ``test_megatron_flags.py``, and the
parallel sizes are the scripts' variables (TP, EP). A flag omnitron refuses is asserted refused and dropped.
Default suite: one process per family, 3 steps in-process; ``-m slow``: ep2 / tp2+sp through ``omnitron train``.
"""
from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import subprocess
import sys

import pytest

from omnitron.backends import get_backend
from omnitron.core.config.parallel import ConfigError
from omnitron.core.training.arguments import parse_settings

# sbatch_mfsdp_deepseek_v3.sh: 61 layers -> 3 (moe-layer-freq [0]*3+[1]*58 -> [0]*1+[1]*2), hidden 7168 -> 64,
# 256 experts -> 8 (8 groups -> 4), MLA ranks 1536/512 -> 32/16, heads 128 -> 4, sequence 4096 -> 32
DEEPSEEK_V3 = """
--distributed-timeout-minutes 60 --tensor-model-parallel-size {tp} --expert-model-parallel-size {ep}
--expert-tensor-parallel-size 1 --context-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce
--overlap-param-gather --use-mcore-models --sequence-parallel --use-flash-attn --disable-bias-linear
--micro-batch-size 1 --global-batch-size 2 --train-samples 6 --exit-duration-in-mins 220
--no-check-for-nan-in-loss-and-grad --manual-gc --manual-gc-interval 10 --recompute-granularity selective
--recompute-modules mlp moe mla_up_proj layernorm --transformer-impl transformer_engine --seq-length 32
--data-cache-path {out}/cache --mock-data --tokenizer-type NullTokenizer --vocab-size 256
--split 99,1,0 --no-mmap-bin-files --no-create-attention-mask-in-dataloader --num-workers 1
--num-layers 3 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 4 --kv-channels 16
--max-position-embeddings 32 --position-embedding-type rope --rotary-base 10000 --make-vocab-size-divisible-by 3232
--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights --multi-latent-attention
--attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1 --qk-layernorm
--lr-decay-samples 5 --lr-warmup-samples 2 --lr-warmup-init 3.9e-7 --lr 3.9e-6 --min-lr 3.9e-7
--lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95 --num-experts 8 --moe-layer-freq [0]*1+[1]*2
--moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 32 --moe-router-load-balancing-type seq_aux_loss
--moe-router-topk 2 --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep --moe-router-pre-softmax
--moe-grouped-gemm --moe-aux-loss-coeff 1e-4 --moe-router-group-topk 2 --moe-router-num-groups 4
--moe-router-topk-scaling-factor 2.5 --moe-router-score-function sigmoid --moe-router-enable-expert-bias
--moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32 --moe-permute-fusion --moe-router-force-load-balancing
--q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16
--rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1
--eval-iters 32 --eval-interval 100 --auto-detect-ckpt-format --load {out}/checkpoints --save {out}/checkpoints
--save-interval 100 --dist-ckpt-strictness log_all --init-method-std 0.02 --log-timers-to-tensorboard
--log-memory-to-tensorboard --log-num-zeros-in-grad --log-params-norm --log-validation-ppl-to-tensorboard
--log-throughput --log-interval 1 --logging-level 40 --tensorboard-dir {out}/tensorboard --bf16 --enable-experimental
"""

# gpt-oss-20b.sh's MODEL_ARGS: 24 layers -> 2, hidden 2880 -> 64, 64/8 heads -> 4/2, 32 experts -> 4, the
# window 128 -> 8, sequence 4096 -> 32; the conf has no data or optimizer flags: Megatron's defaults plus the
# run length, batch and learning rate of test_megatron_flags.py's BASE
GPT_OSS = """
--save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion --untie-embeddings-and-output-weights
--no-rope-fusion --normalization RMSNorm --num-layers 2 --hidden-size 64 --ffn-hidden-size 64
--num-attention-heads 4 --group-query-attention --num-query-groups 2 --kv-channels 16 --num-experts 4
--moe-ffn-hidden-size 64 --moe-router-dtype fp32 --moe-router-topk 2 --moe-aux-loss-coeff 0.0
--moe-token-dispatcher-type alltoall --moe-router-score-function softmax --moe-router-load-balancing-type aux_loss
--seq-length 32 --max-position-embeddings 64 --tokenizer-type NullTokenizer --vocab-size 256
--make-vocab-size-divisible-by 128 --use-mcore-models --rotary-percent 1.0 --rotary-base 150000
--no-bias-gelu-fusion --sequence-parallel --export-force-local-attention --no-bias-dropout-fusion
--padded-vocab-size 384 --quick-geglu --glu-linear-offset 1.0 --softmax-type learnable --window-attn-skip-freq 2
--enable-gpt-oss --activation-func-clamp-value 7.0 --window-size 7,0
--tensor-model-parallel-size {tp} --mock-data --global-batch-size 2 --train-iters 3 --lr 1e-4
--data-cache-path {out}/cache --tensorboard-dir {out}/tensorboard
"""

NEW_SELECTORS = ("--recompute-modules", "--moe-flex-dispatcher-backend", "--moe-permute-fusion",
                 "--auto-detect-ckpt-format", "--dist-ckpt-strictness", "--logging-level", "--enable-experimental")


def _args(script: str, out, **sizes) -> list[str]:
    return script.format(out=out, **sizes).split()


def _drop(args: list[str], flag: str) -> list[str]:
    assert flag in args
    return [a for a in args if a != flag]


def test_deepseek_v3_script_refuses_force_balancing_and_parses_the_rest(tmp_path, caplog):
    """The one refused flag says why; the rest give DeepSeek-V3's model (MLA, sigmoid group-limited routing with
    the expert bias, seq_aux_loss, one dense layer, MTP) and log each selector."""
    args = _args(DEEPSEEK_V3, tmp_path, tp=1, ep=2)
    with pytest.raises(ConfigError, match="^--moe-router-force-load-balancing: Megatron routes on random logits"):
        parse_settings(args, 2)
    with caplog.at_level(logging.INFO, logger="omnitron.train"):
        s = parse_settings(_drop(args, "--moe-router-force-load-balancing"), 2)
    m = s.model
    assert m.multi_latent_attention and (m.q_lora_rank, m.kv_lora_rank, m.v_head_dim) == (32, 16, 16)
    assert m.moe_router_score_function == "sigmoid" and m.moe_router_enable_expert_bias and m.mtp_num_layers == 1
    assert m.moe_router_load_balancing_type == "seq_aux_loss" and m.make_vocab_size_divisible_by == 3232
    assert s.parallel.expert_model_parallel_size == 2 and m.moe_router_dtype == "fp32"
    for flag in NEW_SELECTORS:
        assert f"{flag}: accepted; " in caplog.text, flag
    with pytest.raises(ConfigError, match="^--moe-router-dtype fp64: omnitron routes in the model's dtype"):
        parse_settings(_drop(args, "--moe-router-force-load-balancing") + ["--moe-router-dtype", "fp64"], 2)


def _three_steps(args: list[str]) -> dict:
    from omnitron.core.training.loop import train

    losses = train(parse_settings(args, 1), get_backend("cpu"))["losses"]
    assert sorted(losses) == [1, 2, 3] and all(math.isfinite(v) for v in losses.values()), losses
    return losses


def test_deepseek_v3_script_trains_one_process(tmp_path):
    """EP=1: three steps of the scaled model on one process, the checkpoint saved at the end."""
    args = _drop(_args(DEEPSEEK_V3, tmp_path, tp=1, ep=1), "--moe-router-force-load-balancing")
    _three_steps(args + ["--eval-interval", "0"])
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "iter_0000003"


def test_gpt_oss_script_trains_one_process(tmp_path, caplog):
    """TP=1: the gpt-oss line (windows every other layer, learnable sinks, clamped quick-GeGLU, padded vocabulary
    384 as given) trains three steps; the ModelOpt flags are accepted with what they do in a pretraining run."""
    args = _args(GPT_OSS, tmp_path, tp=1)
    s = parse_settings(args, 1)
    m = s.model
    assert (m.window_size, m.window_attn_skip_freq, m.softmax_type) == ("7,0", "2", "learnable")
    assert m.quick_geglu and m.activation_func_clamp_value == 7.0 and m.padded_vocab_size == 384
    with caplog.at_level(logging.INFO, logger="omnitron.train"):
        _three_steps(args)
    for flag in ("--enable-gpt-oss", "--export-force-local-attention"):
        assert f"{flag}: accepted; " in caplog.text, flag
    assert m.moe_router_dtype == "fp32"


def test_padded_vocab_size_sets_the_rows_as_megatron():
    """--padded-vocab-size is the embedding's row count unrounded; one under the vocabulary or not divisible by
    tp is one line."""
    from dataclasses import replace

    from omnitron.core.models.gpt.config import padded_vocab_size

    base = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "300", "--micro-batch-size", "1", "--train-iters", "1"]
    c = replace(parse_settings(base + ["--padded-vocab-size", "330"], 1).model, vocab_size=300)
    assert padded_vocab_size(c, 1) == 330 and padded_vocab_size(c, 2) == 330
    assert padded_vocab_size(replace(c, padded_vocab_size=None), 2) == 512
    for tp, rows in ((4, 330), (1, 299)):
        with pytest.raises(ConfigError, match="^--padded-vocab-size .* must be a multiple of"):
            padded_vocab_size(replace(c, padded_vocab_size=rows), tp)


def _omnitron_train(args: list[str], nproc: int, cwd) -> str:
    root = str(pathlib.Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "omnitron", "train", *args, "--nproc-per-node", str(nproc)],
                          capture_output=True, text=True, timeout=900, cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_deepseek_v3_script_trains_at_ep2(tmp_path):
    """The script's EP=2 on two processes through `omnitron train`: three steps, the MTP loss logged."""
    args = _drop(_args(DEEPSEEK_V3, tmp_path, tp=1, ep=2), "--moe-router-force-load-balancing")
    said = _omnitron_train(args, 2, tmp_path)
    recs = [json.loads(line) for line in open(tmp_path / "tensorboard" / "metrics.jsonl")]
    assert [r["iteration"] for r in recs if "lm_loss" in r] == [1, 2, 3]
    assert all("mtp_loss" in r for r in recs if "lm_loss" in r) and "--moe-permute-fusion: accepted; " in said


@pytest.mark.slow
def test_gpt_oss_script_trains_at_tp2_sp(tmp_path):
    """The gpt-oss line at TP=2 with its --sequence-parallel through `omnitron train`: three steps (logged at the
    last: the line keeps Megatron's default --log-interval 100)."""
    _omnitron_train(_args(GPT_OSS, tmp_path, tp=2), 2, tmp_path)
    recs = [json.loads(line) for line in open(tmp_path / "tensorboard" / "metrics.jsonl")]
    assert [r["iteration"] for r in recs if "lm_loss" in r] == [3] and math.isfinite(recs[-1]["lm_loss"])
