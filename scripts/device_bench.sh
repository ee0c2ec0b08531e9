#!/usr/bin/env bash
# The one prepared run for a lent GPU (one H200, fifteen minutes of device time in all, the machine's start
# included): everything the CPU stand-ins claim, measured on the device, within BUDGET_S seconds (default
# 540; tests/test_device_scripts.py holds the default to it). Steps run most important first, each under its
# own limit, and a step that no longer fits the budget is skipped, so the run always ends in time with the
# headline figures taken. Results land in benchmarks/results/<gpu>-<date>/ (or $OUT): device_check.log
# (everything), summary.md (one row per step), junit-*.xml, metrics-*.jsonl, bench/*.json.
#   1. environment and `omnitron info`
#   2. the 1.3B GPT, 15 iterations each: bf16 and tensorwise FP8 eager, then both with --torch-compile (FP8's
#      cast as a Triton graph op and as inductor's lowering; delayed FP8 too; micro-batch 4 and 8), then both
#      with --cuda-graph-impl local, and compiled with it (the compiled layers captured), then torchao's FP8 (--fp8-impl torchao) where its wheel was carried (the
#      FP8-vs-bf16 goal), metrics-*.jsonl kept for the loss curves
#   3. one FP8 layer profiled (benchmarks/fp8_profile.py), the FP8 linear table (benchmarks/fp8_gemm.py), and
#      compiled FP8, compiled bf16 and compiled + captured FP8 training steps traced (`--profile`: idle
#      fraction, top kernels; two untraced iterations after them in the same run)
#   4. multi-rank on one GPU: benchmarks/device_multirank.py (2-4 processes on the one device over
#      host-staged gloo, losses against the CPU run of the same layout; world-1 layouts on NCCL)
#   5. the cuda conformance suite (every kernel against its float64 reference)
#   6. delayed-scaling FP8 at 1.3B; the golden loss curve (omnitron/testing/golden.py: 100 steps of a tiny
#      GPT, recorded as golden/cuda.json); `omnitron bench all` (the report `omnitron plan --bench` and
#      `bench compare` read); the planted stream bugs that `sim` catches, run on the GPU to see what they do
#      there (benchmarks/planted_ground_truth.py, as scripts/device_check.sh; two-rank cases skip on one GPU)
# usage: scripts/device_bench.sh              on the GPU machine (python3 with a CUDA torch, pytest)
#        DRY_RUN=1 scripts/device_bench.sh    anywhere: print every step and its limit, check every file a
#                                             step uses exists, run nothing (the plan goes to a temporary
#                                             folder, or OUT)
#        STEP_SCALE=2 ...                     doubles every limit (a slower GPU)
#        BUDGET_S=420 ...                     a shorter lease: the steps past it are skipped
#        ONLY=multirank,conformance ...       a rerun of the named steps alone
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMNITRON_BACKEND=cuda
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr 'A-Z ' 'a-z-' | sed 's/^nvidia-//')
# a dry run writes its plan outside the checkout unless OUT says where (it once left a nogpu-<date> folder there)
if [ "${DRY_RUN:-0}" = 1 ]; then default_dir=$(mktemp -d -t device_bench_dry.XXXXXX)
else default_dir=benchmarks/results/${gpu:-nogpu}-$(date -u +%F); fi
LOG_DIR=${OUT:-$default_dir}
mkdir -p "$LOG_DIR"
: >"$LOG_DIR/device_check.log"
# shellcheck source=lib/steps.sh
source scripts/lib/steps.sh
export LOG_DIR
export BUDGET_S=${BUDGET_S:-540}

# torchao for `--fp8-impl torchao`, where its wheel was carried (the image has none and cannot fetch one). Here,
# before the lease: python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#   --platform manylinux_2_28_x86_64 -d .whl torchao   (0.18.0, 3.3 MB; `.whl/` is git-ignored: name it in carry)
TORCHAO=0
if [ "${DRY_RUN:-0}" != 1 ] && ls .whl/torchao-*.whl >/dev/null 2>&1 &&
   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/torchao-*.whl; then
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
  TORCHAO=1
fi

# ---- 1. environment ---------------------------------------------------------------------------
env_step 30

# ---- 2. the 1.3B GPT: bf16 and FP8, eager and compiled -----------------------------------------
need examples/gpt_1p3b_bench.yaml
train() {  # train NAME EXTRA_FLAGS...: 15 iterations, metrics kept as metrics-NAME.jsonl
  local name=$1; shift
  python3 -m omnitron train --config examples/gpt_1p3b_bench.yaml --train-iters 15 --log-interval 5 \
    --log-dir "/tmp/omnitron-$name" "$@" && cp "/tmp/omnitron-$name/metrics.jsonl" "$LOG_DIR/metrics-$name.jsonl" &&
    { [ ! -f "/tmp/omnitron-$name/profile/summary_rank0.json" ] ||
      cp "/tmp/omnitron-$name/profile/summary_rank0.json" "$LOG_DIR/profile-$name.json"; }
}
export -f train
train_step() {  # train_step LIMIT NAME FLAGS...: one training as its own step (`timeout` runs no function)
  local limit=$1 name=$2; shift 2
  run_step "train-$name" "$limit" bash -c 'train "$@"' train "$name" "$@"
}
FP8_TW=(--fp8-format hybrid --fp8-recipe tensorwise)
train_step 45 bf16
train_step 45 fp8-tensorwise "${FP8_TW[@]}"
train_step 80 bf16-compiled --torch-compile
train_step 80 fp8-tensorwise-compiled "${FP8_TW[@]}" --torch-compile
# A/B of the compiled FP8 cast: the Triton cast-transpose as one graph op (opt-in `triton_graph`, never measured)
# against the default (the plain-torch reference lowered by inductor), and delayed scaling compiled (its cast
# takes the amax in the same pass)
OMNITRON_KERNELS=fp8_cast_transpose_from_amax=triton_graph,fp8_cast_transpose_amax=triton_graph \
  train_step 80 fp8-tensorwise-compiled-graphop "${FP8_TW[@]}" --torch-compile
train_step 80 fp8-delayed-compiled --fp8-format hybrid --fp8-recipe delayed --torch-compile
# A/B of the weights' FP8 form held outside the compiled layers and refreshed once per step (the default since
# 2026-12-05, static_weights.py) against quantized inside every layer call, as fp8-tensorwise-compiled ran before
OMNITRON_FP8_WEIGHT_IN_GRAPH=1 \
  train_step 80 fp8-tensorwise-compiled-weight-in-graph "${FP8_TW[@]}" --torch-compile
# the same pair at micro-batch 8 (4 micro-batches of 8 x 2048 tokens): larger GEMMs, the casts and launches a
# smaller share of the step
MBS8=(--micro-batch-size 8 --global-batch-size 32)
train_step 90 bf16-compiled-mbs8 --torch-compile "${MBS8[@]}"
train_step 90 fp8-tensorwise-compiled-mbs8 "${FP8_TW[@]}" --torch-compile "${MBS8[@]}"
# each layer's forward and backward captured as CUDA graphs and replayed (never run on a GPU before)
train_step 80 fp8-tensorwise-graphs "${FP8_TW[@]}" --cuda-graph-impl local
train_step 80 bf16-graphs --cuda-graph-impl local
# each COMPILED layer's forward and backward captured as CUDA graphs (--torch-compile with --cuda-graph-impl
# local): inductor's fused kernels replayed without their launches, AOTAutograd's wrappers and dynamo's guard
# checks; the A/B against the compiled steps above (BENCHMARKS.md, the 2026-12-04 analysis of FP8's idle time)
train_step 80 bf16-compiled-graphs --torch-compile --cuda-graph-impl local
train_step 80 fp8-tensorwise-compiled-graphs "${FP8_TW[@]}" --torch-compile --cuda-graph-impl local
# torchao's Float8Linear behind --fp8-impl torchao (tensorwise), eager and compiled, where the wheel came along
if [ "$TORCHAO" = 1 ]; then
  train_step 60 fp8-torchao "${FP8_TW[@]}" --fp8-impl torchao
  train_step 80 fp8-torchao-compiled "${FP8_TW[@]}" --fp8-impl torchao --torch-compile
fi

# ---- 3. one FP8 layer profiled, the FP8 linear table -------------------------------------------
need benchmarks/fp8_profile.py benchmarks/fp8_gemm.py
run_step fp8-profile 45 bash -c "python3 benchmarks/fp8_profile.py --json $LOG_DIR/fp8_profile.json &&
  python3 benchmarks/fp8_gemm.py --step-layers 4 --json $LOG_DIR/fp8_gemm.json"
# the per-tensor cast-transpose as a compiled layer runs it (inductor's lowering: the `compile` row) beside the
# Triton kernel eager runs: `omnitron plan --bench` takes the compile row over the run's copy bandwidth
# (omnitron/plan/rates.py cast_transpose_rate); the shipped h200 profile prices it at the copy rate until then
run_step fp8-cast-compiled 40 python3 -m omnitron bench kernels --backend cuda --ops fp8_cast_transpose_amax \
  --compile --size large --dtypes bfloat16 --json "$LOG_DIR/fp8_cast_compiled.json"
# the whole compiled FP8 step under torch.profiler (iterations 5-6): device busy / idle, top kernels
# (omnitron/core/training/trace_summary.py; profile-*.json, and the log line); iterations 7-8 run untraced in the
# same process and every iteration is logged, so metrics-*-step-profile.jsonl shows what the profiler itself adds
PROFILE=(--torch-compile --train-iters 8 --log-interval 1 --profile --profile-step-start 4 --profile-step-end 6)
train_step 90 fp8-step-profile "${FP8_TW[@]}" "${PROFILE[@]}"
train_step 90 bf16-step-profile "${PROFILE[@]}"
train_step 90 fp8-tensorwise-compiled-graphs-step-profile "${FP8_TW[@]}" "${PROFILE[@]}" --cuda-graph-impl local

# context parallelism's hash dropout fused into the Triton flash block: masks and accuracy checked on the device,
# then fused vs the chunked reference vs the flash kernel without dropout (one ring block, s 4096, GQA 32/8)
need benchmarks/flash_hash_dropout.py
run_step flash-hash-dropout 90 bash -c "python3 benchmarks/flash_hash_dropout.py --backend cuda --check --causal \
  --rounds 10 --tiles dkdv=64x64w4s3,dq=64x64w4s3 --tiles dkdv=32x64w4s3 &&
  python3 benchmarks/flash_hash_dropout.py --backend cuda --rounds 10"

# ---- 4. multi-rank on one GPU ------------------------------------------------------------------
need benchmarks/device_multirank.py examples/moby_dick_tp2_pp2.yaml
run_step multirank 120 python3 benchmarks/device_multirank.py --jobs 6 --timeout 100 --out "$LOG_DIR/multirank.json"

# ---- 5. conformance ----------------------------------------------------------------------------
need tests/backends tests/kernels/test_conformance.py
pytest_step conformance 100 tests/backends tests/kernels/test_conformance.py -rfE

# the planted stream bugs on the device: how often do they corrupt results here? (sim catches them)
need benchmarks/planted_ground_truth.py
run_step planted 60 python3 benchmarks/planted_ground_truth.py --backend cuda --tries 3 --out "$LOG_DIR/planted.jsonl"

# ---- 6. the rest, as the budget allows ---------------------------------------------------------
train_step 45 fp8-delayed --fp8-format hybrid --fp8-recipe delayed
# golden loss curve: the fixed tiny GPT's 100 losses on cuda into golden/cuda.json (commit it as
# tests/golden/cuda.json); the log line says whether it matches the record already there
need omnitron/testing/golden.py
run_step golden 20 python3 -m omnitron.testing.golden cuda --out "$LOG_DIR/golden"
run_step bench-all 85 python3 -m omnitron bench all --backend cuda --out "$LOG_DIR/bench"

write_summary device_bench
