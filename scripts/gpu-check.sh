#!/usr/bin/env bash
# The GPU check, for a session that is lent a CUDA machine: one short run (< 8 minutes) whose output goes
# into docs/benchmarks.md. Needs a vLLM CUDA build (0.32 or 0.33) importable by python3 there; without
# one it runs the GPU unit tests only (arena mapping, pointer tables read over PCIe) and says so.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
    echo "== machine"; nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    echo "== topology"; python3 -m vllm_expert_offload.cli topology
    echo "== GPU unit tests (mapped host arena, pointer tables over PCIe)"
    python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_arena.py tests/test_pointer_tables.py
    if python3 -c "import vllm" 2>/dev/null; then
        echo "== tiny EXL3 MoE on the CUDA engine: all experts GPU tier vs all host tier, block 64 and 128"
        python3 - <<'PY'
from vllm_expert_offload.testing.engine import EngineSpec, generate_timed
from vllm_expert_offload.testing.tiny_models import build_tiny_model
import random
model = str(build_tiny_model(None, "qwen3_moe"))
rng = random.Random(0)
prompts = [[rng.randrange(3, 700) for _ in range(n)] for n in (7, 300, 600)]
runs = {}
for block in (64, 128):
    for frac in (None, 1.0):
        extra = None if frac is None else {"expert_offload": {"host_fraction": frac}}
        tokens, secs = generate_timed(EngineSpec(model, prompts, 32, block_size=block, dtype="float16",
                                                 additional_config=extra, extra_env={"VLLM_TARGET_DEVICE": "cuda"}))
        runs[(block, frac)] = tokens
        print(f"block {block} host_fraction {frac}: {3 * 32 / secs:.1f} tok/s, first tokens {tokens[1][:8]}")
print("host tier == GPU tier tokens:", all(runs[(b, 1.0)] == runs[(b, None)] for b in (64, 128)))
PY
    else
        echo "== no vLLM CUDA build importable: engine checks skipped"
    fi
} 2>&1 | tee "$OUT/gpu-check.log"
