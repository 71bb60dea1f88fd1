#!/usr/bin/env bash
# The GPU check: one bounded run on a lent CUDA machine (the H200 of docs/development.md, "The GPU check"), whose
# results go into docs/benchmarks.md. Needs only the checkout, python3 with torch (CUDA), Triton, numpy, safetensors
# and pytest; the trimmed exllamav3 extension (scripts/build-exllamav3-ext.sh, carried as .gpucheck/) when present;
# vLLM only for the engine steps, which are skipped without it.
#
#   scripts/gpu-check.sh [--dry-run] [RESULTS_DIR]        RESULTS_DIR defaults to $OUT, else /tmp/gpu-check
#
# Each step runs under its own time budget, derived from the compile census (vllm_expert_offload/tools/
# gpu_check_budget.py: the step's own seconds plus the Triton variants it compiles, each at its measured compile
# time, printed with its source before the first step), all inside GPU_CHECK_TOTAL_S (470 s). A step whose budget
# does not fit the time left is not started (a step killed mid-compile measures nothing) and fails the run. A dry
# run's stubs compile nothing: its steps are bound by their own seconds, 4 times each. Every step's result is appended to RESULTS_DIR/gpu-check.jsonl as
# soon as it ends (with the tail of its output when it fails), the probe's and the benchmark's rows to probe.jsonl and
# bench.jsonl as they are measured, everything printed to gpu-check.log. Exit status: 0 when every step that could run
# passed (the engine steps are skipped without vLLM), 1 when one failed or was not reached, 2 at once without a CUDA
# device (a run on the wrong machine is never a pass). --dry-run walks the same steps on a machine without CUDA, each
# CUDA part stubbed (GPU tests collected, not run; probe and benchmark at tiny sizes in Triton's interpreter): the
# plumbing, as tests/tools/test_gpu_check.py runs it.
set -uo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"  # absolute: the bounded re-exec below runs after the cd
cd "$(dirname "$SELF")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
# A dry run runs Triton's interpreter on a CPU that may be shared: each bound is SLACK times the real one.
SLACK=$(( DRY ? ${GPU_CHECK_DRY_SLACK:-4} : 1 ))
TOTAL_S="${GPU_CHECK_TOTAL_S:-$(( 470 * SLACK ))}"
if [ -z "${GPU_CHECK_BOUNDED:-}" ]; then
    GPU_CHECK_BOUNDED=1 exec timeout --kill-after=10 "$TOTAL_S" "$SELF" "$@"
fi
DEADLINE=$(( $(date +%s) + TOTAL_S - 10 ))
[ "$DRY" = 1 ] && shift
RESULTS_DIR="${1:-${OUT:-/tmp/gpu-check}}"
PY="${PYTHON:-python3}"
mkdir -p "$RESULTS_DIR"
RESULTS="$RESULTS_DIR/gpu-check.jsonl"
exec > >(tee -a "$RESULTS_DIR/gpu-check.log") 2>&1

emit() {  # emit KEY=VALUE ...: one JSON object appended to gpu-check.jsonl (numbers stay numbers)
    "$PY" -c '
import json, sys
row = {}
for arg in sys.argv[1:]:
    key, _, value = arg.partition("=")
    row[key] = int(value) if value.lstrip("-").isdigit() else value
print(json.dumps(row), flush=True)' "$@" >> "$RESULTS"
}

if [ "$DRY" = 0 ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu-check: no CUDA device visible to $PY's torch (or no torch); nothing was checked" >&2
    emit step=cuda status=failed reason="no CUDA device visible to $PY's torch"
    exit 2
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DRY" = 1 ]; then
    export TRITON_INTERPRET=1 VLLM_TARGET_DEVICE=cpu
else
    export TRITON_INTERPRET=0
fi
# The trimmed exllamav3 extension, where it was carried along: its backend's tests and benchmark rows then run.
EXT_DIR="${EXLLAMAV3_EXT_DIR:-$PWD/.gpucheck}"
if [ -f "$EXT_DIR/exllamav3_ext/__init__.py" ]; then
    export PYTHONPATH="$EXT_DIR:$PYTHONPATH"
fi
export EXLLAMAV3_TUNE_CACHE="${TMPDIR:-/tmp}/gpu-check-exl3-tune"  # exl3_gemm's autotune cache, fresh per machine
mkdir -p "$EXLLAMAV3_TUNE_CACHE"

failed=()
skipped=()
declare -A RUN_S BUDGET_S SOURCE
if ! plan=$("$PY" -m vllm_expert_offload.tools.gpu_check_budget); then
    echo "gpu-check: the step budgets could not be derived (vllm_expert_offload.tools.gpu_check_budget failed)" >&2
    emit step=budgets status=failed reason="vllm_expert_offload.tools.gpu_check_budget failed"
    exit 1
fi
echo "== step budgets (compile census; a dry run bounds each step by its own seconds x $SLACK)"
while IFS=$'\t' read -r key run budget source; do
    RUN_S["$key"]=$run BUDGET_S["$key"]=$budget SOURCE["$key"]=$source
    echo "   $key: $budget s = $source"
done <<< "$plan"
step() {  # step NAME COMMAND...: run within NAME's budget, record the result, go on either way
    local name="$1" key budget=""
    shift
    for key in "${!BUDGET_S[@]}"; do
        if [[ "$name" == "$key"* ]]; then
            budget=$(( DRY ? RUN_S[$key] * SLACK : BUDGET_S[$key] ))
            break
        fi
    done
    if [ -z "$budget" ]; then
        echo "gpu-check: step '$name' has no budget in vllm_expert_offload.tools.gpu_check_budget" >&2
        failed+=("$name (no budget)")
        emit step="$name" status=failed reason="no budget"
        return 0
    fi
    local left=$(( DEADLINE - $(date +%s) ))
    if [ "$budget" -gt "$left" ]; then  # not checked is not passed: the run fails, saying which steps it never ran
        failed+=("$name (not run: needs $budget s, $left s left)")
        emit step="$name" status=failed reason="not run: needs ${budget} s (${SOURCE[$key]}), ${left} s left of the run's ${TOTAL_S} s"
        return 0
    fi
    local limit=$budget
    echo "== $name (at most $limit s: ${SOURCE[$key]})"
    local log start rc
    log=$(mktemp)
    start=$(date +%s)
    timeout --kill-after=5 "$limit" "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    local seconds=$(( $(date +%s) - start ))
    if [ "$rc" -eq 0 ]; then
        emit step="$name" status=passed seconds="$seconds" dry_run="$DRY"
    else
        local why="exit $rc"
        [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why="timed out after $limit s"
        failed+=("$name ($why)")
        emit step="$name" status=failed seconds="$seconds" dry_run="$DRY" reason="$why" tail="$(tail -c 3000 "$log")"
    fi
    rm -f "$log"
    return 0
}
skip() {  # skip NAME REASON
    echo "== $1: skipped: $2"
    skipped+=("$1 ($2)")
    emit step="$1" status=skipped reason="$2"
}
pick() {  # pick REAL... -- STUB...: CMD=(REAL...), or under --dry-run CMD=(STUB...)
    local seen=0
    CMD=()
    for arg in "$@"; do
        if [ "$seen" = 0 ] && [ "$arg" = "--" ]; then
            seen=1
        elif [ "$seen" = "$DRY" ]; then
            CMD+=("$arg")
        fi
    done
}

GPU_TESTS=(tests/memory/test_arena.py tests/kernels/test_pointer_tables.py tests/kernels/test_triton_gpu.py
           tests/kernels/test_exllamav3_gpu.py tests/kernels/test_stream_host_tier.py)
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rs)

pick nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current,clocks.max.sm \
    --format=csv -- echo "dry run: nvidia-smi not queried"
step machine "${CMD[@]}"
step versions "$PY" -c "
import sys, torch, triton
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)
from vllm_expert_offload.kernels.exllamav3_backend import exllamav3_unavailable
device = torch.device('cuda', 0) if torch.cuda.is_available() else torch.device('cpu')
why = exllamav3_unavailable(device)
if why is None:
    import exllamav3_ext
    print('exllamav3_ext:', exllamav3_ext.__file__, exllamav3_ext.MANIFEST)
else:
    print('exllamav3 backend NOT checked:', why)"
step "imports without vLLM" "${PYTEST[@]}" tests/tools/test_gpu_check_imports.py
step topology "$PY" -m vllm_expert_offload.cli topology
# The probe and the benchmark first: they answer the question the run is for (how fast kernels read host-tier
# experts over PCIe against the copy engine and HBM); the tests after them, then the engine where vLLM exists.
pick "$PY" benchmarks/gpu_bandwidth_probe.py --out "$RESULTS_DIR/probe.jsonl" \
    -- "$PY" benchmarks/gpu_bandwidth_probe.py --smoke --out "$RESULTS_DIR/probe.jsonl"
step "bandwidth probe: HBM, pinned H2D copy, mapped host reads by size and per kernel pattern" "${CMD[@]}"
pick "$PY" benchmarks/bench_gpu_kernels.py --out "$RESULTS_DIR/bench.jsonl" --rooflines "$RESULTS_DIR/probe.jsonl" \
    --budget-s 125 -- "$PY" benchmarks/bench_gpu_kernels.py --smoke --out "$RESULTS_DIR/bench.jsonl" \
    --rooflines "$RESULTS_DIR/probe.jsonl"
step "kernel benchmark: graph replays, Zipf routing, L2 cold, per backend beside fp16 and rooflines" "${CMD[@]}"
pick "${PYTEST[@]}" -m gpu "${GPU_TESTS[@]}" -- "${PYTEST[@]}" --collect-only -m gpu "${GPU_TESTS[@]}"
step "GPU tests: mapped arena, tables over PCIe, Triton and exllamav3 kernels, CUDA-graph replay, CPU tier jobs" "${CMD[@]}"
# Issue 20 item 4: every backend's forward under torch.compile with CUDA-graph capture (reduce-overhead) vs eager.
pick "${PYTEST[@]}" -m gpu tests/kernels/test_compiled_gpu.py -- "${PYTEST[@]}" --collect-only -m gpu tests/kernels/test_compiled_gpu.py
step "compiled forwards (torch.compile reduce-overhead) vs eager" "${CMD[@]}"
ENGINE_STEPS=("tiny EXL3 MoE on the CUDA engine: V1/V2 runners, per backend, tokens vs HF"
              "tiny mixed pack (EXL3 experts, block-FP8 attention delegated to vLLM's fp8) on the CUDA engine")
if "$PY" -c "import vllm" 2>/dev/null; then
    # Registered, not just importable: vLLM finds the plugin through its entry point in every process.
    pick "$PY" -m pip install -q --no-deps --no-build-isolation -e . -- echo "dry run: pip install -e . not run"
    step "install the plugin (vLLM's entry point)" "${CMD[@]}"
    pick "$PY" scripts/gpu_engine_check.py -- echo "dry run: engine not started"
    step "${ENGINE_STEPS[0]}" "${CMD[@]}"
    pick "$PY" scripts/gpu_engine_check.py --fp8-mixed -- echo "dry run: engine not started"
    step "${ENGINE_STEPS[1]}" "${CMD[@]}"
else
    for name in "${ENGINE_STEPS[@]}"; do skip "$name" "no vLLM on this machine"; done
fi

status=passed
[ "${#failed[@]}" -gt 0 ] && status=failed
emit step=summary status="$status" dry_run="$DRY" failed="${failed[*]:-}" skipped="${skipped[*]:-}"
if [ "$status" = failed ]; then
    echo "gpu-check: FAILED: ${failed[*]}"
    exit 1
fi
echo "gpu-check: all steps that could run passed${skipped:+; skipped: ${skipped[*]}}"
