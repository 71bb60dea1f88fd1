#!/usr/bin/env bash
# The GPU check: one bounded run on a lent CUDA machine (the H200 of docs/development.md, "The GPU check"), whose
# results go into docs/benchmarks.md. Needs only the checkout, python3 with torch (CUDA), Triton, numpy, safetensors
# and pytest; the trimmed exllamav3 extension (scripts/build-exllamav3-ext.sh, carried as .gpucheck/) when present;
# vLLM only for the engine steps, which are skipped without it.
#
#   scripts/gpu-check.sh [--dry-run] [RESULTS_DIR]        RESULTS_DIR defaults to $OUT, else /tmp/gpu-check
#
# The lent machine's run: run(command='scripts/gpu-check.sh "$OUT"', carry=[".gpucheck"], timeout_s=540).
#
# First, in the background, the CPU tier's C++ extension (tools/cpu_kernel_build.py: g++, ninja and the Python headers
# needed there), which the CPU tier's GPU tests wait for; then machine.txt (nvidia-smi -q, lscpu, numactl -H where
# present, the versions of torch, Triton, numpy, safetensors and pytest). Each step runs under its own time budget,
# derived from the compile census (vllm_expert_offload/tools/gpu_check_budget.py: the step's own seconds plus the Triton
# variants it compiles, each at its measured compile time times the decode copies its tables hold, printed with its
# source before the first step, with the whole run's), all inside GPU_CHECK_TOTAL_S (470 s). The essentials first: the
# GPU tests (mapped arena, pointer tables, host tier, the Triton MoE against the torch reference, CUDA-graph replay,
# ...) side by side, each its own pytest (their compiles spread over the 16 cores; the every-rate check in lanes of two
# Ks), then the benchmarks alone.
# A step (or side-by-side group) whose budget does not fit the time left is not started (a step killed mid-compile
# measures nothing) and fails the run. A dry run's stubs compile nothing: its steps are bound by their own seconds, 4
# times each. Every step's result is appended to RESULTS_DIR/gpu-check.jsonl as soon as it ends (with the tail of its
# output when it fails), the probe's and the benchmark's rows to probe.jsonl and bench.jsonl as they are measured,
# everything printed to gpu-check.log, the side-by-side steps' own logs (NN-step.log, the background build's too) to
# lanes.tar.gz as each group ends. Those six files are all RESULTS_DIR holds (the device tool sends back at most 8
# files); scratch (the logs as they come, exllamav3's autotune caches) lives outside it and is never sent back. Cut
# short by its bound, the run stops every step then running (each step's whole process group), records them as failed,
# packs their logs so far and fails. Exit status: 0 when every step that could run passed (the engine steps are skipped
# without vLLM), 1 when one failed or was not reached, 2 at once without a CUDA device (a run on the wrong machine is
# never a pass). --dry-run walks the same steps on a machine without CUDA, each CUDA part stubbed (GPU tests collected,
# not run; probe and benchmark at tiny sizes in Triton's interpreter): the plumbing, as tests/tools/test_gpu_check.py
# runs it.
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
# What the lent machine sends back is RESULTS_DIR alone, and at most 8 plain files of it (docs/development.md): this
# run writes 6 there, gpu-check.jsonl, gpu-check.log, machine.txt, probe.jsonl, bench.jsonl and lanes.tar.gz (the
# side-by-side steps' logs, packed as each group ends). Their logs and exllamav3's autotune caches live in SCRATCH,
# outside it; the caches are never sent back.
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-scratch.XXXXXX")
LANES="$RESULTS_DIR/lanes.tar.gz"
mkdir -p "$SCRATCH/lanes"
trap 'rm -rf "$SCRATCH"' EXIT
exec > >(tee -a "$RESULTS_DIR/gpu-check.log") 2>&1

emit() {  # emit KEY=VALUE ... [-- KEY=VALUE ...]: JSON objects appended to gpu-check.jsonl (numbers stay numbers)
    if [ -n "${HELD+x}" ]; then  # cut_short's rows: one python for all of them (it has seconds before SIGKILL)
        HELD+=("$@" --)
        return
    fi
    "$PY" -c '
import json, sys
row = {}
for arg in sys.argv[1:] + ["--"]:
    if arg == "--":
        if row:
            print(json.dumps(row), flush=True)
        row = {}
        continue
    key, _, value = arg.partition("=")
    row[key] = int(value) if value.lstrip("-").isdigit() else value' "$@" >> "$RESULTS"
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
# ninja for the CPU tier's extension build (torch's cpp_extension needs it), carried there where this machine has none.
if ! command -v ninja >/dev/null && [ -x "$EXT_DIR/bin/ninja" ]; then
    export PATH="$EXT_DIR/bin:$PATH"
fi
export EXLLAMAV3_TUNE_CACHE="$SCRATCH/tune/alone"  # exl3_gemm's autotune cache, fresh per run
mkdir -p "$EXLLAMAV3_TUNE_CACHE"

failed=()
skipped=()
declare -A RUN_S BUDGET_S SOURCE WAITS
PLANNED=()  # the planned steps' names, in order
if ! plan=$("$PY" -m vllm_expert_offload.tools.gpu_check_budget); then
    echo "gpu-check: the step budgets could not be derived (vllm_expert_offload.tools.gpu_check_budget failed)" >&2
    emit step=budgets status=failed reason="vllm_expert_offload.tools.gpu_check_budget failed"
    exit 1
fi
echo "== step budgets (compile census; a dry run bounds each step by its own seconds x $SLACK)"
while IFS=$'\t' read -r key run budget source beside waits back; do  # "-": an empty field
    if [ "$key" = "whole run" ]; then
        echo "   whole run: $budget s = $source (this run's bound: $TOTAL_S s)"
        continue
    fi
    RUN_S["$key"]=$run BUDGET_S["$key"]=$budget SOURCE["$key"]=$source
    [ "$waits" = - ] || WAITS["$key"]=$waits
    PLANNED+=("$key")
    where=""
    [ "$beside" = - ] || where="beside the other $beside${WAITS[$key]:+, after $waits}"
    [ "$back" = - ] || where="in the background, beside the steps after it"
    echo "   $key: $budget s = $source${where:+ [$where]}"
done <<< "$plan"
budget_of() {  # budget_of NAME: KEY and BUDGET of the step NAME starts with (1 when it has none)
    for KEY in "${!BUDGET_S[@]}"; do
        if [[ "$1" == "$KEY"* ]]; then
            BUDGET=$(( DRY ? RUN_S[$KEY] * SLACK : BUDGET_S[$KEY] ))
            return 0
        fi
    done
    echo "gpu-check: step '$1' has no budget in vllm_expert_offload.tools.gpu_check_budget" >&2
    failed+=("$1 (no budget)")
    emit step="$1" status=failed reason="no budget"
    return 1
}
fits() {  # fits NAME BUDGET SOURCE: whether BUDGET fits the time left; if not, NAME fails as not run
    local left=$(( DEADLINE - $(date +%s) ))
    if [ "$2" -gt "$left" ]; then  # not checked is not passed: the run fails, saying which steps it never ran
        failed+=("$1 (not run: needs $2 s, $left s left)")
        emit step="$1" status=failed reason="not run: needs ${2} s ($3), ${left} s left of the run's ${TOTAL_S} s"
        return 1
    fi
}
record() {  # record NAME LIMIT RC SECONDS LOG [WHY]: the result of a step that ran (or, with WHY, did not)
    if [ "$3" -eq 0 ]; then
        emit step="$1" status=passed seconds="$4" dry_run="$DRY"
    else
        local why="${6:-exit $3}"
        [ -z "${6:-}" ] && { [ "$3" -eq 124 ] || [ "$3" -eq 137 ]; } && why="timed out after $2 s"
        failed+=("$1 ($why)")
        emit step="$1" status=failed seconds="$4" dry_run="$DRY" reason="$why" tail="$(tail -c 3000 "$5")"
    fi
}
step() {  # step NAME COMMAND...: run within NAME's budget, record the result, go on either way
    local name="$1" KEY BUDGET
    shift
    budget_of "$name" || return 0
    fits "$name" "$BUDGET" "${SOURCE[$KEY]}" || return 0
    echo "== $name (at most $BUDGET s: ${SOURCE[$KEY]})"
    local log="$SCRATCH/step.log" rc seconds
    rm -f "$log.rc" "$log.pid"  # the previous step's
    IN_FLIGHT=("$name") IN_FLIGHT_LOGS=("$log") IN_FLIGHT_LIMIT=$BUDGET
    { limited "$log" "$BUDGET" "$@" 2>&1 | tee "$log"; } &
    wait $!  # not in the foreground: the run's bound (TERM) interrupts the wait, and cut_short stops the step
    IN_FLIGHT=()
    read -r rc seconds < "$log.rc" || rc=255 seconds=0
    record "$name" "$BUDGET" "$rc" "$seconds" "$log"
    return 0
}
limited() {  # limited LOG LIMIT COMMAND...: COMMAND within LIMIT seconds; `timeout` runs it in a process group of its
    # own, which the run's bound does not reach: its id goes to LOG.pid for cut_short, "STATUS SECONDS" to LOG.rc
    local start=$(date +%s)
    timeout --kill-after=5 "$2" "${@:3}" &
    echo $! > "$1.pid"
    wait $!
    echo "$? $(( $(date +%s) - start ))" > "$1.rc"
}
lane_log() {  # lane_log KEY: LOG, the next side-by-side or background step's log (NN-key.log, packed in lanes.tar.gz)
    LANE=$(( LANE + 1 ))
    LOG=$(printf '%02d-%s' "$LANE" "$(tr -cs 'A-Za-z0-9' '-' <<< "$1")")
    LOG="$SCRATCH/lanes/${LOG%-}.log"
    : > "$LOG"  # there from the start: a step cut short before its shell ran has its (empty) log packed
}
declare -A BG_NAME BG_LOG BG_LIMIT BG_END  # the background steps not yet reaped, by plan: name, log, bound, its end
background() {  # background NAME COMMAND...: start NAME now within its budget, beside the steps after it (see reap)
    local name="$1" KEY BUDGET LOG
    shift
    budget_of "$name" || return 0
    fits "$name" "$BUDGET" "${SOURCE[$KEY]}" || return 0
    echo "== $name (in the background, at most $BUDGET s: ${SOURCE[$KEY]})"
    lane_log "$KEY"
    limited "$LOG" "$BUDGET" "$@" > "$LOG" 2>&1 &
    BG_NAME[$KEY]=$name BG_LOG[$KEY]=$LOG BG_LIMIT[$KEY]=$BUDGET
    BG_END[$KEY]=$(( $(date +%s) + BUDGET + 5 ))  # + timeout's kill-after
}
await() {  # await KEY LIMIT: in a waiting step's shell, wait (at most LIMIT s) for the background step KEY to end;
    # fails, saying why, unless it passed
    local log="${BG_LOG[$1]:-}" start=$(date +%s) rc=""
    [ -n "$log" ] || { echo "not run: $1 did not start"; return 1; }
    until [ -s "$log.rc" ] || [ "$(date +%s)" -ge $(( start + $2 )) ]; do sleep 0.2; done
    read -r rc _ < "$log.rc" 2>/dev/null
    [ "$rc" = 0 ] || { echo "not run: $1 $([ -n "$rc" ] && echo "failed (exit $rc)" || echo "did not end")"; return 1; }
    echo "== $1 has ended (waited $(( $(date +%s) - start )) s): this step starts"
}
reap() {  # reap: record the background steps (waiting for those still running) and pack their logs
    local key rc seconds
    for key in "${!BG_LOG[@]}"; do
        until [ -s "${BG_LOG[$key]}.rc" ] || [ "$(date +%s)" -ge "${BG_END[$key]}" ]; do sleep 0.2; done
        echo "== ${BG_NAME[$key]}: output (${BG_LOG[$key]##*/} in $LANES)"
        tail -c 262144 "${BG_LOG[$key]}"
        rc=255 seconds=0
        read -r rc seconds < "${BG_LOG[$key]}.rc" 2>/dev/null || rc=255
        record "${BG_NAME[$key]}" "${BG_LIMIT[$key]}" "$rc" "$seconds" "${BG_LOG[$key]}"
        unset "BG_NAME[$key]" "BG_LOG[$key]" "BG_LIMIT[$key]" "BG_END[$key]"
    done
    pack_lanes
}
BESIDE=()  # the queued side-by-side steps: NAME, then its command quoted for eval
beside() {  # beside NAME COMMAND...: queue NAME to start with the others queued (together runs them)
    BESIDE+=("$1" "$(printf '%q ' "${@:2}")")
}
together() {  # together: start the queued steps at once, each within its budget (a step that waits for a background
    # step: after it ends); record each, in queued order
    local names=() keys=() budgets=() cmds=() pids=() logs=() longest=0 i KEY BUDGET LOG rc seconds why need w
    for (( i = 0; i < ${#BESIDE[@]}; i += 2 )); do
        budget_of "${BESIDE[i]}" || continue
        names+=("${BESIDE[i]}") keys+=("$KEY") budgets+=("$BUDGET") cmds+=("${BESIDE[i + 1]}")
        need=$BUDGET w=${WAITS[$KEY]:-}
        if [ -n "$w" ] && [ -n "${BG_END[$w]:-}" ] && [ ! -s "${BG_LOG[$w]}.rc" ]; then
            need=$(( BUDGET + BG_END[$w] - $(date +%s) ))  # what is left of the background step's bound, first
        fi
        [ "$need" -gt "$longest" ] && longest=$need
    done
    BESIDE=()
    [ "${#names[@]}" -gt 0 ] || return 0
    # Each may take the longest's time: the group is charged at its longest anyway (gpu_check_budget.run_seconds),
    # and a step's own seconds were measured alone, not beside a dozen processes starting CUDA and compiling.
    for i in "${!budgets[@]}"; do budgets[i]=$longest; done
    local left=$(( DEADLINE - $(date +%s) ))
    if [ "$longest" -gt "$left" ]; then  # as `fits`: none of the group starts
        for i in "${!names[@]}"; do
            failed+=("${names[i]} (not run: its side-by-side group needs $longest s, $left s left)")
            emit step="${names[i]}" status=failed reason="not run: needs ${budgets[i]} s (${SOURCE[${keys[i]}]}) beside \
steps of up to ${longest} s, ${left} s left of the run's ${TOTAL_S} s"
        done
        return 0
    fi
    for i in "${!names[@]}"; do  # each step's output as it comes, NN-name.log in lanes.tar.gz
        lane_log "${keys[i]}"
        logs[i]=$LOG
    done
    IN_FLIGHT=("${names[@]}") IN_FLIGHT_LOGS=("${logs[@]}") IN_FLIGHT_LIMIT=$longest
    for i in "${!names[@]}"; do
        echo "== ${names[i]} (at most ${budgets[i]} s, beside the others: ${SOURCE[${keys[i]}]})"
        ( # one autotune cache per step (exllamav3 writes its file in place); one Inductor compile worker each
          export EXLLAMAV3_TUNE_CACHE="$SCRATCH/tune/$(basename "${logs[i]}" .log)" TORCHINDUCTOR_COMPILE_THREADS=1
          mkdir -p "$EXLLAMAV3_TUNE_CACHE"
          limit=${budgets[i]} w=${WAITS[${keys[i]}]:-}
          if [ -n "$w" ]; then  # its bound is what is left of the group's once the background step has ended
              start=$(date +%s)
              why=$(await "$w" "$limit") || { echo "$why" > "${logs[i]}"; echo "1 0 $why" > "${logs[i]}.rc"; exit; }
              echo "$why" > "${logs[i]}"
              limit=$(( limit - $(date +%s) + start ))
              [ "$limit" -gt 0 ] || limit=1  # (`timeout 0` would not bound it at all)
          fi
          eval "limited \"\${logs[i]}\" $limit ${cmds[i]}" >> "${logs[i]}" 2>&1 ) &
        pids+=($!)
    done
    wait "${pids[@]}"
    IN_FLIGHT=()
    pack_lanes
    for i in "${!names[@]}"; do
        echo "== ${names[i]}: output (${logs[i]##*/} in $LANES)"
        # at most its last 256 KiB here: the device tool drops a file over 16 MiB, this log with it
        [ "$(stat -c %s "${logs[i]}")" -le 262144 ] || echo "[... its start: in $LANES]"
        tail -c 262144 "${logs[i]}"
        rc=255 seconds=0 why=""  # a step whose shell died before writing its status failed (not: the previous one's)
        read -r rc seconds why < "${logs[i]}.rc" 2>/dev/null || rc=255
        record "${names[i]}" "${budgets[i]}" "$rc" "$seconds" "${logs[i]}" "$why"
        rm -f "${logs[i]}.rc"
    done
}
pack_lanes() {  # pack_lanes: the side-by-side steps' logs so far into lanes.tar.gz, replaced by a rename in its own
    # folder (never torn; SIGKILL mid-tar leaves at most lanes.tar.gz.part beside it, a 7th file)
    tar -czf "$LANES.part" -C "$SCRATCH" --exclude='*.rc' --exclude='*.pid' lanes && mv -f "$LANES.part" "$LANES"
}
stop() {  # stop SIGNAL LOG...: signal the process group of each step (of LOG) still running
    local log
    for log in "${@:2}"; do
        [ -s "$log.pid" ] && [ ! -s "$log.rc" ] && kill -"$1" -- -"$(< "$log.pid")" 2> /dev/null
    done
    return 0
}
cut_short() {  # on the run's bound: `timeout` signals the whole process group, this script, its steps' shells, the
    # log's tee; not the steps' own process groups (each step's `timeout` makes one): stop signals those
    trap '' TERM INT PIPE
    exec >> "$RESULTS_DIR/gpu-check.log" 2>&1  # the tee is gone: straight to the log
    local i rc seconds why key names=("${IN_FLIGHT[@]}") logs=("${IN_FLIGHT_LOGS[@]}") limits=()
    for i in "${!IN_FLIGHT[@]}"; do limits+=("$IN_FLIGHT_LIMIT"); done
    for key in "${!BG_LOG[@]}"; do  # the background steps not yet recorded
        names+=("${BG_NAME[$key]}") logs+=("${BG_LOG[$key]}") limits+=("${BG_LIMIT[$key]}")
    done
    stop TERM "${logs[@]}"
    HELD=()
    for i in "${!names[@]}"; do
        if read -r rc seconds why < "${logs[i]}.rc" 2>/dev/null; then  # a step that had ended
            record "${names[i]}" "${limits[i]}" "$rc" "$seconds" "${logs[i]}" "$why"
            continue
        fi
        failed+=("${names[i]} (cut short)")
        emit step="${names[i]}" status=failed dry_run="$DRY" \
            reason="cut short: the run's bound of $TOTAL_S s was reached" tail="$(tail -c 3000 "${logs[i]}")"
    done
    pack_lanes
    emit step=summary status=failed dry_run="$DRY" failed="${failed[*]:-} (the run was cut short)" \
        skipped="${skipped[*]:-}"
    local rows=("${HELD[@]}")
    unset HELD
    emit "${rows[@]}"
    echo "gpu-check: FAILED: cut short by the run's bound ($TOTAL_S s): ${failed[*]:-}"
    stop KILL "${logs[@]}"  # what TERM left running
    exit 1
}
IN_FLIGHT=() IN_FLIGHT_LOGS=() IN_FLIGHT_LIMIT=0  # the steps running now, their logs and bound: see cut_short
LANE=0  # side-by-side steps started so far (their logs' numbers)
trap cut_short TERM INT
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

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -rs)
gpu_tests() {  # gpu_tests NAME TEST...: queue NAME, pytest's GPU tests among TEST... (a dry run collects them)
    local name="$1"
    shift
    pick "${PYTEST[@]}" -m gpu "$@" -- "${PYTEST[@]}" --collect-only -m gpu "$@"
    beside "$name" "${CMD[@]}"
}

lanes() {  # lanes PREFIX TEST WHAT: queue a step per planned step named PREFIX + ID, each running TEST[ID]
    local key
    for key in "${PLANNED[@]}"; do
        if [[ "$key" == "$1"* ]]; then
            gpu_tests "$key: $3" "$2[${key#"$1"}]"
        fi
    done
}

machine_facts() {  # machine_facts: what the results were measured on (the first step writes it to machine.txt)
    if [ "$DRY" = 1 ]; then echo "dry run: nvidia-smi not queried"; else nvidia-smi -q || return; fi
    local tool
    for tool in lscpu "numactl -H"; do  # the host's facts, where its tools are there (not the GPU's: no fault)
        if command -v "${tool%% *}" > /dev/null; then $tool; else echo "${tool%% *}: not on this machine"; fi
    done
    "$PY" -c '
from importlib.metadata import PackageNotFoundError, version
for name in ("torch", "triton", "numpy", "safetensors", "pytest"):
    try:
        print(name, version(name))
    except PackageNotFoundError:
        print(name, "not installed")'
}
export -f machine_facts
export DRY PY
# First, in the background: the CPU tier's extension (g++, about 100 s on one core), which the GPU tests of the CPU tier
# load; built at their first use, it would be unpriced and could be killed mid-compile by their bound. They wait for it
# (gpu_check_budget: waits_for). A dry run only checks that it could build here, after a stand-in for the build's time
# (long enough that the waiting step usually does wait).
pick "$PY" -m vllm_expert_offload.tools.cpu_kernel_build \
    -- bash -c 'sleep 20 && "$0" -m vllm_expert_offload.tools.cpu_kernel_build --check' "$PY"
background "CPU tier extension: built ahead of its first use (tools/cpu_kernel_build.py)" "${CMD[@]}"
step machine bash -o pipefail -c 'machine_facts | tee "$1"' machine "$RESULTS_DIR/machine.txt"
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
# Side by side: the essentials first, what the run must prove before anything is measured.
beside "imports without vLLM" "${PYTEST[@]}" tests/tools/test_gpu_check_imports.py
beside topology "$PY" -m vllm_expert_offload.cli topology
TRITON=tests/kernels/test_triton_gpu.py COMPILED=tests/kernels/test_compiled_gpu.py
gpu_tests "mapped host memory: arena (UVA), pointer tables over PCIe" tests/memory/test_arena.py \
    tests/kernels/test_pointer_tables.py
gpu_tests "CPU tier on the GPU: its jobs in stream order, graph replay (after its extension's build)" \
    tests/kernels/test_stream_host_tier.py
gpu_tests "Triton MoE vs torch reference (fused and glue, host tier over PCIe) and CUDA-graph replay" \
    "$TRITON::test_compiled_moe_matches_reference_with_host_tier_over_pcie" "$TRITON::test_cuda_graph_replay_equals_eager"
gpu_tests "Triton prefill (decode-once, grouped GEMMs) vs torch reference" \
    "$TRITON::test_compiled_prefill_matches_reference_with_host_tier_over_pcie"
gpu_tests "Triton mixed rates vs torch reference" "$TRITON::test_compiled_moe_of_mixed_rates_matches_reference"
# Every K and codebook, in lanes of two Ks (gpu_check_budget plans each lane, its test's parameter).
lanes "Triton every rate " "$TRITON::test_compiled_dequantize_in_this_devices_fold_form" \
    "decode-once in this device's fold form, every codebook of its Ks"
gpu_tests "exllamav3 kernels (where its extension was carried) vs torch reference, graph replay" \
    tests/kernels/test_exllamav3_gpu.py
# Issue 20 item 4: every backend's forward under torch.compile with CUDA-graph capture (reduce-overhead) vs eager.
gpu_tests "compiled Triton forwards (torch.compile reduce-overhead) vs eager" \
    "$COMPILED::test_triton_moe_op_compiled_with_graphs_equals_eager" \
    "$COMPILED::test_triton_linear_op_compiled_with_graphs_equals_eager"
gpu_tests "compiled exllamav3 forwards (torch.compile reduce-overhead) vs eager" \
    "$COMPILED::test_exllamav3_moe_op_compiled_with_graphs_equals_eager" \
    "$COMPILED::test_exllamav3_linear_op_compiled_with_graphs_equals_eager"
together
reap  # the background steps, done before the benchmarks start
# Then the benchmarks, alone on the machine: how fast kernels read host-tier experts over PCIe against the copy
# engine and HBM.
pick "$PY" benchmarks/gpu_bandwidth_probe.py --out "$RESULTS_DIR/probe.jsonl" \
    -- "$PY" benchmarks/gpu_bandwidth_probe.py --smoke --out "$RESULTS_DIR/probe.jsonl"
step "bandwidth probe: HBM, pinned H2D copy, mapped host reads by size and per kernel pattern" "${CMD[@]}"
pick "$PY" benchmarks/bench_gpu_kernels.py --out "$RESULTS_DIR/bench.jsonl" --rooflines "$RESULTS_DIR/probe.jsonl" \
    --models qwen3_30b_a3b --budget-s 60 -- "$PY" benchmarks/bench_gpu_kernels.py --smoke \
    --out "$RESULTS_DIR/bench.jsonl" --rooflines "$RESULTS_DIR/probe.jsonl"
step "kernel benchmark: graph replays, Zipf routing, L2 cold, per backend beside fp16 and rooflines" "${CMD[@]}"
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
