#!/usr/bin/env bash
# The torch version matrix: for each version, a fresh venv with PyPI's wheel (scripts/torch_venv.sh: the
# cheapest install that imports on a CPU machine), omnitron built in it, and the suite or a subset of it.
# Prints one row per version as it finishes, then the whole table (markdown, for README's testing section).
#
# usage: scripts/torch_matrix.sh [VERSION ...]        default: 2.9.1 2.10.0 2.11.0 2.12.0 2.13.0 2.14.1 2.15.0
# env:   MATRIX_TESTS  pytest arguments (default: -m "not slow", the suite; scripts/ci_oldest_torch.sh's
#                      subset is "$(scripts/ci_oldest_torch.sh --tests)")
#        MATRIX_LABEL  what the tests column calls MATRIX_TESTS (default: "suite" or "subset")
#        MATRIX_DIR    where the venvs, built trees and logs go (default: /tmp/omnitron-matrix)
# A version whose torch does not install, whose build fails or whose tests fail makes the exit status 1.
set -uo pipefail
cd "$(dirname "$0")/.."
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(2.9.1 2.10.0 2.11.0 2.12.0 2.13.0 2.14.1 2.15.0)
dir=${MATRIX_DIR:-/tmp/omnitron-matrix}
tests=${MATRIX_TESTS:-'-m "not slow"'}
mkdir -p "$dir"
rows=() status=0
label=${MATRIX_LABEL:-$([ -n "${MATRIX_TESTS:-}" ] && echo subset || echo suite)}
header="| torch | build | $label ($(date -u +%F)) | minutes |"
echo "$header"
echo "|---|---|---|---|"
for v in "${versions[@]}"; do
  t0=$(date +%s) venv="$dir/venv-$v" tree="$dir/tree-$v" log="$dir/tests-$v.log"
  scripts/torch_venv.sh "$v" "$venv" "$tree" >"$dir/install-$v.log" 2>&1
  rc=$?
  built="ok ($(( ($(date +%s) - t0 + 30) / 60 )) min)"
  [ $rc -eq 2 ] && built="torch does not install (see $dir/install-$v.log)"
  [ $rc -eq 3 ] && built="**fails** (see $tree/build.log)"
  [ $rc -ne 0 ] && [ $rc -ne 2 ] && [ $rc -ne 3 ] && built="setup failed ($rc, see $dir/install-$v.log)"
  result="not run" torch=$v
  if [ $rc -eq 0 ]; then
    torch=$("$venv/bin/python" -c "import torch; print(torch.__version__)")
    (cd "$tree" && PATH="$venv/bin:$PATH" PYTHONPATH="$tree" eval "timeout 5400 python -m pytest -q -p no:cacheprovider $tests") >"$log" 2>&1
    trc=$?
    # the counts of pytest's closing line, written so this row is not itself read as one
    last=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error)' "$log" | tail -1)
    n() { grep -oE "[0-9]+ $1" <<<"$last" | grep -oE '^[0-9]+' || echo 0; }
    result="$(n passed) ok, $(n failed) failing, $(n error) errors, $(n skipped) skipped"
    [ $trc -eq 0 ] || { result="**$result** (exit $trc, $log)"; status=1; }
  else
    status=1
  fi
  row="| $torch | $built | $result | $(( ($(date +%s) - t0 + 30) / 60 )) |"
  echo "$row"
  rows+=("$row")
done
echo
echo "$header"
echo "|---|---|---|---|"
printf '%s\n' "${rows[@]}"
exit $status
