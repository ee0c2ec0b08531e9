#!/usr/bin/env bash
# A fresh venv with PyPI's torch VERSION and omnitron built in it from a copy of this working tree.
#
# PyPI's x86-64 torch wheels are CUDA builds whose requirements pull ~3 GB of nvidia-* wheels. The
# cheapest install that still imports on a CPU machine: the torch wheel without its requirements, its
# Python requirements (Triton included: the kernels are tested on the Triton each torch pins), and
# the nvidia-* wheels except those torch only dlopens on first use: cuSOLVER (linalg), NVRTC (jit) and
# NVTX (profiling ranges); libtorch_cuda.so links every other one (checked with readelf -d on 2.9.1).
# If that torch does not import, the skipped wheels are installed too. Set TORCH_INDEX_URL to take torch
# from another index instead (PyTorch's CPU index: ~0.2 GB, no nvidia-* wheels; with TORCH_LOCAL=+cpu and
# TRITON_VERSION, what scripts/ci_oldest_torch.sh tries first).
#
# usage: scripts/torch_venv.sh VERSION VENV_DIR TREE_DIR    (TREE_DIR: where the copy is built; env PYTHON)
# Exit status: 2 torch install failed, 3 omnitron build failed (log: TREE_DIR/build.log).
set -euo pipefail
version=$1 venv=$2 tree=$3
src="$(cd "$(dirname "$0")/.." && pwd)"
rm -rf "$venv" "$tree"
"${PYTHON:-python}" -m venv "$venv"   # PYTHON: the interpreter to base it on
py="$venv/bin/python"
pip() { "$py" -m pip -q "$@"; }
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  # TORCH_LOCAL: the index's local version label (PyTorch's CPU index: +cpu, which also keeps a mirror's CUDA build
  # of the same version from being picked); a short timeout, so an unreachable index fails fast
  pip install --timeout 30 --retries 1 "torch==$version${TORCH_LOCAL:-}" --index-url "$TORCH_INDEX_URL" || exit 2
  # the Triton the PyPI wheel of this torch pins (its kernels are tested on it under the interpreter); CPU wheels
  # do not require one
  [ -z "${TRITON_VERSION:-}" ] || pip install "triton==$TRITON_VERSION" || exit 2
else
  pip install --no-deps "torch==$version" || exit 2
  # torch's requirements here: "py REQ" (Python; cuda-toolkit[...] without the lazy extras), "nv REQ" (nvidia-*), "lazy REQ"
  reqs=$("$py" - <<'PY'
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement

LAZY = ("cusolver", "nvrtc", "nvtx")
for line in requires("torch") or []:
    r = Requirement(line)
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    lazy = [e for e in sorted(r.extras) if e in LAZY]
    if r.extras:  # torch >= 2.11: cuda-toolkit[cublas,cudart,...], a meta package whose extras are the libraries
        print("py", f"{r.name}[{','.join(e for e in sorted(r.extras) if e not in LAZY)}]{r.specifier}")
        if lazy:
            print("lazy", f"{r.name}[{','.join(lazy)}]{r.specifier}")
    elif r.name.startswith("nvidia-"):
        print("lazy" if any(k in r.name for k in LAZY) else "nv", f"{r.name}{r.specifier}")
    else:
        print("py", f"{r.name}{r.specifier}")
PY
)
  install() { [ -z "$2" ] || (set -f; pip install $1 $2); }   # OPTIONS "REQUIREMENTS" (none: nothing to do)
  install "" "$(awk '$1 == "py" {print $2}' <<<"$reqs")" || exit 2
  install --no-deps "$(awk '$1 == "nv" {print $2}' <<<"$reqs")" || exit 2
  if ! "$py" -c "import torch" 2>/dev/null; then
    echo "torch $version does not import without its lazily loaded CUDA libraries; installing them" >&2
    install "" "$(awk '$1 == "lazy" {print $2}' <<<"$reqs")" || exit 2
  fi
fi
"$py" -c "import torch" || exit 2
pip install numpy pyyaml "tokenizers>=0.15" safetensors tqdm pytest regex pybind11 setuptools wheel || exit 2
mkdir -p "$tree"
(cd "$src" && git ls-files -co --exclude-standard | while read -r f; do [ -f "$f" ] && echo "$f"; done \
  | tar -c --no-recursion -T - -f -) | tar -x -C "$tree"
rm -f "$tree"/omnitron/_C*.so "$tree"/omnitron/_sim*.so   # built for another torch
(cd "$tree" && MAX_JOBS="${MAX_JOBS:-2}" "$py" -m pip install --no-deps --no-build-isolation -e . >build.log 2>&1) || exit 3
