#!/usr/bin/env bash
# CI on the oldest supported torch (the low end of omnitron/backends/torch_range.py TESTED), after the
# README's suite on the newest: a fresh venv with the CPU build of torch (scripts/torch_venv.sh), omnitron built in
# it, a quick subset (backend conformance on cpu and sim, tp/pp/dp parity on cpu and sim, the golden loss
# curves, FP8 GEMMs and FP8 MoE, compiled gradients through autograd Functions (torch 2.11's zeroed ones), a
# checkpoint round trip through a bit-exact resume, the MUSA double, the
# version checks, gloo's threads freed at destroy (unnamed on 2.9), a compiled MoE's graph count (2.9's dynamo
# recompiled it per call), omnitron's activation checkpoint (2.9's custom function context lost its saved inputs
# with its output)) and the README's main job for 20 iterations.
#
# Its pytest output goes to a log, not to CI's output: CI reads the suite's result from pytest's closing
# line, so this script prints its own summary lines, worded so that none of them reads as one.
# Measured on the 2-core machine (2026-12-03): see README's testing section.
#
# usage: scripts/ci_oldest_torch.sh           run it (exit status 1 when anything fails)
#        scripts/ci_oldest_torch.sh --tests   print the subset's pytest arguments (for scripts/torch_matrix.sh)
# env:   OLDEST_TORCH (default 2.9.1), OLDEST_TORCH_DIR (default ${TMPDIR:-/tmp}/omnitron-oldest-torch),
#        OLDEST_TORCH_INDEX (default PyTorch's CPU index; empty: PyPI), OLDEST_TRITON (default 3.5.1, 2.9.1's pin)
set -uo pipefail
cd "$(dirname "$0")/.."
TESTS=(
  tests/backends/test_backend_device.py tests/backends/test_backend_collectives.py tests/backends/test_backend_kernels.py
  tests/backends/test_torch_range.py tests/backends/test_musa_double_training.py tests/sim
  tests/parallel/test_parity_3d.py::test_parity_pipeline_2 tests/parallel/test_parity_3d.py::test_parity_3d_4
  tests/parallel/test_parity_3d.py::test_parity_pipeline_2_on_sim
  tests/parallel/test_tensor_parity.py::test_tensor_parallel_parity_tp2
  "tests/parallel/test_data_parallel.py::test_ddp_buckets_overlap_and_reduction_match_reference[cpu]"
  "tests/parallel/test_data_parallel.py::test_ddp_buckets_overlap_and_reduction_match_reference[sim]"
  tests/fp8/test_gemm.py tests/parallel/test_expert_fp8.py "tests/training/test_resume.py::test_resume_bit_exact[2-2]"
  tests/golden tests/training/test_compiled_function_outputs.py tests/parallel/test_groups_freed_at_destroy.py
  tests/training/test_torch_compile.py::test_compiled_moe_with_a_load_balancing_loss_under_fp16_keeps_its_graphs
  tests/parallel/test_recompute.py
)
if [ "${1:-}" = "--tests" ]; then
  printf '%q ' "${TESTS[@]}"; echo
  exit 0
fi
version=${OLDEST_TORCH:-2.9.1}
dir=${OLDEST_TORCH_DIR:-${TMPDIR:-/tmp}/omnitron-oldest-torch}
venv="$dir/venv" tree="$dir/tree" log="$dir/oldest_torch.log"
mkdir -p "$dir"
: >"$log"
minutes() { awk -v s=$(( $(date +%s) - $1 )) 'BEGIN {printf "%.1f min", s / 60}'; }
# show: the log's tail without pytest's closing line (a failure is reported by this script's own line)
show() { grep -vE '^(=+ )?[0-9]+ (passed|failed|errors?|skipped|deselected)' "$log" | tail -n "$1"; }
t0=$(date +%s)
echo "oldest supported torch: installing torch $version and building omnitron in $dir"
# PyTorch's CPU index first (~0.2 GB: no CUDA build, no nvidia-* wheels), with the Triton PyPI's wheel of that
# torch pins; where that index cannot be reached, PyPI's CUDA wheel in its slimmest importable install.
# OLDEST_TORCH_INDEX= (empty) goes to PyPI directly.
index=${OLDEST_TORCH_INDEX-https://download.pytorch.org/whl/cpu}
rc=2
if [ -n "$index" ]; then
  TORCH_INDEX_URL=$index TORCH_LOCAL=+cpu TRITON_VERSION=${OLDEST_TRITON:-3.5.1} \
    scripts/torch_venv.sh "$version" "$venv" "$tree" >>"$log" 2>&1
  rc=$?
  [ $rc -eq 2 ] && echo "oldest supported torch: $index not usable; installing PyPI's wheel instead"
fi
if [ $rc -eq 2 ]; then
  scripts/torch_venv.sh "$version" "$venv" "$tree" >>"$log" 2>&1
  rc=$?
fi
if [ $rc -ne 0 ]; then
  [ $rc -eq 3 ] && cat "$tree/build.log" >>"$log"
  show 60
  echo "oldest supported torch $version: FAILED to $([ $rc -eq 3 ] && echo build omnitron || echo install torch) ($(minutes $t0))"
  exit 1
fi
torch=$("$venv/bin/python" -c "import torch; print(torch.__version__)")
echo "oldest supported torch $torch: installed and built ($(minutes $t0))"
t1=$(date +%s)
(cd "$tree" && PYTHONPATH="$tree" timeout 2400 "$venv/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}") >>"$log" 2>&1
rc=$?
counts=$(grep -E '^(=+ )?[0-9]+ (passed|failed)' "$log" | tail -1 | grep -oE '[0-9]+ (passed|failed|errors?|skipped)' \
         | sed 's/passed/ok/; s/failed/failing/' | paste -sd, - | sed 's/,/, /g')
if [ $rc -ne 0 ]; then
  show 80
  echo "oldest supported torch $torch: subset FAILED, exit $rc (${counts:-no counts}; $(minutes $t1))"
  exit 1
fi
echo "oldest supported torch $torch: subset ok ($counts; $(minutes $t1))"
t2=$(date +%s)
(cd "$tree" && PYTHONPATH="$tree" timeout 900 "$venv/bin/omnitron" train --config examples/moby_dick_tp2_pp2.yaml \
  --train-iters 20 --lr-warmup-iters 2 --log-interval 10 --eval-interval 20 --eval-iters 2 --save "$dir/main_job" \
  --sample-tokens 8 --no-tensorboard) >>"$log" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  show 60
  echo "oldest supported torch $torch: main job FAILED, exit $rc ($(minutes $t2))"
  exit 1
fi
echo "oldest supported torch $torch: main job ok, 20 iterations ($(minutes $t2)); all steps $(minutes $t0)"
