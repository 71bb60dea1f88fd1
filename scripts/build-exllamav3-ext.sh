#!/usr/bin/env bash
# Build the trimmed exllamav3_ext the GPU check carries (.gpucheck/exllamav3_ext/, ignored): exllamav3 1.6.5's CUDA
# sources fetched with pip into .cache/exllamav3-build/, compiled here with nvcc for sm_90 against torch 2.11.0+cu130.
# Niced and few jobs: nvcc on the project's 2 shared cores takes a while (docs/development.md gives the time).
# Arguments go to scripts/build-exllamav3-ext.py (--arch 90,120, --moe-k, --gemm-k, --codebook, --jobs).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
[ -x "$python" ] || python=python3
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec nice -n 15 "$python" scripts/build-exllamav3-ext.py "$@"
