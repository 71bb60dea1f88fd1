"""Installs the test-only DeepSeek-V4 CPU shim at interpreter start when VLLM_EXPERT_OFFLOAD_DSV4_CPU_SHIM=1.

Put on PYTHONPATH only by `dsv4_cpu_shim.serve_env()`, for `vllm serve` children: the API server and the
engine-core processes it starts all import vLLM before any test code could run in them.
"""

import os

if os.environ.get("VLLM_EXPERT_OFFLOAD_DSV4_CPU_SHIM") == "1":
    from vllm_expert_offload.testing.dsv4_cpu_shim import install

    install()
