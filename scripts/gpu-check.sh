#!/usr/bin/env bash
# The GPU check, for a session that is lent a CUDA machine: one bounded run (< 8 minutes) whose output goes
# into docs/benchmarks.md. Exits non-zero when any step fails, and at once (status 2) without a CUDA device,
# so a run on the wrong machine is never mistaken for a pass. Needs torch with CUDA; the engine step also a
# vLLM CUDA build (0.32 or 0.33).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -z "${GPU_CHECK_BOUNDED:-}" ]; then
    GPU_CHECK_BOUNDED=1 exec timeout --kill-after=10 "${GPU_CHECK_TIMEOUT_S:-470}" "$0" "$@"
fi
OUT="${OUT:-/tmp/gpu-check}"
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu-check.log") 2>&1
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu-check: no CUDA device visible to python3's torch (or no torch); nothing was checked" >&2
    exit 2
fi
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
# Registered, not just importable: vLLM finds the plugin through its entry point in every process.
python3 -m pip install -q --no-deps --no-build-isolation -e . || { echo "gpu-check: cannot install the plugin" >&2; exit 2; }
failed=()
step() {  # run one bounded step; a failure is recorded and returned, the run goes on
    local name="$1"; shift
    echo "== $name"
    timeout "${STEP_TIMEOUT_S:-240}" "$@"
    local rc=$?
    [ "$rc" -eq 0 ] || failed+=("$name (exit $rc)")
    return "$rc"
}
step machine nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
step versions python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
step topology python3 -m vllm_expert_offload.cli topology
step "GPU tests: mapped arena, tables over PCIe, Triton and exllamav3 kernels, CUDA-graph replay" \
    python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/memory/test_arena.py tests/kernels/test_pointer_tables.py \
    tests/kernels/test_triton_gpu.py tests/kernels/test_exllamav3_gpu.py
# The exllamav3 backend needs exllamav3's prebuilt extension (building it takes nvcc and minutes, so it is never
# built here); without it its tests skip and its benchmark column is absent, and the last line says so.
exllamav3_note=$(python3 -c "
from vllm_expert_offload.kernels.exllamav3_backend import exllamav3_unavailable
import torch
why = exllamav3_unavailable(torch.device('cuda', 0))
print('' if why is None else f'; the exllamav3 backend was NOT checked: {why}')")
echo "== exllamav3 backend: ${exllamav3_note:-its extension imports, its tests and benchmark column run}"
limits=()
if [ -f ../shared/tools/gpu-limits/limits.py ]; then
    step "physical limits (pinned H2D copy, zero-copy reads by size, HBM)" \
        sh -c "python3 ../shared/tools/gpu-limits/limits.py --gib 1 > '$OUT/limits.json'" && limits=(--limits "$OUT/limits.json")
    cat "$OUT/limits.json" 2>/dev/null
else
    echo "== ../shared/tools/gpu-limits absent: kernel figures without rooflines"
fi
step "EXL3 kernels per backend beside their rooflines" \
    python3 benchmarks/bench_gpu_kernels.py --json "$OUT/gpu-check.json" "${limits[@]}"
if python3 -c "import vllm" 2>/dev/null; then
    STEP_TIMEOUT_S=300 step "tiny EXL3 MoE on the CUDA engine: V1/V2 runners, per backend, tokens vs HF" \
        python3 scripts/gpu_engine_check.py
    STEP_TIMEOUT_S=150 step "tiny mixed pack (EXL3 experts, block-FP8 attention delegated to vLLM's fp8) on the CUDA engine" \
        python3 scripts/gpu_engine_check.py --fp8-mixed
else
    echo "== no vLLM CUDA build importable: engine step not run"; failed+=("engine (no vLLM)")
fi
if [ "${#failed[@]}" -gt 0 ]; then
    echo "gpu-check: FAILED: ${failed[*]}"
    exit 1
fi
echo "gpu-check: all steps passed${exllamav3_note}"
