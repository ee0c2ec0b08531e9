#!/usr/bin/env bash
# One prepared check for a machine with an NVIDIA GPU (python3 with a CUDA torch, pytest; no
# network; the repository copied but not pip-installed). Finishes in under 8 minutes:
#   1. environment: GPU, torch/CUDA/NCCL/Triton versions, `omnitron info` on cuda
#   2. backend conformance suite on cuda + the CUDA GPU tests (tests/backends --backend cuda)
#   3. every other @pytest.mark.gpu test in the tree
#   4. the sim model's planted bugs on this GPU (benchmarks/planted_ground_truth.py): what NCCL and the CUDA
#      caching allocator really do with each (ground truth that sim catches what a GPU would); the two-rank
#      cases are written as skipped on a one-GPU machine (NCCL takes one GPU per rank)
#   5. hooks: kernel benchmark, FP8 GEMM benchmark, 1.3B training benchmark (filled in by the lead)
# Steps 1-4 are limited to 45 + 210 + 60 + 150 s (cold Triton compiles dominate step 2); each hook adds
# its own limit. Then it prints a short table. Logs go to $OUT when set (else /tmp/omnitron_device_check):
#   device_check.log (everything), summary.md (the table), junit-*.xml (per pytest step), planted.jsonl.
# usage: scripts/device_check.sh            (env: STEP_SCALE=2 doubles every step's time limit;
#                                            DRY_RUN=1 prints the steps and runs nothing)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMNITRON_BACKEND=cuda
LOG_DIR=${OUT:-/tmp/omnitron_device_check}
mkdir -p "$LOG_DIR"
: >"$LOG_DIR/device_check.log"
# shellcheck source=lib/steps.sh
source scripts/lib/steps.sh

# ---- 1. environment -------------------------------------------------------------------------
env_step 45

# ---- 2. conformance suite on cuda (+ tests/backends/test_cuda_gpu.py) -----------------------
pytest_step conformance "${CONFORMANCE_LIMIT:-210}" tests/backends -rfE -s

# ---- 3. every other GPU-marked test ---------------------------------------------------------
pytest_step gpu-tests 60 tests -m gpu --ignore=tests/backends -rfE

# ---- 4. planted bugs on the GPU: ground truth for the sim model ----------------------------
run_step planted-ground-truth "${PLANTED_LIMIT:-150}" python3 benchmarks/planted_ground_truth.py --backend cuda \
  --out "$LOG_DIR/planted.jsonl"

# ==== HOOK: kernel benchmark ==================================================================
# Fused kernels (Triton / reference) vs torch eager on this GPU. Set KERNEL_BENCH_CMD, or edit:
#   KERNEL_BENCH_CMD="python3 benchmarks/kernels.py --backend cuda"
if [ -n "${KERNEL_BENCH_CMD:-}" ]; then run_step kernel-bench "${KERNEL_BENCH_LIMIT:-60}" bash -c "$KERNEL_BENCH_CMD"; fi
# ==== END HOOK: kernel benchmark ==============================================================

# ==== HOOK: FP8 GEMM benchmark ================================================================
# FP8 scaled GEMM (backend.fp8.scaled_mm) vs bf16 GEMM TFLOP/s. Set FP8_BENCH_CMD, or edit:
#   FP8_BENCH_CMD="python3 benchmarks/fp8_gemm.py --backend cuda"
if [ -n "${FP8_BENCH_CMD:-}" ]; then run_step fp8-gemm-bench "${FP8_BENCH_LIMIT:-45}" bash -c "$FP8_BENCH_CMD"; fi
# ==== END HOOK: FP8 GEMM benchmark ============================================================

# ==== HOOK: 1.3B training benchmark ===========================================================
# A few steps of the 1.3B GPT on one GPU: tokens/s, MFU against capabilities().peak("bf16").
#   TRAIN_BENCH_CMD="python3 -m omnitron train ... --train-iters 20"
if [ -n "${TRAIN_BENCH_CMD:-}" ]; then run_step train-1.3b "${TRAIN_BENCH_LIMIT:-120}" bash -c "$TRAIN_BENCH_CMD"; fi
# ==== END HOOK: 1.3B training benchmark =======================================================

# ---- table ----------------------------------------------------------------------------------
write_summary device_check
