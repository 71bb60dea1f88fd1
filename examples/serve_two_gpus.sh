#!/usr/bin/env bash
# Serve a large EXL3 MoE on two GPUs (tensor parallel 2) with a placement plan made from routing statistics.
# The walk-through, step by step, is docs/serving-two-gpus.md; this script runs its steps 3, 5 and 6.
#
#   MODEL=/models/M STATS=stats.json GPU_BUDGET_GIB=60 ./examples/serve_two_gpus.sh
#
# Without STATS the plan spreads the GPU budget evenly over the layers; collect statistics with
# record_stats (on by default below) and run the script again. Every command here is checked against the
# tools' argument parsers by tests/tools/test_examples.py.
set -euo pipefail

MODEL=${MODEL:?set MODEL to the EXL3 checkpoint directory}
GPU_BUDGET_GIB=${GPU_BUDGET_GIB:-60}     # GiB of routed experts kept on each GPU
KV_CACHE_GIB=${KV_CACHE_GIB:-20}         # the KV cache per GPU you want, for the ledger check
GPU_MEMORY_GIB=${GPU_MEMORY_GIB:-95}     # each GPU's total memory in GiB (nvidia-smi MiB / 1024)
TOP_K=${TOP_K:-8}                        # num_experts_per_tok in the model's config.json
STATS=${STATS:-}                         # routing statistics from an earlier run (record_stats)
PLAN=${PLAN:-plan.json}
RECORD=${RECORD:-$PWD/stats-live.json}   # where this run records routing counts for the next plan
PORT=${PORT:-8000}

stats_args=()
[ -n "$STATS" ] && stats_args=(--stats "$STATS")

# 1. The plan and its memory ledger, per GPU; refused (non-zero exit) if it does not fit.
vllm-expert-offload plan --model "$MODEL" --tp 2 --gpu-budget-gib "$GPU_BUDGET_GIB" "${stats_args[@]}" \
    --kv-cache-gib "$KV_CACHE_GIB" --gpu-memory-gib "$GPU_MEMORY_GIB" --out "$PLAN"

# 2. What the plan can reach: a decode tok/s bound per stream, from bytes read per step (default bandwidths;
#    pass --gpu-check limits.json or --pcie-gbs/--hbm-gbs with yours).
vllm-expert-offload simulate --plan "$PLAN" --model "$MODEL" --top-k "$TOP_K" "${stats_args[@]}" \
    --concurrency 1,4,8

# 3. Serve. --shutdown-timeout lets SIGTERM release the host arenas cleanly (vLLM's default 0 kills at once), and
#    each worker gets 25 s (default 5) to exit before the engine kills it.
export VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=${VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS:-25}
offload=$(printf '{"expert_offload": {"plan": "%s", "record_stats": "%s"}}' "$PLAN" "$RECORD")
exec vllm serve "$MODEL" --tensor-parallel-size 2 --block-size 64 --port "$PORT" \
    --gpu-memory-utilization 0.92 --max-model-len 65536 --shutdown-timeout 30 \
    --additional-config "$offload"
