# Shared by scripts/device_check.sh and scripts/device_bench.sh: run named steps under time limits, log
# everything, collect a markdown table. Source it after setting LOG_DIR; then call run_step / pytest_step
# and finally write_summary TITLE.
# DRY_RUN=1: each step prints its command and limit and runs nothing (the row says "dry run"), so a machine
# without a GPU can check the script's plan; `need PATH...` still checks that each file a step uses exists.
# BUDGET_S=N: the whole run's wall-clock budget. A step gets min(its limit, what is left); a step that would
# start with under BUDGET_MIN_STEP_S (default 15) seconds left is skipped (its row says so), so a script whose limits add up to more than the
# lease allows still ends in time, having run its steps in the order written (most important first).
# ONLY=name,name: run just those steps (a rerun of the ones that failed); the others get no row.
LOG="$LOG_DIR/device_check.log"
SUMMARY="$LOG_DIR/summary.md"
SCALE=${STEP_SCALE:-1}
START=$(date +%s)
BUDGET=${BUDGET_S:-0}
LIMIT_TOTAL=0
MISSING=0
declare -a ROWS=()

# need PATH...: fail the plan (counted in MISSING, reported in the summary) when a file a step uses is absent.
need() {
  local p
  for p in "$@"; do
    [ -e "$p" ] || { echo "MISSING: $p" | tee -a "$LOG"; MISSING=$((MISSING + 1)); }
  done
}

# run_step NAME LIMIT_SECONDS CMD...: run with a time limit, log everything, record a table row.
run_step() {
  local name=$1 limit=$(( $2 * SCALE )) t0 rc
  shift 2
  LIMIT_TOTAL=$((LIMIT_TOTAL + limit))
  if [ -n "${ONLY:-}" ] && [[ ",$ONLY," != *",$name,"* ]]; then
    return 0
  fi
  if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "=== [$name] $* (limit ${limit}s)" | tee -a "$LOG"
    ROWS+=("| $name | dry run | limit ${limit}s | - |")
    return 0
  fi
  if [ "$BUDGET" -gt 0 ]; then
    local left=$(( BUDGET - ($(date +%s) - START) ))
    if [ "$left" -lt "${BUDGET_MIN_STEP_S:-15}" ]; then
      echo "=== [$name] skipped: ${left}s of the ${BUDGET}s budget left" | tee -a "$LOG"
      ROWS+=("| $name | skipped (budget) | - | - |")
      return 0
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
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

# pytest_step NAME LIMIT ARGS...: pytest on the cuda backend, a junit file per step. With pytest-xdist
# installed the tests spread over PYTEST_WORKERS processes (default 4; 0 = one process): a cold Triton
# cache makes the conformance suite compile-bound on the host, and the GPU has room for four of them.
pytest_step() {
  local name=$1 limit=$2 workers=()
  shift 2
  if [ "${PYTEST_WORKERS:-4}" -gt 0 ] && python3 -c "import xdist" 2>/dev/null; then
    workers=(-n "${PYTEST_WORKERS:-4}")
  fi
  run_step "$name" "$limit" python3 -m pytest -q -p no:cacheprovider --backend cuda "${workers[@]}" \
    --junitxml="$LOG_DIR/junit-$name.xml" -o junit_family=xunit2 "$@"
}

# write_summary TITLE: the table (also to summary.md); exit status 1 when a step failed or a file is missing.
write_summary() {
  {
    echo "## $1 $(date -u +%Y-%m-%dT%H:%MZ) on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
    echo
    echo "| step | status | time | tests |"
    echo "| --- | --- | --- | --- |"
    printf '%s\n' "${ROWS[@]}"
    echo
    echo "total $(( $(date +%s) - START ))s (limits add up to ${LIMIT_TOTAL}s); missing files: $MISSING; full log: device_check.log"
  } | tee "$SUMMARY"
  [ "$MISSING" -eq 0 ] || return 1
  ! grep -q "FAILED\|TIMED OUT" "$SUMMARY"
}

# env_step LIMIT: the GPU, torch / CUDA / NCCL / Triton versions and `omnitron info`.
env_step() {
  run_step environment "$1" bash -c '
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
    python3 -c "import sys, torch; print(sys.version.split()[0], \"torch\", torch.__version__, \"cuda\", torch.version.cuda,
        \"nccl\", torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
    python3 -c "import triton; print(\"triton\", triton.__version__)" || echo "triton: not importable"
    python3 -m omnitron info'
}
