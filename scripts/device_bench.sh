#!/usr/bin/env bash
# One call on a GPU machine: scripts/device_check.sh plus `omnitron bench all`, the FP8 and 1.3B training
# benchmarks (bf16, then FP8 hybrid/tensorwise through the real training loop), then the MoE layer benchmark.
# ~9.5 minutes on an H200 before `bench all` replaced the kernel benchmark (2026-12-01; not yet run on a GPU since).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/omnitron_device_check}
mkdir -p "$OUT"
export CONFORMANCE_LIMIT=${CONFORMANCE_LIMIT:-150}
# the cross-hardware suite (memory, GEMM per dtype incl. FP8, collectives, kernels, attention, the 1.3B step),
# one omnitron-bench JSON report per kind, compared with `omnitron bench compare DIR_A DIR_B`
export KERNEL_BENCH_CMD="python3 -m omnitron bench all --backend cuda --out $OUT/bench"
export KERNEL_BENCH_LIMIT=${KERNEL_BENCH_LIMIT:-240}
export FP8_BENCH_CMD="python3 benchmarks/fp8_profile.py --json $OUT/fp8_profile.json; python3 benchmarks/fp8_gemm.py --step-layers 4 --json $OUT/fp8_gemm.json"
export FP8_BENCH_LIMIT=150
train() {  # train LOGDIR EXTRA_FLAGS...
  local dir=$1; shift
  python3 -m omnitron train --config examples/gpt_1p3b_bench.yaml --train-iters 15 --log-dir "/tmp/$dir" "$@" \
    && cp "/tmp/$dir/metrics.jsonl" "$OUT/metrics-$dir.jsonl"
}
export -f train
export OUT
export TRAIN_BENCH_CMD="train bf16; train fp8 --fp8-format hybrid --fp8-recipe tensorwise"
export TRAIN_BENCH_LIMIT=${TRAIN_BENCH_LIMIT:-240}
bash scripts/device_check.sh
rc=$?
# MoE layer vs dense MLP (benchmarks/moe.py: ep=1, one GPU, bf16; ~30 s). $OUT already holds 8 files, so no
# new one: the table is appended to device_check.log and one line to summary.md.
t0=$(date +%s)
OMNITRON_BACKEND=cuda PYTHONUNBUFFERED=1 timeout --kill-after=10 "${MOE_BENCH_LIMIT:-60}" \
  python3 benchmarks/moe.py --ep 1 --size large 2>&1 | tee -a "$OUT/device_check.log"
moe_rc=${PIPESTATUS[0]}
echo "moe-bench: $([ "$moe_rc" -eq 0 ] && echo ok || echo "FAILED (rc $moe_rc)") in $(( $(date +%s) - t0 ))s (table in device_check.log)" \
  | tee -a "$OUT/summary.md"
[ "$rc" -ne 0 ] && exit "$rc"
exit "$moe_rc"
