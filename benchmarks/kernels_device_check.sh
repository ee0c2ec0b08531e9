#!/usr/bin/env bash
# GPU check of the fused kernels (about 3-5 minutes on an H100/H200): the conformance suite on the
# device backend (Triton kernels compiled natively, the table's choices, the references), then the
# kernel benchmark at GPU sizes with the device copy bandwidth measured in the same run.
#   bash benchmarks/kernels_device_check.sh [cuda|musa] [OUT_DIR]
set -euo pipefail
BACKEND=${1:-cuda}
OUT=${2:-${OUT:-.}}
cd "$(dirname "$0")/.."
python -m pytest -q -p no:cacheprovider tests/kernels --backend "$BACKEND" -x 2>&1 | tail -25 | tee "$OUT/kernels-conformance-$BACKEND.txt"
python benchmarks/kernels.py --backend "$BACKEND" --size large --rounds 30 --json "$OUT/kernels-$BACKEND.json" \
  | tee "$OUT/kernels-bench-$BACKEND.md"
