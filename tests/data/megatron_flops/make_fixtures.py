"""Writes ``fixtures.json`` beside this file WITH MEGATRON-LM'S OWN CODE: the FLOPs per iteration that Megatron's
training log divides by the step time and the world size (``num_floating_point_operations`` in
``megatron/training/training.py``), for dense, GQA, SwiGLU, untied, MoE (shared experts, --moe-layer-freq as an
int and as a list), MLA (with and without a query rank) and MTP models, at tp 1 and 2.

Needs a Megatron-LM checkout (snapshot d98e8a64dd was used) and torch; it runs on CPU, offline. Run from the
omnitron root:

    MEGATRON_LM=/path/to/Megatron-LM python tests/data/megatron_flops/make_fixtures.py

(On Python < 3.12 Megatron imports ``typing.override``; the script supplies a stand-in.) omnitron is not imported.
Each case's flags go through Megatron's ``parse_args`` and ``validate_args`` (WORLD_SIZE = tp x pp); the padded
vocabulary is Megatron's ``vocab_size_with_padding`` of ``VOCAB`` (what ``build_tokenizer`` sets), and the global
batch size is the ``batch_size`` ``training_log`` passes (micro batch x dp x micro-batches = --global-batch-size).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import typing

if not hasattr(typing, "override"):
    typing.override = lambda f: f

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB = 1100
"""The tokenizer's vocabulary every case pads (1152 at tp 1, 1280 at tp 2: the padding depends on tp)."""
BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 48 --max-position-embeddings 48 "
        "--micro-batch-size 2 --global-batch-size 8 --train-iters 10 --lr 1e-3")
MOE = " --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48"
MLA = (" --multi-latent-attention --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 24 "
       "--position-embedding-type rope")
CASES = {  # name -> flags after BASE
    "gpt_dense": "",
    "gpt_dense_long_seq": " --seq-length 256 --max-position-embeddings 256 --micro-batch-size 1 --global-batch-size 3",
    "gqa_swiglu_untied": (" --group-query-attention --num-query-groups 2 --swiglu --ffn-hidden-size 176 "
                          "--untie-embeddings-and-output-weights --normalization RMSNorm"),
    "kv_channels": " --kv-channels 24 --ffn-hidden-size 200",
    "swiglu_default_ffn": " --swiglu --hidden-size 96 --num-attention-heads 6",
    "tp2_vocab_padding": " --tensor-model-parallel-size 2 --global-batch-size 12",
    "pp2_dp2": " --pipeline-model-parallel-size 2 --global-batch-size 16",
    "moe_shared_freq2": MOE + " --moe-shared-expert-intermediate-size 32 --moe-layer-freq 2",
    "moe_list_swiglu": MOE + " --swiglu --moe-layer-freq ([0]+[1]*3)",
    "moe_default_ffn": " --num-experts 4 --moe-router-topk 1 --moe-router-pre-softmax --ffn-hidden-size 96",
    "mla_q_rank": MLA + " --q-lora-rank 32",
    "mla_no_q_rank": MLA,
    "mtp_dense": " --mtp-num-layers 2 --swiglu --position-embedding-type rope",
    "mtp_moe_last": MOE + (" --position-embedding-type rope --mtp-num-layers 1 --moe-layer-freq ([0]*2+[1]*2) "
                           "--moe-shared-expert-intermediate-size 40"),
    "mtp_dense_last_of_moe": MOE + " --position-embedding-type rope --mtp-num-layers 2 --moe-layer-freq ([1]*3+[0])",
    "dsv3_like": MLA + MOE + " --q-lora-rank 24 --moe-shared-expert-intermediate-size 48 --moe-layer-freq ([0]+[1]*3) "
                             "--mtp-num-layers 1 --swiglu --untie-embeddings-and-output-weights",
}


DP = {"pp2_dp2": 2}
"""Data-parallel size of a case (1 otherwise): the world size the per-GPU throughput divides by."""


def _world(flags: list[str], dp: int) -> int:
    """tp x pp x ``dp``."""
    def get(name):
        return int(flags[flags.index(name) + 1]) if name in flags else 1
    return get("--tensor-model-parallel-size") * get("--pipeline-model-parallel-size") * dp


def megatron_flops(flags: list[str], dp: int) -> dict:
    """Megatron's parse_args / validate_args on ``flags``, then its num_floating_point_operations."""
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding
    from megatron.training import arguments
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.training import num_floating_point_operations

    arguments.get_device_arch_version = lambda: 10  # no GPU here: validate_args asks at tp > 1 (a launch
    # requirement before Blackwell, not a change to the arguments)
    os.environ["WORLD_SIZE"] = str(_world(flags, dp))
    sys.argv = ["pretrain_gpt.py", *flags]
    args = validate_args(parse_args())
    args.padded_vocab_size = vocab_size_with_padding(VOCAB, args, logging_enabled=False)
    return {"flags": flags, "world_size": args.world_size, "global_batch_size": args.global_batch_size,
            "padded_vocab_size": args.padded_vocab_size,
            "flops": num_floating_point_operations(args, args.global_batch_size)}


def main() -> None:
    root = os.environ.get("MEGATRON_LM")
    if not root:
        sys.exit("set MEGATRON_LM to a Megatron-LM checkout")
    sys.path.insert(0, root)
    out = {}
    for name, extra in CASES.items():
        with contextlib.redirect_stdout(io.StringIO()):  # validate_args prints every argument
            out[name] = megatron_flops((BASE + extra).split(), DP.get(name, 1))
        print(name, out[name]["flops"])
    out["_vocab"] = VOCAB
    with open(os.path.join(HERE, "fixtures.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
