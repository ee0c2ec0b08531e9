#!/usr/bin/env bash
# The one prepared run for a lent GPU (one H200, fifteen minutes of device time in all): everything the CPU
# stand-ins claim, measured on the device, in under 9 minutes (the step limits add up to 540 s; the test
# tests/test_device_scripts.py holds them to it). Results land in benchmarks/results/<gpu>-<date>/ (or $OUT):
# device_check.log (everything), summary.md (one row per step), junit-*.xml, metrics-*.jsonl, bench/*.json.
#   1. environment, `omnitron info`, the cuda conformance suite (every kernel against its float64 reference),
#      the golden loss curve (omnitron/testing/golden.py: 100 steps of a tiny GPT, recorded as golden/cuda.json)
#   2. multi-rank on one GPU: benchmarks/device_multirank.py (4 processes on the one device over host-staged
#      gloo, losses against the CPU run of the same layout; world-1 layouts on NCCL)
#   3. the planted stream/collective bugs that `sim` catches (tests marked `planted`): today those cases are
#      written for sim and cpu only and skip here; CUDA + NCCL variants (issue 31's ground truth) are to come
#   4. the 1.3B GPT: bf16 and FP8 (tensorwise, delayed) eager, bf16 and tensorwise FP8 with --torch-compile;
#      15 iterations each, metrics-*.jsonl kept for the loss curves and tokens/s
#   5. one FP8 step profiled (benchmarks/fp8_profile.py) and the FP8 linear table (benchmarks/fp8_gemm.py)
#   6. `omnitron bench all` (the report `omnitron plan --bench` and `bench compare` read)
# usage: scripts/device_bench.sh              on the GPU machine (python3 with a CUDA torch, pytest)
#        DRY_RUN=1 scripts/device_bench.sh    anywhere: print every step and its limit, check every file a
#                                             step uses exists, run nothing
#        STEP_SCALE=2 ...                     doubles every limit (a slower GPU)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMNITRON_BACKEND=cuda
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr 'A-Z ' 'a-z-' | sed 's/^nvidia-//')
LOG_DIR=${OUT:-benchmarks/results/${gpu:-nogpu}-$(date -u +%F)}
mkdir -p "$LOG_DIR"
: >"$LOG_DIR/device_check.log"
# shellcheck source=lib/steps.sh
source scripts/lib/steps.sh
export LOG_DIR

# ---- 1. environment and conformance ----------------------------------------------------------
env_step 30
need tests/backends tests/kernels/test_conformance.py
pytest_step conformance 100 tests/backends tests/kernels/test_conformance.py -rfE -x

# golden loss curve: the fixed tiny GPT's 100 losses on cuda into golden/cuda.json (commit it as
# tests/golden/cuda.json); the log line says whether it matches the record already there
need omnitron/testing/golden.py
run_step golden 20 python3 -m omnitron.testing.golden cuda --out "$LOG_DIR/golden"

# ---- 2. multi-rank on one GPU ------------------------------------------------------------------
need benchmarks/device_multirank.py examples/moby_dick_tp2_pp2.yaml
run_step multirank 60 python3 benchmarks/device_multirank.py --out "$LOG_DIR/multirank.json"

# ---- 3. planted bugs: does the GPU show what sim catches? --------------------------------------
need tests/sim
pytest_step planted 30 tests/sim -m planted -rfE

# ---- 4. the 1.3B GPT: bf16 and FP8, eager and compiled -----------------------------------------
need examples/gpt_1p3b_bench.yaml
train() {  # train NAME EXTRA_FLAGS...: 15 iterations, metrics kept as metrics-NAME.jsonl
  local name=$1; shift
  python3 -m omnitron train --config examples/gpt_1p3b_bench.yaml --train-iters 15 --log-interval 5 \
    --log-dir "/tmp/omnitron-$name" "$@" && cp "/tmp/omnitron-$name/metrics.jsonl" "$LOG_DIR/metrics-$name.jsonl"
}
export -f train
# (blockwise FP8 is in step 5's per-recipe table, not trained here: the compiled runs need the time)
runs="train bf16; train fp8-tensorwise --fp8-format hybrid --fp8-recipe tensorwise;
  train fp8-delayed --fp8-format hybrid --fp8-recipe delayed"
compiled="train bf16-compiled --torch-compile; train fp8-tensorwise-compiled --fp8-format hybrid --fp8-recipe tensorwise --torch-compile"
# the compiled runs only where this checkout has the flag (issue 33); the summary says which ran
if grep -rqs -- "--torch-compile" omnitron/core; then runs="$runs; $compiled"; fi
run_step train-1.3b 170 bash -c "$runs"

# ---- 5. one FP8 step profiled, the FP8 linear table --------------------------------------------
need benchmarks/fp8_profile.py benchmarks/fp8_gemm.py
run_step fp8-profile 45 bash -c "python3 benchmarks/fp8_profile.py --json $LOG_DIR/fp8_profile.json &&
  python3 benchmarks/fp8_gemm.py --step-layers 4 --json $LOG_DIR/fp8_gemm.json"

# ---- 6. the cross-hardware suite ----------------------------------------------------------------
run_step bench-all 85 python3 -m omnitron bench all --backend cuda --out "$LOG_DIR/bench"

write_summary device_bench
