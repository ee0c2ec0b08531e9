#!/usr/bin/env bash
# One prepared check for a machine with an NVIDIA GPU (python3 with a CUDA torch, pytest; no
# network; the repository copied but not pip-installed). Finishes in under 6 minutes:
#   1. environment: GPU, torch/CUDA/NCCL/Triton versions, `omnitron info` on cuda
#   2. backend conformance suite on cuda + the CUDA GPU tests (tests/backends --backend cuda)
#   3. every other @pytest.mark.gpu test in the tree
#   4. hooks: kernel benchmark, FP8 GEMM benchmark, 1.3B training benchmark (filled in by the lead)
# Steps 1-3 are limited to 45 + 210 + 60 s (cold Triton compiles dominate step 2); each hook adds
# its own limit. Then it prints a short table. Logs go to $OUT when set (else /tmp/omnitron_device_check):
#   device_check.log (everything), summary.md (the table), junit-*.xml (per pytest step).
# usage: scripts/device_check.sh            (env: STEP_SCALE=2 doubles every step's time limit)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMNITRON_BACKEND=cuda
LOG_DIR=${OUT:-/tmp/omnitron_device_check}
mkdir -p "$LOG_DIR"
LOG="$LOG_DIR/device_check.log"
SUMMARY="$LOG_DIR/summary.md"
: >"$LOG"
SCALE=${STEP_SCALE:-1}
START=$(date +%s)
declare -a ROWS=()

# run_step NAME LIMIT_SECONDS CMD...: run with a time limit, log everything, record a table row.
run_step() {
  local name=$1 limit=$(( $2 * SCALE )) t0 rc
  shift 2
  echo "=== [$name] $* (limit ${limit}s)" | tee -a "$LOG"
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  local dt=$(( $(date +%s) - t0 )) status=ok
  [ "$rc" -ne 0 ] && status="FAILED (rc $rc)"
  [ "$rc" -eq 5 ] && status="ok (no tests selected)"  # pytest's exit code 5
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && status="TIMED OUT after ${limit}s"
  ROWS+=("| $name | $status | ${dt}s | $(pytest_counts "$name") |")
}

# pytest_counts NAME: "P passed, F failed, S skipped" from junit-NAME.xml, if the step wrote one.
pytest_counts() {
  local xml="$LOG_DIR/junit-$1.xml"
  [ -f "$xml" ] || { echo "-"; return; }
  python3 - "$xml" <<'PY'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
n = lambda k: sum(int(s.get(k, 0)) for s in suites)
failed = n("failures") + n("errors")
names = [c.get("name") for s in suites for c in s.iter("testcase")
         if c.find("failure") is not None or c.find("error") is not None]
print(f"{n('tests') - failed - n('skipped')} passed, {failed} failed, {n('skipped')} skipped"
      + (f": {', '.join(names[:6])}" if names else ""))
PY
}

pytest_step() {  # pytest_step NAME LIMIT ARGS...
  local name=$1 limit=$2
  shift 2
  run_step "$name" "$limit" python3 -m pytest -q -p no:cacheprovider --backend cuda \
    --junitxml="$LOG_DIR/junit-$name.xml" -o junit_family=xunit2 "$@"
}

# ---- 1. environment -------------------------------------------------------------------------
run_step environment 45 bash -c '
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
  python3 -c "import sys, torch; print(sys.version.split()[0], \"torch\", torch.__version__, \"cuda\", torch.version.cuda,
      \"nccl\", torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
  python3 -c "import triton; print(\"triton\", triton.__version__)" || echo "triton: not importable"
  python3 -m omnitron info'

# ---- 2. conformance suite on cuda (+ tests/backends/test_cuda_gpu.py) -----------------------
pytest_step conformance "${CONFORMANCE_LIMIT:-210}" tests/backends -rfE -s

# ---- 3. every other GPU-marked test ---------------------------------------------------------
pytest_step gpu-tests 60 tests -m gpu --ignore=tests/backends -rfE

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
{
  echo "## device_check $(date -u +%Y-%m-%dT%H:%MZ) on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
  echo
  echo "| step | status | time | tests |"
  echo "| --- | --- | --- | --- |"
  printf '%s\n' "${ROWS[@]}"
  echo
  echo "total $(( $(date +%s) - START ))s; full log: device_check.log"
} | tee "$SUMMARY"
grep -q "FAILED\|TIMED OUT" "$SUMMARY" && exit 1
exit 0
