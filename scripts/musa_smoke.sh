#!/usr/bin/env bash
# Smoke test for a machine with a real Moore Threads GPU (torch_musa installed with its own
# torch build; run from a checkout of this repository). Everything omnitron checks here against
# the MUSA *test double* is checked again on the real thing:
#   1. manifest: every torch_musa name the test double provides (omnitron/backends/musa/manifest.txt,
#      a superset of the names the backend calls)
#      exists in this torch_musa
#   2. `omnitron info` on musa: arch, FP8 gating, resolved kernel table
#   3. the backend conformance suite on musa: device API, streams/events, memory, RNG, FP8,
#      each "musa" kernel (torch.rms_norm, torch.rope, torch.swish_glu, flash SDPA) against its
#      reference forward and backward, and mccl collectives at 2 and 4 ranks (as devices allow)
#   4. a few training steps through the CLI, when `omnitron train` exists in this checkout
# Results printed here are MUSA results; the same suite on the double is labelled MUSA-double.
# usage: scripts/musa_smoke.sh          (logs in $OUT, default ./musa_smoke_logs)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMNITRON_BACKEND=musa
LOG_DIR=${OUT:-musa_smoke_logs}
mkdir -p "$LOG_DIR"
PY=${PYTHON:-python3}
declare -a ROWS=()

step() {  # step NAME CMD...: run, log, record pass/fail
  local name=$1 t0 rc
  shift
  echo "=== [$name] $*"
  t0=$(date +%s)
  "$@" 2>&1 | tee "$LOG_DIR/$name.log"
  rc=${PIPESTATUS[0]}
  ROWS+=("$(printf '%-14s %-8s %4ss' "$name" "$([ "$rc" -eq 0 ] && echo ok || echo "FAIL($rc)")" $(( $(date +%s) - t0 )))")
}

# ---- 1. manifest ----------------------------------------------------------------------------
step manifest "$PY" - <<'PY'
import pathlib, sys
import torch, torch.distributed as dist
import torch_musa  # noqa: F401  registers torch.musa, the musa device and mccl

names = [l.split("#", 1)[0].strip() for l in pathlib.Path("omnitron/backends/musa/manifest.txt").read_text().splitlines()]
missing = []
for name in filter(None, names):
    if name.startswith("process_group:"):
        ok = name.split(":", 1)[1] in dist.Backend.backend_list
    else:
        head, *rest = name.split(".")
        obj, ok = {"torch": torch, "torch_musa": torch_musa}[head], True
        for part in rest:
            if not hasattr(obj, part):
                ok = False
                break
            obj = getattr(obj, part)
    print(f"  {'ok     ' if ok else 'MISSING'} {name}")
    missing += [] if ok else [name]
print(f"torch {torch.__version__}, torch_musa {getattr(torch_musa, '__version__', '?')}: "
      f"{len(missing)} of {len([n for n in names if n])} manifest names missing")
sys.exit(1 if missing else 0)
PY

# ---- 2. info --------------------------------------------------------------------------------
step info "$PY" -m omnitron info

# ---- 3. conformance suite on musa -----------------------------------------------------------
step conformance "$PY" -m pytest -q -p no:cacheprovider tests/backends --backend musa -rfEs

# ---- 4. a few training steps (guarded: the train command may not exist in this checkout); saved under the
#      logs, not the config's runs/moby_dick_tp2_pp2, where `latest` and keep-last-n would replace the main job's
#      checkpoints ----
if "$PY" -m omnitron train --help >/dev/null 2>&1; then
  NDEV=$("$PY" -c "import torch, torch_musa; print(min(2, torch.musa.device_count()))" || echo 1)
  step train "$PY" -m omnitron train --config examples/moby_dick_tp2_pp2.yaml --backend musa \
    --nproc-per-node "$NDEV" --tensor-model-parallel-size "$NDEV" --pipeline-model-parallel-size 1 \
    --train-iters 5 --lr-warmup-iters 1 --log-interval 1 --eval-interval 1000 --save "$LOG_DIR/train_ckpt"
else
  ROWS+=("$(printf '%-14s %-8s' train 'skipped (no `omnitron train` in this checkout)')")
fi

echo
echo "MUSA smoke summary ($(date -u +%Y-%m-%dT%H:%MZ)); logs in $LOG_DIR/"
printf '  %s\n' "${ROWS[@]}"
printf '%s\n' "${ROWS[@]}" | grep -q FAIL && exit 1
exit 0
